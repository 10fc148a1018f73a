"""LoRA: train small low-rank adapters on a frozen model, e.g. to teach it one subject, style or word.

    python trainer/train_lora.py                      # the demo: teach out/pretrain_tiny the word "white"
    python trainer/train_lora.py --data my_images/ --lora_name mystyle --lora_rank 16
    python trainer/train_lora.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/
    torchrun --nproc_per_node 2 trainer/train_lora.py --data my_images/ --lora_targets attention,ff

The recipe: the pretraining loss (trainer/flow_matching.py) through rank-8 adapters on every attention projection
of the frozen `--from_weight`, AdamW at 2e-3 on the adapters only, 10 warmup steps and a cosine decay, no EMA and no
caption dropout. The demo's data (`--data builtin:white`) is 40 built-in images whose objects are all white, a
colour (and a word) the pretrained model never saw, trained alongside 120 ordinary ones (`--prior_data`) so that
what the model drew before changes less: 30 epochs of 10 steps of 16 (300 steps), saved every 100. The adapters
go to out/lora/lora_<name>_<preset>.safetensors in diffusers' LoRA format (rank, alpha and targets in its
metadata, plus which base weights they were trained on), sample grids to out/samples/ (step 0 shows the base
model), the resume checkpoint (only the adapters, their optimizer and EMA) to
checkpoints/lora_<name>_<preset>_resume.json. Sample with the adapter:

    python eval/eval_sample.py --lora demo --prompt "a large white star in the center"
"""
import contextlib
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.training_data import training_dataset  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.model_lora import TARGET_GROUPS, LoRAWeights, apply_lora, lora_layers, save_lora  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.weights import lora_file, lora_run_name, weights_identity  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_plumbing_args, add_validation_args, autocast_dtype, decay,
    finite_float, non_negative_float, non_negative_int, positive_float, positive_int, probability,
)
from trainer.flow_matching import flow_matching_loss  # noqa: E402
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.startup import default_data, start_up  # noqa: E402
from trainer.trainer_utils import EMA, init_distributed  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    run, recipe, length, free = parser.identity, parser.recipe, parser.length, parser.free
    run.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the size of the base weights")
    run.add_argument("--resolution", type=positive_int, default=32, help="training image size: the side of the "
                     "square, or the area of the aspect-ratio buckets")
    run.add_argument("--prediction", default=None, choices=PREDICTIONS, help="must be what the base weights "
                     "predict (leave it unset: it is read from them)")
    run.add_argument("--lora_name", default="demo", help="names the file: out/lora/lora_<name>_<preset>.safetensors")
    recipe.add_argument("--from_weight", default="pretrain", help="base weights: a stage name in --out_dir "
                        "('pretrain' = pretrain_<preset>, 'sft' = sft_<preset>), the path of a weights manifest or "
                        "of a diffusers folder, or 'base' = --base's transformer")
    recipe.add_argument("--lora_rank", type=positive_int, default=8)
    recipe.add_argument("--lora_alpha", type=positive_float, default=None, help="the update is scaled by "
                        "alpha/rank; default: rank (scale 1)")
    recipe.add_argument("--lora_dropout", type=probability, default=0.0)
    recipe.add_argument("--lora_targets", default="attention", help=f"comma-separated groups "
                        f"({', '.join(TARGET_GROUPS)}) or module name suffixes (e.g. to_q,to_v)")
    recipe.add_argument("--prior_data", default="auto", help="images trained alongside --data so the model keeps "
                        "what it already draws (DreamBooth's prior preservation): a dataset as for --data, 'none', or "
                        "'auto' = the built-in shapes when --data is built-in (the demo), none for your own data")
    recipe.add_argument("--prior_samples", type=positive_int, default=120, help="size of a built-in prior dataset")
    recipe.add_argument("--num_samples", type=positive_int, default=40, help="size of the built-in dataset")
    recipe.add_argument("--batch_size", type=positive_int, default=16, help="per process")
    recipe.add_argument("--accumulation_steps", type=positive_int, default=1)
    recipe.add_argument("--learning_rate", type=positive_float, default=2e-3, help="adapters take a high rate")
    recipe.add_argument("--warmup_steps", type=non_negative_int, default=10)
    recipe.add_argument("--min_lr_ratio", type=probability, default=0.1, help="after warmup the rate decays "
                        "along a cosine to this fraction of it (1 = constant)")
    recipe.add_argument("--weight_decay", type=non_negative_float, default=0.0)
    recipe.add_argument("--grad_clip", type=positive_float, default=1.0, help="max gradient norm")
    recipe.add_argument("--ema_decay", type=decay, default=0.0, help="EMA of the adapters, exported and sampled; "
                        "0 = none (over so few steps)")
    recipe.add_argument("--sigma_scheme", default="logit_normal", choices=["logit_normal", "uniform", "mode"])
    recipe.add_argument("--logit_mean", type=finite_float, default=0.0)
    recipe.add_argument("--logit_std", type=positive_float, default=1.0)
    recipe.add_argument("--train_shift", type=positive_float, default=1.0, help="shift applied to training sigmas")
    recipe.add_argument("--loss", default="mse", choices=["mse", "huber"])
    recipe.add_argument("--weighting", default="none", choices=["none", "sigma_sqrt", "cosmap"])
    recipe.add_argument("--caption_dropout", type=probability, default=0.0, help="probability of training a sample "
                        "unconditionally")
    recipe.add_argument("--seed", type=non_negative_int, default=0)
    length.add_argument("--epochs", type=positive_int, default=30)
    length.add_argument("--max_steps", type=non_negative_int, default=0, help="optimizer steps; 0 = run --epochs")
    free.add_argument("--sample_steps", type=positive_int, default=20, help="Euler steps of the sample grids")
    free.add_argument("--sample_cfg", type=non_negative_float, default=2.0, help="classifier-free guidance scale")
    free.add_argument("--sample_shift", type=positive_float, default=3.0)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser, data="builtin:white")
    # fp32 files: adapters are small, and diffusers applies them exactly; a grid at the end only; saves every 100
    parser.set_defaults(save_dtype="fp32", sample_interval=0, save_interval=100)
    return parser.parse_args(argv)


