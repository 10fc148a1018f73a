"""Preference tuning (Flow-DPO): teach a trained model to prefer, of two images of a prompt, the one a verifier or a
person chose, so that it draws what the sentence says and not only its words.

    python trainer/train_dpo.py                                    # the demo: tune out/pretrain_tiny on its own pairs
    python trainer/train_dpo.py --lora_rank 16                     # adapters instead of all weights
    python trainer/train_dpo.py --pairs my_pairs.jsonl --from_weight sft
    python trainer/train_dpo.py --base /models/sd3-medium --from_weight base --preset sd3-medium --pairs pairs.jsonl
    torchrun --nproc_per_node 2 trainer/train_dpo.py

It trains the Flow-DPO loss (trainer/preference.py) on pairs whose chosen and rejected images share the noise and
the sigma, against a frozen reference (the starting weights; with --lora_rank, the same model with its adapters
off). With --pairs builtin (the default) the run draws its own pairs: every --pair_refresh steps, fresh prompts of
the training grammar (never a held-out pair, never a prompt the GenEval-style eval scores), each sampled
--pair_images times by the current model, each image scored by the shape scorer (the fraction of its prompt's
clauses that hold), and of each prompt every two images whose scores differ made a pair, the higher scored chosen
(online DPO). Or --pairs a .jsonl with one line {"prompt", "chosen", "rejected"} (image paths) per pair. AdamW on
what trains; the recipe's values are parse_args' set_defaults. Writes
out/dpo_<preset>.json (with --lora_rank: out/lora/lora_<lora_name>_<preset>.safetensors), the metrics (the DPO
loss, the implicit reward accuracy and margin, and each round's pair scores) in out/dpo_<preset>_metrics.jsonl,
sample grids in out/samples/ (step 0: the starting weights) and the resume checkpoint (the policy, its optimizer,
the current pairs) in checkpoints/.
Score it with `python eval/eval_geneval.py --weights dpo_tiny`.

Read top to bottom: parse_args is the recipe, main the set-up, outputs what the run writes, accumulate the
loss and backward of a step's micro-batches, train the loop.
The two files it names: trainer/preference.py (the loss: step_pairs draws a step's inputs, dpo_loss_of computes;
and the pairs) and trainer/trainer_utils.py (everything around the loop: start_run, lr_at the learning rate,
save_step what a save writes and deletes).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.preference_pairs import PairPool  # noqa: E402
from dataset.training_data import ready_data  # noqa: E402
from eval.eval_geneval import PROMPTS_PER_TASK, all_prompts  # noqa: E402
from model.block_swap import swap_request  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.memory import MemoryPlan, fit_memory  # noqa: E402
from model.model_lora import (  # noqa: E402
    ADAPTER_KINDS, TARGET_GROUPS, Adapter, LoRAExport, LoRAWeights, resolve_targets,
)
from model.model_sd3light import PRESETS, SD3LightConfig  # noqa: E402
from model.precision import StagePrecision, torch_dtype  # noqa: E402
from model.rectified_flow import PREDICTIONS, Sampler  # noqa: E402
from model.token_routing import TokenRouting  # noqa: E402
from model.weights import (  # noqa: E402
    WeightsExport, check_export, load_components, lora_file, lora_run_name, run_name, weights_identity,
)
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_adapter_kind_args, add_block_swap_args, add_export_args, add_flow_args,
    add_graph_args, add_optimizer_args, add_plumbing_args, add_routing_args, add_sampling_args, add_schedule_args,
    add_validation_args, non_negative_float, non_negative_int, positive_float, positive_int,
)
from trainer.mechanics.checkpointer import Checkpointer, RunSpec, checkpoint_stem  # noqa: E402
from trainer.mechanics.distributed import (  # noqa: E402
    NamedOptimizerState, any_process, data_parallel, mean_over_processes, sync_gradients, whole,
)
from trainer.mechanics.ema import EMA  # noqa: E402
from trainer.mechanics.metrics import StepRows, Throughput  # noqa: E402
from trainer.mechanics.optimizers import adamw  # noqa: E402
from trainer.mechanics.position import Position  # noqa: E402
from trainer.mechanics.previews import Previews, step_zero  # noqa: E402
from trainer.mechanics.run_lock import hold_run_folders  # noqa: E402
from trainer.mechanics.signals import StopSignal  # noqa: E402
from trainer.preference import (  # noqa: E402
    DPO_VALUES, DPOLearner, DPORecipe, PairRounds, adapters_off_reference, dpo_loss_of, frozen_copy_reference,
    preference_data, refresh_pool, step_pairs,
)
from trainer.networks import adapted_frozen, adapter_count, load_network, start_weights_source  # noqa: E402
from trainer.trainer_utils import (  # noqa: E402
    NonFiniteSteps, Outputs, finish_run, log_peak, lr_at, not_finite, resume_run, run_graphs, sample_grid, save_step,
    set_lr, start_run, write_steps,
)


def parse_args(argv=None):
    parser = StageParser(__doc__)
    identity, recipe = parser.identity.add_argument, parser.recipe.add_argument
    identity("--preset", default="tiny", choices=list(PRESETS), help="the size of the starting weights")
    identity("--resolution", type=positive_int, default=32, help="image size: the side of the square")
    identity("--prediction", default=None, choices=PREDICTIONS, help="must be what the starting weights predict (leave "
             "it unset: it is read from them)")
    identity("--pairs", default="builtin", help="'builtin' = drawn by the model and scored on the built-in world, or a "
             ".jsonl of {\"prompt\", \"chosen\", \"rejected\"} lines (image paths)")
    identity("--lora_rank", type=non_negative_int, default=0, help="0 = tune all weights; else train adapters of this "
             "rank (the reference: the adapters off)")
    identity("--lora_name", default="dpo", help="with --lora_rank: out/lora/lora_<name>_<preset>.safetensors")
    recipe("--from_weight", default="pretrain", help="starting weights (the policy and the reference): a stage name "
           "in --out_dir ('pretrain' = pretrain_<preset>, 'sft' = sft_<preset>), the path of a weights manifest or "
           "of a diffusers folder, or 'base' = --base's transformer")
    recipe("--dpo_beta", type=positive_float, default=1000.0, help="how far the policy may move from the reference "
           "for a preference: higher = stays nearer")
    add_adapter_kind_args(parser)  # with --lora_rank: LoRA, DoRA or LoKr
    recipe("--lora_alpha", type=positive_float, default=None, help="default: rank (scale 1)")
    recipe("--lora_targets", default="attention", help=f"comma-separated groups ({', '.join(TARGET_GROUPS)}) or "
           "module name suffixes")
    recipe("--pair_prompts", type=positive_int, default=128, help="builtin pairs: prompts drawn a round (the pool "
           "holds as many pairs as their images can make)")
    recipe("--pair_images", type=positive_int, default=8, help="builtin pairs: images a prompt")
    recipe("--pair_choice", default="all", choices=["best_worst", "all"], help="builtin pairs: of a prompt's "
           "images, the best and the worst, or every two whose scores differ")
    recipe("--pair_refresh", type=positive_int, default=25, help="builtin pairs: steps between rounds")
    recipe("--pair_sample_steps", type=positive_int, default=4, help="builtin pairs: Euler steps (a fifth of the "
           "grids', scoring alike: drawing pairs is most of the run's time)")
    recipe("--pair_sample_cfg", type=non_negative_float, default=None, help="default: the starting weights' sampling")
    recipe("--pair_sample_shift", type=positive_float, default=None)
    add_optimizer_args(parser)  # batch (of pairs), learning rate, weight decay, clipping, EMA, seed
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_flow_args(parser, loss=False)  # the sigmas both sides of a pair share
    add_routing_args(parser)  # token routing (off)
    add_block_swap_args(parser)  # with adapters: the first blocks streamed from host memory (off)
    add_graph_args(parser)  # the step as a CUDA graph (auto: off for now)
    add_sampling_args(parser)
    add_export_args(parser)
    add_validation_args(parser)  # --val_data: images, scored by the policy's flow loss
    add_plumbing_args(parser, data=None)
    # The recipe: a fixed number of steps of pairs, AdamW at a low rate on all weights, a short warmup and constant
    # after, no EMA; sigmas shifted as the sampler's (the noisy end, where a layout is decided)
    parser.set_defaults(batch_size=16, accumulation_steps=1, learning_rate=3e-5, weight_decay=0.0, grad_clip=1.0,
                        ema_decay=0.0, seed=0, warmup_steps=10, min_lr_ratio=1.0, epochs=1, max_steps=200,
                        sigma_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, train_shift=3.0,
                        save_interval=100, sample_interval=0, save_dtype="bf16")
    # The real-model recipe, for published SD3 / SD3.5 weights (--preset sd3-medium, sd3.5-medium, sd3.5-large), in
    # place of the demo's; any flag you pass still wins. From Flow-DPO on SD3.5-Medium in yifan123/flow_grpo
    # (config/dpo.py, config/base.py, scripts/train_sd3_dpo.py), whose loss is ours (-beta/2 inside the sigmoid):
    #   dpo_beta 100 (config.train.beta), adapters of rank 32 and alpha 64 (LoraConfig r=32, lora_alpha=64: a
    #   scale of 2; with another --lora_rank give --lora_alpha too, or the scale changes),
    #   learning_rate 3e-4, weight_decay 1e-4, grad_clip 1.0, constant rate, resolution 512, 24 pairs a step
    #   (train_batch_size 24; here 4 a micro-batch and 6 micro-batches, recomputing what blocks the card needs, and
    #   swapping the fewest blocks to host memory where recomputing is not enough: blocks_to_swap auto)
    parser.set_real_model_defaults(dpo_beta=100.0, lora_rank=32, lora_alpha=64.0, learning_rate=3e-4,
                                   weight_decay=1e-4, resolution=512, batch_size=4, accumulation_steps=6,
                                   gradient_checkpointing="auto", blocks_to_swap="auto", log_interval=10)
    return parser.parse_args(argv)


def pair_rounds(args, source, autocast):
    """How --pairs builtin draws its rounds: --pair_sample_cfg and --pair_sample_shift unset are the starting
    weights' (`source`'s) sampling; the prompts the GenEval-style eval scores are never drawn."""
    sampling = source["sampling"]
    sampler = Sampler(args.resolution, args.pair_sample_steps,
                      sampling["cfg"] if args.pair_sample_cfg is None else args.pair_sample_cfg,
                      args.pair_sample_shift or sampling["shift"], source["prediction"], autocast=autocast)
    scored = tuple(spec["caption"] for spec in all_prompts(PROMPTS_PER_TASK))
    return PairRounds(args.pair_prompts, args.pair_images, args.pair_choice, sampler, args.seed, scored)


def policy(args, source, precision, info, plan, log):
    """The policy and the frozen reference (in --frozen_dtype): a copy of the starting weights; or with --lora_rank
    the base frozen with adapters on it, its first blocks streamed from host memory where the memory plan swaps
    them, and no copy (the reference is the policy with them off); each recomputing the blocks the plan says in
    backward."""
    checkpointing = plan.checkpointing
    if args.lora_rank:
        model = adapted_frozen(source, precision.frozen, info, plan.blocks_to_swap,
                               (args.lora_targets, args.lora_rank, args.lora_alpha, 0.0,
                                Adapter(args.adapter, args.lokr_factor)), log)
        reference = None
    else:
        model, reference = (load_network(source, role, precision.frozen, info) for role in ("trained", "frozen"))
    for net in (model, reference):
        if net is not None:
            net.gradient_checkpointing = checkpointing
    adapters = f"{ADAPTER_KINDS[args.adapter]} rank {args.lora_rank} on " if args.lora_rank else ""
    log(f"policy {adapters}{source['manifest']} (step {source['step']}), Flow-DPO with beta {args.dpo_beta:g} against "
        f"{'its adapters off' if args.lora_rank else 'a frozen copy'}; pairs: {args.pairs}")
    return model, reference


def memory_plan(args, config):
    """What the memory estimate weighs (model/memory.py): the adapters on a frozen transformer of `config` (a bad
    --lora_targets: one line), or every weight and the frozen reference; AdamW on what trains, the EMA, and a
    micro-batch of pairs (two images forward each)."""
    trained = (adapter_count(config, args.lora_targets, args.lora_rank, args.lora_alpha,
                             Adapter(args.adapter, args.lokr_factor)),) if args.lora_rank \
        else ("trained", "frozen")
    streamable = None if args.lora_rank else "Flow-DPO swaps the blocks of a frozen base: pass --lora_rank (adapters)"
    return MemoryPlan(trained, "adamw", args.ema_decay > 0, args.ema_device, 2 * args.batch_size, args.resolution,
                      args.gradient_checkpointing,
                      blocks_to_swap=swap_request(args.blocks_to_swap, bool(args.fsdp), streamable,
                                                  config.num_layers))


def main(argv=None):
    """The set-up as plain calls, one large thing in memory at a time; the run resumed or started; the loop."""
    args = parse_args(argv)
    # The processes, the log, the resume checkpoint asked for (read and verified; None: a fresh run), the precision
    # (cpu_bf16=False: the loss is beta times a difference of error differences, as small as bf16's rounding of the
    # prediction: BENCHMARKS.md), the seed
    name = lora_run_name(args.lora_name, args.preset) if args.lora_rank else run_name("dpo", args.preset)
    run = start_run(StagePrecision("dpo", cpu_bf16=False, frozen_transformer=True), name, args.run_settings)
    info, metrics, saved, precision = run.info, run.metrics, run.saved, run.precision

    # The starting weights' record and components; the pairs (and their cache, when it is on); the estimate; the
    # policy and the frozen reference; the token routing and the memory plan checked first (a bad value: one line)
    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    prediction, config = source["prediction"], SD3LightConfig.from_dict(source["transformer"])
    routing = TokenRouting.for_model(config, args.route_ratio, args.route_first, args.route_last)
    plan = memory_plan(args, config)
    rounds = pair_rounds(args, source, precision.autocast)
    components = load_components(source, info.device, torch_dtype(precision.frozen))
    check_export(components, prediction, args.export_pipeline, args.export_single_file)
    # the pairs, the grids' prompts and the validation images, made ready for the steps (sizes checked, validation
    # encoded, the cache built when it is on)
    data = ready_data(args.data_settings, preference_data(args.pairs, rounds, components, args.data_settings,
                                                          metrics.log), components, config, info, args.batch_size,
                      metrics.log)
    if data.dataset is None:  # --cache_only: the cache is built
        return None
    plan = fit_memory(config, plan, components, precision, info, metrics.log)
    model, reference = policy(args, source, precision, info, plan, metrics.log)
    log_peak(info, "the weights loaded", metrics.log)

    # DDP or FSDP (the reference sharded, not wrapped); AdamW on what trains: all weights, or the adapters
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    reference = adapters_off_reference(model) if args.lora_rank else \
        frozen_copy_reference(data_parallel(reference, info, args.compile, precision.autocast))
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], args.learning_rate, args.weight_decay)
    ema = EMA(LoRAWeights(model) if args.lora_rank else model, args.ema_decay, args.ema_device) \
        if args.ema_decay > 0 else None
    recipe = DPORecipe(prediction=prediction, dpo_beta=args.dpo_beta, sigma_scheme=args.sigma_scheme,
                       logit_mean=args.logit_mean, logit_std=args.logit_std, train_shift=args.train_shift,
                       autocast=precision.autocast, routing=routing)
    graphs = run_graphs(args.cuda_graph, info, model, routing, False, metrics.log)  # or one line
    learner = DPOLearner(model, train_model, reference, optimizer, ema, components, recipe, graphs)
    # where the run is in its data, and the schedule: --max_steps, or --epochs (the loop's lr_at reads it)
    workers = 0 if isinstance(data.dataset, PairPool) else args.num_workers  # a pool is read here (no stale copy)
    position = Position(data.dataset, args.resolution, args.batch_size, args.accumulation_steps, args.seed, info,
                        workers)
    position.plan(args.max_steps, args.epochs)
    folders = hold_run_folders((args.out_dir, args.save_dir), name, info)  # before the first write: one run of it
    out = outputs(args, info, position, learner, metrics, source, {
        "prediction": prediction, **precision.as_args(), **rounds.resolved(isinstance(data.dataset, PairPool))})
    resume_run(saved, out, "dpo", optimizer.param_groups[0]["params"], info)  # a resume that does not fit: one line
    if saved is None:  # step 0: the starting weights' grid and validation loss, to compare with
        step_zero(out.previews, metrics, data)
    del saved  # its memory-mapped tensors are the run's own now: the file is not held for the rest of the run
    return train(args, info, position, data, learner, out, rounds)


def outputs(args, info, position, learner, metrics, source, resolved):
    """What the run writes: the metrics; the resume checkpoint (the position, the policy or its adapters, its
    optimizer, the EMA, the current pairs, the metrics' wandb id; `resolved`: the settings decided at start-up);
    the policy (its EMA if on): its adapters naming their base (--lora_rank), or its whole weights, recording what
    it started from (`source`); sample grids and the validation loss of those weights."""
    model, ema, components, prediction = learner.model, learner.ema, learner.components, learner.recipe.prediction
    name = metrics.name
    sampling, start = {"steps": args.sample_steps, "cfg": args.sample_cfg, "shift": args.sample_shift}, \
        weights_identity(source, args.out_dir)
    record = {"stage": "dpo", "preset": args.preset, "resolution": args.resolution, "prediction": prediction,
              "ema": ema is not None, "save_dtype": args.save_dtype, "transformer": model.config.to_dict(),
              "components": components.spec, "sampling": sampling, "base" if args.lora_rank else "started_from": start,
              "args": vars(args)}
    export = LoRAExport(lora_file(args.out_dir, args.lora_name, args.preset), model, record,
                        SAVE_DTYPES[args.save_dtype]) if args.lora_rank else \
        WeightsExport(os.path.join(args.out_dir, name), model, components, record, SAVE_DTYPES[args.save_dtype],
                      args.export_pipeline, args.export_single_file)
    pool = position.dataset if isinstance(position.dataset, PairPool) else None  # builtin pairs: refilled each round
    spec = RunSpec("dpo", {"kind": "dpo_lora" if args.lora_rank else "dpo", "start": start}, vars(args),
                   args.resume_kinds, resolved)
    checkpointer = Checkpointer(checkpoint_stem(args.save_dir, name), info, spec, position, {
        "model": LoRAWeights(model) if args.lora_rank else model, "optimizer": NamedOptimizerState(
            model, learner.optimizer), "ema": ema, "pairs": pool, "metrics": metrics})
    sampler = Sampler(args.resolution, **sampling, prediction=prediction, autocast=learner.recipe.autocast)
    previews = Previews(model, ema, components, sampler, args.seed, info, os.path.join(args.out_dir, "samples", name))
    lora = (args.lora_rank, resolve_targets(args.lora_targets)) if args.lora_rank else None
    throughput, line = Throughput.of_model(model, components, learner.recipe.routing, lora, info.device,
                                           learner.recipe.autocast)
    metrics.log(line)
    return Outputs(metrics, previews, checkpointer, export, throughput)


def accumulate(args, inputs, learner):
    """The step's micro-batches of pairs (pair_inputs each): the DPO loss of each, backpropagated scaled so that
    the gradients accumulate to their mean (DDP all-reduces them in the last one's backward) -> the sum of each
    logged value (DPO_VALUES, in that order), on the device."""
    totals = 0.0
    for micro, batch in enumerate(inputs):
        sync_gradients(learner.train_model, micro == args.accumulation_steps - 1)
        losses = dpo_loss_of(learner.train_model, learner.reference, batch, learner.recipe)
        (sum(losses.values()) / args.accumulation_steps).backward()  # the reward terms are detached
        # on the device: read at the log step, after the all-reduce
        totals = totals + torch.stack([losses[name].detach().double() for name in DPO_VALUES])
    return totals


def train(args, info, position, data, learner, out, rounds):
    """The loop, from `position` (resumed, or at the start) to the end of the schedule or a stop signal; with
    --pairs builtin, a new round of pairs every --pair_refresh steps (`rounds`: its images drawn, scored on the
    host). Between two log steps (--log_interval) nothing else is read to the host: a GPU runs ahead; with
    --cuda_graph 1 each shape's step is captured at its third and replayed after."""
    log, ema = out.metrics.log, learner.ema
    params = [p for p in learner.model.parameters() if p.requires_grad]
    pool = data.dataset if isinstance(data.dataset, PairPool) else None  # builtin pairs: refilled each round
    trained = LoRAWeights(learner.model) if args.lora_rank else learner.model  # what is exported
    stopping, guard, rows = False, NonFiniteSteps(args.save_dir), StepRows()
    graphs = learner.graphs.prepare([learner.optimizer])  # after the resume: its rate in a tensor a graph reads
    with StopSignal() as stop:  # SIGTERM or Ctrl-C: saved at the next log step's end, and the loop ends
        while not (position.finished or stopping):
            started, batches = time.perf_counter(), position.next_step()  # step + 1: this rank's micro-batches
            drawn, round_ = {}, (position.step - 1) // args.pair_refresh
            if pool is not None and pool.round != round_:  # builtin pairs: a new round every --pair_refresh steps
                drawn = refresh_pool(pool, round_, learner.model, learner.components, info, rounds, log)
            lr = set_lr(learner.optimizer, lr_at(position.progress, position.plan_steps, args.learning_rate,
                                                 args.warmup_steps, args.min_lr_ratio))
            inputs, flops = step_pairs(batches, learner, position.generator, out.throughput)
            if not graphs.captured(inputs):  # eager; or, at a shape's third step with --cuda_graph 1, captured
                with graphs.recording(inputs) as recorded:
                    totals = accumulate(args, recorded, learner)  # the loss and backward of each micro-batch
                    # the losses over micro-batches and processes (one all-reduce), the gradients' norm (then
                    # clipped), and whether either is not finite: all on the device, where the update and the EMA
                    # are skipped if so
                    means = mean_over_processes(totals / args.accumulation_steps, info)
                    grad_norm = whole(torch.nn.utils.clip_grad_norm_(params, args.grad_clip))
                    skipped = not_finite(means[0], grad_norm)  # (the DPO loss, DPO_VALUES' first)
                    learner.optimizer.found_inf = skipped  # AdamW (fused, or model/flat_adamw's): no update where 1
                    learner.optimizer.step()
                    learner.optimizer.zero_grad(set_to_none=True)
                    graphs.outputs(means, grad_norm, skipped)
            means, grad_norm, skipped = graphs.run(inputs)  # a captured step replayed on these inputs
            losses = dict(zip(DPO_VALUES, means.unbind()))
            if ema is not None:
                ema.update(position.step, skipped)
            position.end_step()
            rows.add(position, {"lr": lr, "grad_norm": grad_norm, **losses, **drawn, "val_loss": None},
                     [(losses["dpo"], grad_norm)], flops, started, position.step_ids() if args.log_sample_ids else None)

            saving = position.due(args.save_interval)
            validating = data.validation and position.due(args.val_interval)
            if saving or validating or position.step % args.log_interval == 0 or stop.received and info.world_size == 1:
                # a log step, where the host reads; processes agree to stop here (one alone stops at once)
                stopping = any_process(stop.received is not None, info)
                # every step's values since the last log step read at once, the validation loss on the last if
                # due; each step's row, or the warning of one skipped as not finite (many in a row: the end)
                write_steps(rows, guard, out, data.validation if validating else None, position.global_batch)
            if saving or stopping:
                # the resume checkpoint, then what other tools read (the EMA, else the policy); older ones deleted
                save_step(out, ema or trained, position, info, stopping)
            if position.due(args.sample_interval) and not stopping:
                sample_grid(out, position.step, data.prompts)
    return finish_run(out, learner.components, info, stopping, stop.received)


if __name__ == "__main__":
    run_main(main)
