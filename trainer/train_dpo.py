"""Preference tuning (Flow-DPO): teach a trained model to prefer, of two images of a prompt, the one a verifier or a
person chose, so that it draws what the sentence says and not only its words.

    python trainer/train_dpo.py                                    # the demo: tune out/pretrain_tiny on its own pairs
    python trainer/train_dpo.py --lora_rank 16                     # adapters instead of all weights
    python trainer/train_dpo.py --pairs my_pairs.jsonl --from_weight sft
    python trainer/train_dpo.py --base /models/sd3-medium --from_weight base --preset sd3-medium --pairs pairs.jsonl
    torchrun --nproc_per_node 2 trainer/train_dpo.py

The recipe (trainer/preference.py): the Flow-DPO loss with beta 1000 on pairs whose chosen and rejected images
share the noise and the sigma, against a frozen reference (the starting weights; with --lora_rank, the same model
with its adapters off), at sigmas shifted by 3 as the sampler's. With --pairs builtin (the default) the run draws
its own pairs: every 25 steps, 128 fresh prompts of the training grammar (never a held-out pair, never a prompt
the GenEval-style eval scores), each sampled 8 times by the current model (4 Euler steps with its grids'
guidance), each image scored by the shape scorer (the fraction of its prompt's clauses that hold), and of each
prompt every two images whose scores differ made a pair, the higher scored chosen (online DPO). Or --pairs a
.jsonl with one line {"prompt", "chosen", "rejected"} (image paths) per pair. AdamW at 3e-5 on all weights, 10
warmup steps, constant after; batches of 16 pairs; 200 steps, saved every 100 and at the end. Writes
out/dpo_<preset>.json (with --lora_rank: out/lora/lora_<lora_name>_<preset>.safetensors), the metrics (the DPO
loss, the implicit reward accuracy and margin, and each round's pair scores) in out/dpo_<preset>_metrics.jsonl,
sample grids in out/samples/ (step 0: the starting weights) and the resume checkpoint (the policy, its optimizer,
the current pairs) in checkpoints/.
Score it with `python eval/eval_geneval.py --weights dpo_tiny`.
"""
import contextlib
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.preference_pairs import PairPool, PreferencePairs  # noqa: E402
from dataset.training_data import validation_data  # noqa: E402
from eval.eval_geneval import PROMPTS_PER_TASK, all_prompts  # noqa: E402
from model.checkpoint import manifest_path  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.model_lora import TARGET_GROUPS, LoRAWeights, apply_lora, save_lora  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.weights import (  # noqa: E402
    export_weights, lora_file, lora_run_name, run_name, start_weights_source, weights_identity,
)
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_plumbing_args, add_validation_args, autocast_dtype, decay, finite_float,
    non_negative_float, non_negative_int, positive_float, positive_int, probability,
)
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.startup import start_up  # noqa: E402
from trainer.preference import (  # noqa: E402
    adapters_off_reference, flow_dpo_loss, frozen_copy_reference, pairs_per_prompt, refresh_pool,
)
from trainer.trainer_utils import EMA, init_distributed  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    run, recipe, length, free = parser.identity, parser.recipe, parser.length, parser.free
    run.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the size of the starting weights")
    run.add_argument("--resolution", type=positive_int, default=32, help="image size: the side of the square")
    run.add_argument("--prediction", default=None, choices=PREDICTIONS, help="must be what the starting weights "
                     "predict (leave it unset: it is read from them)")
    run.add_argument("--pairs", default="builtin", help="'builtin' = drawn by the model and scored on the built-in "
                     "world, or a .jsonl of {\"prompt\", \"chosen\", \"rejected\"} lines (image paths)")
    run.add_argument("--lora_rank", type=non_negative_int, default=0, help="0 = tune all weights; else train "
                     "adapters of this rank (the reference: the adapters off)")
    run.add_argument("--lora_name", default="dpo", help="with --lora_rank: out/lora/lora_<name>_<preset>.safetensors")
    recipe.add_argument("--from_weight", default="pretrain", help="starting weights (the policy and the reference): "
                        "a stage name in --out_dir ('pretrain' = pretrain_<preset>, 'sft' = sft_<preset>), the path "
                        "of a weights manifest or of a diffusers folder, or 'base' = --base's transformer")
    recipe.add_argument("--dpo_beta", type=positive_float, default=1000.0, help="how far the policy may move from "
                        "the reference for a preference: higher = stays nearer")
    recipe.add_argument("--lora_alpha", type=positive_float, default=None, help="default: rank (scale 1)")
    recipe.add_argument("--lora_targets", default="attention", help=f"comma-separated groups "
                        f"({', '.join(TARGET_GROUPS)}) or module name suffixes")
    recipe.add_argument("--pair_prompts", type=positive_int, default=128, help="builtin pairs: prompts drawn a round "
                        "(the pool holds as many pairs as their images can make)")
    recipe.add_argument("--pair_images", type=positive_int, default=8, help="builtin pairs: images a prompt")
    recipe.add_argument("--pair_choice", default="all", choices=["best_worst", "all"], help="builtin pairs: "
                        "of a prompt's images, the best and the worst, or every two whose scores differ")
    recipe.add_argument("--pair_refresh", type=positive_int, default=25, help="builtin pairs: steps between rounds")
    recipe.add_argument("--pair_sample_steps", type=positive_int, default=4, help="builtin pairs: Euler steps (a "
                        "fifth of the grids', scoring alike: drawing pairs is most of the run's time)")
    recipe.add_argument("--pair_sample_cfg", type=non_negative_float, default=None, help="default: the starting "
                        "weights' sampling")
    recipe.add_argument("--pair_sample_shift", type=positive_float, default=None)
    recipe.add_argument("--batch_size", type=positive_int, default=16, help="pairs per process")
    recipe.add_argument("--accumulation_steps", type=positive_int, default=1)
    recipe.add_argument("--learning_rate", type=positive_float, default=3e-5)
    recipe.add_argument("--warmup_steps", type=non_negative_int, default=10)
    recipe.add_argument("--min_lr_ratio", type=probability, default=1.0, help="after warmup the rate decays along a "
                        "cosine to this fraction of it (1 = constant)")
    recipe.add_argument("--weight_decay", type=non_negative_float, default=0.0)
    recipe.add_argument("--grad_clip", type=positive_float, default=1.0, help="max gradient norm")
    recipe.add_argument("--ema_decay", type=decay, default=0.0, help="EMA of the policy, exported; 0 = none")
    recipe.add_argument("--sigma_scheme", default="logit_normal", choices=["logit_normal", "uniform", "mode"])
    recipe.add_argument("--logit_mean", type=finite_float, default=0.0)
    recipe.add_argument("--logit_std", type=positive_float, default=1.0)
    recipe.add_argument("--train_shift", type=positive_float, default=3.0, help="shift applied to training sigmas "
                        "(3, as the sampler's: the noisy end, where a layout is decided)")
    recipe.add_argument("--seed", type=non_negative_int, default=0)
    length.add_argument("--epochs", type=positive_int, default=1)
    length.add_argument("--max_steps", type=non_negative_int, default=200, help="optimizer steps; 0 = run --epochs")
    free.add_argument("--sample_steps", type=positive_int, default=20, help="Euler steps of the sample grids")
    free.add_argument("--sample_cfg", type=non_negative_float, default=2.0, help="classifier-free guidance scale")
    free.add_argument("--sample_shift", type=positive_float, default=3.0)
    free.add_argument("--export_pipeline", action="store_true", help="also write out/<run>/ as a full diffusers "
                      "pipeline folder (all weights tuned; needs --base and v-prediction)")
    free.add_argument("--export_single_file", action="store_true", help="also write out/<run>_single_file"
                      ".safetensors: the original SD3 layout in bf16, for ComfyUI's Load Diffusion Model, Forge and "
                      "diffusers' from_single_file (needs v-prediction)")
    add_validation_args(parser)  # --val_data: images, scored by the policy's flow loss
    add_plumbing_args(parser, data=None)
    parser.set_defaults(save_interval=100, sample_interval=0)
    return parser.parse_args(argv)