def prior_data(args, components, config, log):
    """--prior_data as parts trained alongside --data (auto: the built-in shapes for built-in --data, none for
    yours)."""
    prior = args.prior_data
    if prior == "auto":
        prior = "builtin" if args.data.startswith("builtin") else "none"
    if prior == "none":
        return []
    prior_dataset = training_dataset(args, components, config.patch_size, log, data=prior,
                                     num_samples=args.prior_samples)
    log(f"prior preservation: the {len(prior_dataset)} samples of {prior} train alongside {args.data}")
    return [prior_dataset]


def main(argv=None):
    args = parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.lora_name):
        raise UserError(f"--lora_name {args.lora_name!r}: use letters, digits, '-' and '_' only (it names a file)")
    info = init_distributed(args.fsdp, args.fsdp_shard_size)
    run = TrainingRun(args, info, "lora", lora_run_name(args.lora_name, args.preset), frozen_transformer=True)
    torch.manual_seed(args.seed)  # the same adapter initialisation on every rank

    # The components, the data with the prior data alongside (and its cache), then the frozen base weights (in
    # --frozen_dtype) with adapters on the targeted layers
    def adapt(model):
        try:
            apply_lora(model, args.lora_targets, args.lora_rank, args.lora_alpha, args.lora_dropout)
        except ValueError as e:
            raise UserError(f"--lora_targets {args.lora_targets}: {e}") from None

    def data(args, components, config, log):
        return default_data(args, components, config, log, extra=prior_data)

    start = start_up(args, info, run, {"model": "adapted"}, data=data, adapt=adapt)
    if start.dataset is None:  # --cache_only: the cache is built
        return
    model, components, dataset, prompts, base = (start.nets["model"], start.components, start.dataset,
                                                 start.prompts, start.record)
    run.log(f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha or args.lora_rank:g} on {len(lora_layers(model))} "
            f"layers of {base['manifest']} (step {base['step']}, frozen in {args.frozen_dtype})")

    # DDP, or FSDP shards (--fsdp 1: the frozen base sharded too); then only the adapters train, with AdamW; the
    # resume checkpoint and the EMA hold them alone
    train_model = data_parallel(model, info, args.compile, autocast_dtype(args.dtype, info.device))
    adapters, params = LoRAWeights(model), [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    ema = EMA(adapters, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    path, base_identity = lora_file(args.out_dir, args.lora_name, args.preset), weights_identity(base, args.out_dir)

    def export(step, weights):  # the adapters (their EMA if on) in diffusers' LoRA format, naming the base weights
        record = run.weights_record(model.config, components, step=step, base=base_identity)
        return save_lora(model, path, record, state=weights, dtype=SAVE_DTYPES[args.save_dtype],
                         fold_alpha=True)["bytes"]

    def sample_model():  # the grids show what is exported: the adapters' EMA swapped in while they are drawn
        return ema.swapped_in(model) if ema else contextlib.nullcontext(model)

    run.start(dataset, components, prompts, path, exported=ema or adapters, identity={"kind": "lora",
              "base": base_identity}, first_grid=sample_model, model=adapters,
              optimizer=NamedOptimizerState(model, optimizer), ema=ema,
              validation=start.validation)  # step 0: the base model
    # Each step: this rank's micro-batches -> the flow loss -> backward, accumulated -> NaN guard, clipping, AdamW
    # step, EMA -> metrics; every --save_interval steps a save, every --sample_interval a grid (and both at the end)
    for batches in run.steps(train_model):
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        loss = run.backward(batches, lambda b: flow_matching_loss(train_model, components, b, run.generator, args))
        grad_norm = run.optimizer_step(optimizer, params, loss, args.grad_clip, ema)
        run.end_step(export, sample_model, loss=loss, lr=lr, grad_norm=grad_norm)
    if run.finished:
        run.log(f"sample with the adapter: python eval/eval_sample.py --lora {args.lora_name} --prompt \"...\"")


if __name__ == "__main__":
    run_main(main)
