"""Preference tuning (trainer/train_dpo.py): the Flow-DPO loss, the frozen reference it compares with, and the
pairs the policy draws for itself from the built-in world (REFERENCE section 5; Wallace et al. 2023, Diffusion-DPO,
on rectified flow as flow_grpo's train_sd3_dpo.py).

    l = |v_target - v(x_t)|^2 per sample (the flow loss), the same for the frozen reference under no_grad;
    inside = -beta / 2 * ((l_chosen - l_ref_chosen) - (l_rejected - l_ref_rejected)),  loss = -logsigmoid(inside)

The chosen and the rejected image of a pair are noised with the same noise at the same sigma, so what differs
between their losses is the image alone. The implicit reward accuracy is the fraction of pairs with inside > 0
(ties count half), its margin the mean of inside.
"""
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dataset.preference_pairs import PairPool, PreferencePairs, encode_pairs, side
from dataset.training_data import StageData, sample_prompts_for, validation_data
from eval.eval_geneval import clauses_held, is_correct, training_prompts
from eval.sampling import sample_images, to_uint8
from eval.shape_scorer import find_objects
from model.errors import UserError
from model.model_lora import set_lora_scale
from model.rectified_flow import FlowSettings, Sampler, add_noise, predict_velocity, sample_sigmas
from model.token_routing import to_device


DRAW_BATCH = 256  # images sampled at once while drawing a round


@dataclass(frozen=True, kw_only=True)
class DPORecipe(FlowSettings):
    """How the Flow-DPO loss trains: model/rectified_flow.py's FlowSettings (the sigmas both sides of a pair
    share), and beta. The stage builds it from its arguments."""
    dpo_beta: float


@dataclass(frozen=True)
class PairRounds:
    """How a run draws its own pairs each round: prompts a round, images a prompt, which pairs of them (choice),
    how the images are drawn (`sampler`: model/rectified_flow.Sampler), the seed, and the captions never drawn
    (the scored prompts never become pairs)."""
    prompts: int
    images: int
    choice: str
    sampler: Sampler
    seed: int
    avoid: tuple = ()

    def resolved(self, drawing):
        """What the run took from the starting weights for --pair_sample_cfg and --pair_sample_shift (when
        `drawing` its pairs), for the resume checkpoint to record."""
        return {"pair_sample_cfg": self.sampler.cfg, "pair_sample_shift": self.sampler.shift} if drawing else {}


class Reference:
    """The frozen reference the loss compares with: called, a context giving its model (a separate frozen model, or
    the policy itself with its adapters switched off while the context lasts: `adapters_off`)."""

    def __init__(self, model, adapters_off=False):
        self.model, self.adapters_off = model, adapters_off

    def __call__(self):
        return self

    def __enter__(self):
        if self.adapters_off:
            set_lora_scale(self.model, 0.0)
        return self.model

    def __exit__(self, *exc):
        if self.adapters_off:
            set_lora_scale(self.model, 1.0)


def frozen_copy_reference(reference):
    """The reference as a separate frozen model (a full fine-tune: the starting weights, copied)."""
    return Reference(reference)


def adapters_off_reference(model):
    """The reference as the policy's own frozen base with its adapters switched off (a LoRA: no second copy)."""
    return Reference(model, adapters_off=True)


@dataclass(frozen=True)
class DPOLearner:
    """What the DPO loop trains: the policy, and the policy as its processes train it (`train_model`: DDP, or itself on
    one process and under FSDP), the frozen reference (Reference), the optimizer, the EMA (or None), what the loss
    reads, and the CUDA graphs its step may run as (StepGraphs: trainer_utils.run_graphs)."""
    model: torch.nn.Module
    train_model: torch.nn.Module
    reference: Reference
    optimizer: torch.optim.Optimizer
    ema: object
    components: object
    recipe: DPORecipe
    graphs: object


def pair_batch_features(components, batch, device):
    """A micro-batch of pairs -> their features: read from the cache, or encoded now."""
    if "chosen_latents" in batch:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # pinned: async
    return encode_pairs(components, batch["chosen"].to(device, non_blocking=True),
                        batch["rejected"].to(device, non_blocking=True), batch["caption"])  # pinned: async


def dpo_inside(errors, reference_errors, beta):
    """Per-sample flow losses [2n] (chosen first, then rejected) of the policy and of the reference -> inside [n]."""
    chosen, rejected = errors.chunk(2)
    ref_chosen, ref_rejected = reference_errors.chunk(2)
    return -0.5 * beta * ((chosen - ref_chosen) - (rejected - ref_rejected))


DPO_VALUES = ("dpo", "reward_accuracy", "reward_margin")  # what dpo_loss_of gives, in the metrics' order


