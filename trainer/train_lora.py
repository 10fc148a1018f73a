"""LoRA: train small low-rank adapters on a frozen model, e.g. to teach it one subject, style or word.

    python trainer/train_lora.py                      # the demo: teach out/pretrain_tiny the word "white"
    python trainer/train_lora.py --data my_images/ --lora_name mystyle --lora_rank 16
    python trainer/train_lora.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/
    torchrun --nproc_per_node 2 trainer/train_lora.py --data my_images/ --lora_targets attention,ff

It trains the pretraining loss (trainer/flow_matching.py) through adapters (--lora_rank, --lora_targets) on the
frozen `--from_weight`, with AdamW on the adapters only; the numbers are the recipe at the end of parse_args. The
demo's data (`--data builtin:white`) is built-in images whose objects are all white, a colour (and a word) the
pretrained model never saw, trained alongside ordinary ones (`--prior_data`) so that what the model drew before
changes less. The adapters
go to out/lora/lora_<name>_<preset>.safetensors in diffusers' LoRA format (rank, alpha and targets in its
metadata, plus which base weights they were trained on), sample grids to out/samples/ (step 0 shows the base
model), the resume checkpoint (only the adapters, their optimizer and EMA) to
checkpoints/lora_<name>_<preset>_resume.json. Sample with the adapter:

    python eval/eval_sample.py --lora demo --prompt "a large white star in the center"
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.training_data import training_dataset  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.model_lora import TARGET_GROUPS, LoRAExport, LoRAWeights, apply_lora, lora_layers  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.weights import lora_file, lora_run_name, weights_identity  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_flow_args, add_optimizer_args, add_plumbing_args, add_sampling_args,
    add_schedule_args, add_validation_args, positive_float, positive_int, probability,
)
from trainer.checkpointer import export_record  # noqa: E402
from trainer.ema import EMA  # noqa: E402
from trainer.flow_matching import FlowRecipe, flow_matching_loss  # noqa: E402
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.previews import Previews, grid_sampling  # noqa: E402
from trainer.startup import default_data, open_run, start_up  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    run, recipe = parser.identity, parser.recipe
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
    add_optimizer_args(parser)  # batch, learning rate, weight decay, clipping, EMA, seed
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_flow_args(parser)  # sigmas, loss, weighting, caption dropout
    add_sampling_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser, data="builtin:white")
    # The recipe: 30 epochs of the demo's 40 + 120 prior samples in steps of 16 (300 steps), AdamW at 2e-3 (adapters
    # take a high rate) with 10 warmup steps and a cosine decay to a tenth, no EMA (over so few steps) and no caption
    # dropout; fp32 files (adapters are small, and diffusers applies them exactly), saved every 100 steps, a grid at
    # the end only
    parser.set_defaults(num_samples=40, batch_size=16, learning_rate=2e-3, warmup_steps=10, min_lr_ratio=0.1,
                        epochs=30, max_steps=0, weight_decay=0.0, grad_clip=1.0, ema_decay=0.0,
                        sigma_scheme="logit_normal", train_shift=1.0, loss="mse", weighting="none",
                        caption_dropout=0.0, save_dtype="fp32", sample_interval=0, save_interval=100)
    return parser.parse_args(argv)


def lora_data(args):
    """start_up's data: --data with --prior_data alongside (auto: the built-in shapes for built-in --data, none
    for yours)."""
    prior = args.prior_data
    if prior == "auto":
        prior = "builtin" if args.data.startswith("builtin") else "none"

    def prior_data(settings, components, config, log):
        if prior == "none":
            return []
        prior_dataset = training_dataset(settings, components, config.patch_size, log, data=prior,
                                         num_samples=args.prior_samples)
        log(f"prior preservation: the {len(prior_dataset)} samples of {prior} train alongside {args.data}")
        return [prior_dataset]

    return lambda settings, components, config, log: default_data(settings, components, config, log, prior_data)


def lora_adapters(args):
    """What start_up puts on the frozen base: adapters on the targeted layers (a bad target is one line)."""
    def adapt(model):
        try:
            apply_lora(model, args.lora_targets, args.lora_rank, args.lora_alpha, args.lora_dropout)
        except ValueError as e:
            raise UserError(f"--lora_targets {args.lora_targets}: {e}") from None
    return adapt


def main(argv=None):
    args = parse_args(argv)
    name = lora_run_name(args.lora_name, args.preset)  # a name that cannot name a file is a one-line error
    info, metrics, checkpointer, precision = open_run(args, "lora", name, frozen_transformer=True)
    torch.manual_seed(args.seed)  # the same adapter initialisation on every rank

    # The components, the data with the prior data alongside (and its cache), then the frozen base weights (in
    # --frozen_dtype) with adapters on the targeted layers
    start = start_up(args, info, precision, metrics.log, {"model": "adapted"}, data=lora_data(args),
                     adapt=lora_adapters(args))
    if start.dataset is None:  # --cache_only: the cache is built
        return
    model, components, base = start.nets["model"], start.components, start.record
    metrics.log(f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha or args.lora_rank:g} on "
                f"{len(lora_layers(model))} layers of {base['manifest']} (step {base['step']}, frozen in "
                f"{precision.frozen})")
    recipe = FlowRecipe.of(args, start.prediction, precision.autocast)

    # DDP, or FSDP shards (--fsdp 1: the frozen base sharded too); then only the adapters train, with AdamW; the
    # resume checkpoint and the EMA hold them alone
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    adapters, params = LoRAWeights(model), [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    ema = EMA(adapters, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None

    # A save: the resume checkpoint, then the adapters (their EMA if on) in diffusers' LoRA format, naming the base
    base_identity, sampling = weights_identity(base, args.out_dir), grid_sampling(args)
    record = export_record(args, "lora", start.prediction, sampling, model.config, components, base=base_identity)
    export = LoRAExport(lora_file(args.out_dir, args.lora_name, args.preset), model, record,
                        SAVE_DTYPES[args.save_dtype])
    run = TrainingRun(args, info, start.dataset, metrics)
    checkpointer.start(run, export, exported=ema or adapters, identity={"kind": "lora", "base": base_identity},
                       resolved={"prediction": start.prediction, **precision.as_args()}, model=adapters,
                       optimizer=NamedOptimizerState(model, optimizer), ema=ema)
    previews = Previews(args, info, name, model, ema, components, start.prompts, sampling, start.prediction,
                        precision, start.validation, metrics.log)
    previews.first(run, metrics)  # step 0: the base model

    for batches in run.steps(train_model):
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        for batch in batches:  # the flow loss of each micro-batch, through the adapters; the gradients accumulate
            run.backward(flow_matching_loss(train_model, components, batch, run.generator, recipe))
        loss = run.mean_losses()["loss"]
        grad_norm = run.optimizer_step(optimizer, params, loss, args.grad_clip, ema)  # clipped; skipped if not finite
        run.end_step()
        metrics.write(run, loss=loss, lr=lr, grad_norm=grad_norm, val_loss=previews.validate(run))
        checkpointer.save(run)  # every --save_interval steps, at the end, and on a stop signal
        previews.grid(run)  # at the end (and every --sample_interval steps if set)
    checkpointer.finish(run, components)
    if run.finished:
        metrics.log(f"sample with the adapter: python eval/eval_sample.py --lora {args.lora_name} --prompt \"...\"")


if __name__ == "__main__":
    run_main(main)