def preference_data(args, components, sampling, log):
    """The pairs: a pool the run fills from its own samples (--pairs builtin; `sampling`: the starting weights'
    sampler), or a manifest's (cached when the cache is on)."""
    if args.pairs != "builtin":
        return PreferencePairs(args.pairs, args.resolution, log=log)
    if components.spec["kind"] != "builtin":
        raise UserError("--pairs builtin draws and scores images of the built-in world, which needs the built-in "
                        "components: with --base, pass a .jsonl of pairs")
    args.pair_sample_cfg = sampling["cfg"] if args.pair_sample_cfg is None else args.pair_sample_cfg
    args.pair_sample_shift = args.pair_sample_shift or sampling["shift"]
    args.num_workers = 0  # the pool changes in place each round: no worker may keep a stale copy
    return PairPool(args.pair_prompts * pairs_per_prompt(args.pair_images, args.pair_choice), args.resolution)


def main(argv=None):
    args = parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.lora_name):
        raise UserError(f"--lora_name {args.lora_name!r}: use letters, digits, '-' and '_' only (it names a file)")
    info = init_distributed(args.fsdp, args.fsdp_shard_size)
    name = lora_run_name(args.lora_name, args.preset) if args.lora_rank else run_name("dpo", args.preset)
    # The loss is beta times a difference of error differences, as small as bf16's rounding of the prediction: on a
    # CPU, --dtype fast keeps fp32 (measured: bf16 tuned to 0.240 held-out, fp32 to 0.272, for 6% less time)
    run = TrainingRun(args, info, "dpo", name, cpu_bf16=False, frozen_transformer=True)
    torch.manual_seed(args.seed)

    # The components, the pairs (and their cache), then the policy and the frozen reference (in --frozen_dtype): a
    # copy of the starting weights, or with adapters, the same model with them off
    def adapt(model):
        try:
            apply_lora(model, args.lora_targets, args.lora_rank, args.lora_alpha)
        except ValueError as e:
            raise UserError(f"--lora_targets {args.lora_targets}: {e}") from None

    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)

    def data(args, components, config, log):
        pairs = preference_data(args, components, source["sampling"], log)
        return pairs, pairs.sample_prompts(), validation_data(args, None, log)

    roles = {"model": "adapted"} if args.lora_rank else {"model": "trained", "reference": "frozen"}
    start = start_up(args, info, run, roles, data=data, adapt=adapt, record=source)
    if start.dataset is None:  # --cache_only: the cache is built
        return
    model, reference_model = start.nets["model"], start.nets.get("reference")
    components, dataset, prompts = start.components, start.dataset, start.prompts
    run.log(f"policy {'LoRA rank %d on ' % args.lora_rank if args.lora_rank else ''}{start.record['manifest']} (step "
            f"{start.record['step']}), Flow-DPO with beta {args.dpo_beta:g} against "
            f"{'its adapters off' if args.lora_rank else 'a frozen copy'}; pairs: {args.pairs}")

    # DDP or FSDP (the reference sharded, not wrapped); AdamW on what trains: all weights, or the adapters
    precision = autocast_dtype(args.dtype, info.device)
    train_model = data_parallel(model, info, args.compile, precision)
    reference = adapters_off_reference(model) if args.lora_rank else \
        frozen_copy_reference(data_parallel(reference_model, info, args.compile, precision))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    trained = LoRAWeights(model) if args.lora_rank else model
    ema = EMA(trained, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    start_identity = weights_identity(start.record, args.out_dir)
    output = lora_file(args.out_dir, args.lora_name, args.preset) if args.lora_rank else \
        manifest_path(os.path.join(args.out_dir, run.name))

    def export(step, weights):  # the policy (its EMA if on): whole weights, or the adapters naming their base
        if args.lora_rank:
            record = run.weights_record(model.config, components, step=step, base=start_identity)
            return save_lora(model, output, record, state=weights, dtype=SAVE_DTYPES[args.save_dtype],
                             fold_alpha=True)["bytes"]
        record = run.weights_record(model.config, components, started_from=start_identity)
        return export_weights(os.path.join(args.out_dir, run.name), step, model, weights, components, record,
                              SAVE_DTYPES[args.save_dtype], args.export_pipeline, args.export_single_file)

    def sample_model():
        return ema.swapped_in(model) if ema else contextlib.nullcontext(model)

    pool = dataset if isinstance(dataset, PairPool) else None
    run.start(dataset, components, prompts, output, exported=ema or trained, first_grid=sample_model,
              identity={"kind": "dpo_lora" if args.lora_rank else "dpo", "start": start_identity}, model=trained,
              optimizer=NamedOptimizerState(model, optimizer), ema=ema, pairs=pool,
              validation=start.validation)
    avoid = [spec["caption"] for spec in all_prompts(PROMPTS_PER_TASK)]  # the scored prompts never become pairs
    # Each step: (builtin pairs: a new round of pairs every --pair_refresh steps) -> this rank's micro-batches of
    # pairs -> the DPO loss -> backward, accumulated -> NaN guard, clipping, AdamW step, EMA -> metrics; saves
    # and grids on their cadence
    for batches in run.steps(train_model):
        drawn, round_ = {}, (run.step - 1) // args.pair_refresh
        if pool is not None and pool.round != round_:
            drawn = refresh_pool(pool, round_, model, components, info, args, run.log, avoid)
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        losses = run.backward(batches, lambda b: flow_dpo_loss(train_model, reference, components, b, run.generator,
                                                               args))
        grad_norm = run.optimizer_step(optimizer, params, losses["dpo"], args.grad_clip, ema)
        run.end_step(export, sample_model, lr=lr, grad_norm=grad_norm, **losses, **drawn)


if __name__ == "__main__":
    run_main(main)