def flow_dpo_loss(policy, reference, components, batch, generator, recipe):
    """The Flow-DPO loss of one micro-batch of pairs -> {"dpo": the loss, "reward_accuracy", "reward_margin"}
    (the last two detached: logged, adding nothing to the gradient): pair_inputs, then dpo_loss_of."""
    return dpo_loss_of(policy, reference, pair_inputs(policy, components, batch, generator, recipe), recipe)


def pair_inputs(policy, components, batch, generator, recipe):
    """A micro-batch of pairs' part of the loss that is not the models': both sides' latents (chosen first), and the
    text, noise, sigmas and routed tokens the two sides share, drawn and on the policy's device -> {name: tensor or
    None} for dpo_loss_of. `generator` draws each side's latent sample, the shared noise, the shared sigmas and the
    shared routed tokens (the policy and the reference route alike), in that order, as `recipe` (DPORecipe) says;
    on the host, so a captured step (--cuda_graph) replays the same random streams as an eager one."""
    device = next(policy.parameters()).device
    with torch.no_grad():
        features = pair_batch_features(components, batch, device)
        tokens, pooled = components.condition(features)
        chosen = components.latents(side(features, "chosen"), generator)
        rejected = components.latents(side(features, "rejected"), generator)
    noise = to_device(torch.randn(chosen.shape, generator=generator), device)
    s = to_device(sample_sigmas(len(chosen), recipe.sigma_scheme, recipe.logit_mean, recipe.logit_std,
                                shift=recipe.train_shift, generator=generator), device)
    return {"latents": torch.cat([chosen, rejected]), "tokens": tokens, "pooled": pooled, "noise": noise, "sigmas": s,
            "route": recipe.routing.draw(chosen, generator)}


def step_pairs(batches, learner, generator, throughput):
    """A step's micro-batches of pairs on the device with their random draws, made on the host (pair_inputs each)
    -> (those inputs, their FLOPs: the policy's forward and backward and the reference's forward, on both sides of
    each pair). Eager, each micro-batch's inputs are made as it is read (one on the device at a time; the loss
    draws nothing, so the draws keep their order); a graph copies all of a step's at once."""
    batches = list(batches)
    flops = sum((throughput.flops(batch, samples=2) + throughput.flops(batch, 2, grad=False, routed=True)).model
                for batch in batches)
    inputs = (pair_inputs(learner.model, learner.components, batch, generator, learner.recipe) for batch in batches)
    return (list(inputs) if learner.graphs.on else inputs), flops


def pair_errors(model, both, x_t, target, recipe):
    """Per-sample flow losses [2n] of `model` on both sides of a micro-batch of pairs noised to `x_t` (`both`: the
    text, sigmas and route, each for the two sides)."""
    dtype = recipe.autocast
    with torch.autocast(x_t.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        v = predict_velocity(model, x_t, both["tokens"], both["pooled"], both["sigmas"], recipe.prediction,
                             both["route"])
    return (v.float() - target).pow(2).flatten(1).mean(1)


def dpo_loss_of(policy, reference, inputs, recipe):
    """The Flow-DPO loss of `inputs` (pair_inputs) -> {"dpo", "reward_accuracy", "reward_margin"}, the last two
    detached. `reference()` is a context giving the frozen reference model (Reference). Device work alone: what a
    CUDA graph captures."""
    # what the two sides share, repeated for both here (the inputs, which a graph keeps a copy of, hold it once)
    both = {name: torch.cat([inputs[name], inputs[name]]) for name in ("tokens", "pooled", "noise", "sigmas")}
    route = inputs["route"]
    both["route"] = None if route is None else replace(route, keep=torch.cat([route.keep, route.keep]))
    x0, noise = inputs["latents"], both["noise"]
    x_t, target = add_noise(x0, noise, both["sigmas"]), (noise - x0).float()
    with torch.no_grad(), reference() as reference_model:
        reference_errors = pair_errors(reference_model, both, x_t, target, recipe)
    inside = dpo_inside(pair_errors(policy, both, x_t, target, recipe), reference_errors, recipe.dpo_beta)
    accuracy = (inside > 0).float().mean() + 0.5 * (inside == 0).float().mean()
    return {"dpo": -F.logsigmoid(inside).mean(), "reward_accuracy": accuracy.detach(),
            "reward_margin": inside.mean().detach()}


# ----------------------------------------------------------------------------------------------------------------
# The pairs the policy draws for itself


def score_images(spec, images):
    """uint8 images [k, H, W, 3] of one prompt -> (fraction of its clauses each satisfies [k], each right [k])."""
    scores, right = [], []
    for image in images:
        found = find_objects(image)
        held, total = clauses_held(spec, found)
        scores.append(held / total)
        right.append(is_correct(spec, found))
    return np.array(scores), np.array(right)


def pair_indices(scores, choice):
    """Scores of a prompt's images -> (chosen, rejected) indices: "best_worst" = the best and the worst image (the
    first of equals), "all" = every two whose scores differ, the higher scored chosen; none where all tie."""
    if choice == "all":
        return [(i, j) for i in range(len(scores)) for j in range(len(scores)) if scores[i] > scores[j]]
    best, worst = int(np.argmax(scores)), int(np.argmin(scores))
    return [(best, worst)] if scores[best] > scores[worst] else []


def pairs_per_prompt(images_per_prompt, choice):
    """The most pairs pair_indices makes of one prompt's images (all scores distinct)."""
    return images_per_prompt * (images_per_prompt - 1) // 2 if choice == "all" else 1


@torch.no_grad()
def draw_round(model, components, specs, seeds, rounds, device):
    """Sample rounds.images images of each spec's caption (spec k's noise seeded from seeds[k] on), DRAW_BATCH at
    a time, and score them -> [[(caption, chosen uint8, rejected uint8), ...] per spec] (empty: all its images
    scored alike), and [(mean score, fraction right) per spec]. rounds.choice: "best_worst" = a prompt's best and
    worst image, "all" = every two of its images whose scores differ, the higher scored chosen."""
    per_prompt, batch = rounds.images, DRAW_BATCH
    captions = [spec["caption"] for spec in specs for _ in range(per_prompt)]
    noise_seeds = [seed + j for seed in seeds for j in range(per_prompt)]
    images = np.concatenate([to_uint8(sample_images(
        model, components, captions[i:i + batch], noise_seeds[i:i + batch], rounds.sampler, device))
        for i in range(0, len(captions), batch)])
    pairs, stats = [], []
    for k, spec in enumerate(specs):
        own = images[k * per_prompt:(k + 1) * per_prompt]
        scores, right = score_images(spec, own)
        pairs.append([(spec["caption"], own[i], own[j]) for i, j in pair_indices(scores, rounds.choice)])
        stats.append((float(scores.mean()), float(right.mean())))
    return pairs, stats


def preference_data(pairs, rounds, components, settings, log):
    """What Flow-DPO trains on (a StageData): the pairs of the manifest `pairs`, or for 'builtin' a pool the run
    fills from its own samples (`rounds`: PairRounds; the built-in components only), the grids' prompts (a
    --sample_prompts file's, else the pairs' own), and the validation images (`settings`: the stage's
    DataSettings, --val_data)."""
    if pairs != "builtin":
        dataset = PreferencePairs(pairs, settings.resolution, log=log)
    elif components.spec["kind"] != "builtin":
        raise UserError("--pairs builtin draws and scores images of the built-in world, which needs the built-in "
                        "components: with --base, pass a .jsonl of pairs")
    else:
        dataset = PairPool(rounds.prompts * pairs_per_prompt(rounds.images, rounds.choice), settings.resolution)
    prompts = sample_prompts_for(dataset, settings.sample_prompts)
    return StageData(dataset, prompts, validation_data(settings, None, log))


def refresh_pool(pool, round_, model, components, info, rounds, log):
    """Fill `pool` with round `round_`'s pairs: `rounds.prompts` fresh training-grammar prompts (none in rounds.avoid),
    each sampled `rounds.images` times by the current `model` and scored, dealt round-robin to the processes and
    gathered, so every process holds the same pool. -> {"pair_score", "pair_right", "pairs"} for the metrics."""
    specs = training_prompts(rounds.prompts, seed=rounds.seed * 100003 + round_, avoid=rounds.avoid)
    per_rank = -(-len(specs) // info.world_size)  # every rank samples as many (its last repeated): equal forwards
    mine = list(range(info.rank, len(specs), info.world_size))
    mine += mine[-1:] * (per_rank - len(mine))
    seed = (rounds.seed * 100003 + round_) * 1000
    pairs, stats = draw_round(model, components, [specs[k] for k in mine], [seed + k * rounds.images for k in mine],
                              rounds, info.device)
    drawn = dict(zip(mine, zip(pairs, stats)))
    if info.world_size > 1:
        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, drawn)
        drawn = {k: v for part in gathered for k, v in part.items()}
    pairs, stats = [drawn[k][0] for k in range(len(specs))], [drawn[k][1] for k in range(len(specs))]
    kept = [pair for own in pairs for pair in own]
    score, right = np.mean([s for s, _ in stats]), np.mean([r for _, r in stats])
    log(f"pairs, round {round_}: {sum(map(bool, pairs))} of {len(specs)} prompts gave {len(kept)} pairs; the "
        f"policy's images hold "
        f"{score:.3f} of their prompts' clauses, {right:.3f} are right")
    if kept:
        captions, chosen, rejected = zip(*kept)
        pool.fill(round_, captions, np.stack(chosen), np.stack(rejected))
    elif pool.captions:  # every prompt's images scored alike: train on the last round's pairs a while longer
        pool.round = round_
    else:
        raise UserError(f"no preference pairs: all {rounds.images} images of each of the {len(specs)} prompts "
                        "scored alike; raise --pair_images or --pair_prompts, or sample with more noise")
    return {"pair_score": float(score), "pair_right": float(right), "pairs": len(kept)}
