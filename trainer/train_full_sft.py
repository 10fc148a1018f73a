"""Full fine-tune (SFT): continue training every weight of a trained model on your data.

    python trainer/train_full_sft.py                                   # from out/pretrain_tiny, built-in data
    torchrun --nproc_per_node 2 trainer/train_full_sft.py --data my_images/ --resolution 64
    python trainer/train_full_sft.py --from_weight path/to/weights.json --preset small
    python trainer/train_full_sft.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/

The recipe: the pretraining loss (trainer/flow_matching.py) from `--from_weight` (a stage name in --out_dir, or a
weights path; its preset must be --preset, and its prediction and components are kept), AdamW at a tenth of
pretraining's rate (1e-4) with 20 warmup steps and a cosine decay, one pass over 8,000 built-in samples in steps of
16 (500 steps), an EMA of the weights, saved every 200 steps and at the end. Writes out/sft_<preset>.json and the
files it names, sample grids in out/samples/ (step 0 shows the starting weights), metrics in
out/sft_<preset>_metrics.jsonl and the resume checkpoint checkpoints/sft_<preset>_resume.json. Stop with SIGTERM
or Ctrl-C; continue with --from_resume 1.
"""
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.checkpoint import manifest_path  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.precision import import_torchao  # noqa: E402
from model.weights import export_weights, run_name  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_plumbing_args, add_validation_args, autocast_dtype, decay,
    finite_float, non_negative_float, non_negative_int, positive_float, positive_int, probability,
)
from trainer.flow_matching import flow_matching_loss  # noqa: E402
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.startup import start_up  # noqa: E402
from trainer.trainer_utils import EMA, init_distributed  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    run, recipe, length, free = parser.identity, parser.recipe, parser.length, parser.free
    run.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the size of the weights to start from")
    run.add_argument("--resolution", type=positive_int, default=32, help="training image size: the side of the "
                     "square, or the area of the aspect-ratio buckets")
    run.add_argument("--prediction", default=None, choices=PREDICTIONS, help="must be what the weights predict "
                     "(leave it unset: it is read from them)")
    recipe.add_argument("--from_weight", default="pretrain", help="weights to start from: a stage name in --out_dir "
                        "('pretrain' = pretrain_<preset>), the path of a weights manifest or of a diffusers folder, "
                        "or 'base' = --base's transformer")
    recipe.add_argument("--num_samples", type=positive_int, default=8000, help="size of the built-in dataset")
    recipe.add_argument("--batch_size", type=positive_int, default=16, help="per process")
    recipe.add_argument("--accumulation_steps", type=positive_int, default=1)
    recipe.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit"], help="adamw8bit = torchao's "
                        "8-bit AdamW (2 bytes of state a parameter instead of 8)")
    recipe.add_argument("--learning_rate", type=positive_float, default=1e-4)
    recipe.add_argument("--warmup_steps", type=non_negative_int, default=20)
    recipe.add_argument("--min_lr_ratio", type=probability, default=0.1, help="after warmup the rate decays "
                        "along a cosine to this fraction of it (1 = constant)")
    recipe.add_argument("--weight_decay", type=non_negative_float, default=0.0)
    recipe.add_argument("--grad_clip", type=positive_float, default=1.0, help="max gradient norm")
    recipe.add_argument("--ema_decay", type=decay, default=0.995, help="EMA of the weights, exported and sampled; "
                        "0 = none")
    recipe.add_argument("--sigma_scheme", default="logit_normal", choices=["logit_normal", "uniform", "mode"])
    recipe.add_argument("--logit_mean", type=finite_float, default=0.0)
    recipe.add_argument("--logit_std", type=positive_float, default=1.0)
    recipe.add_argument("--train_shift", type=positive_float, default=1.0, help="shift applied to training sigmas")
    recipe.add_argument("--loss", default="mse", choices=["mse", "huber"])
    recipe.add_argument("--weighting", default="none", choices=["none", "sigma_sqrt", "cosmap"])
    recipe.add_argument("--caption_dropout", type=probability, default=0.1, help="probability of training a sample "
                        "unconditionally")
    recipe.add_argument("--seed", type=non_negative_int, default=0)
    length.add_argument("--epochs", type=positive_int, default=1)
    length.add_argument("--max_steps", type=non_negative_int, default=0, help="optimizer steps; 0 = run --epochs")
    free.add_argument("--sample_steps", type=positive_int, default=20, help="Euler steps of the sample grids")
    free.add_argument("--sample_cfg", type=non_negative_float, default=2.0, help="classifier-free guidance scale")
    free.add_argument("--sample_shift", type=positive_float, default=3.0)
    free.add_argument("--export_pipeline", action="store_true", help="also write out/<run>/ as a full diffusers "
                      "pipeline folder (needs --base and v-prediction); out/<run>/transformer/ is always written "
                      "for v-prediction")
    free.add_argument("--export_single_file", action="store_true", help="also write out/<run>_single_file"
                      ".safetensors: the original SD3 layout in bf16, for ComfyUI's Load Diffusion Model, Forge and "
                      "diffusers' from_single_file (needs v-prediction)")
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    info = init_distributed(args.fsdp, args.fsdp_shard_size)
    run = TrainingRun(args, info, "sft", run_name("sft", args.preset))
    torch.manual_seed(args.seed)

    # The components, the data and its cache, then the starting weights (their prediction and components are kept)
    start = start_up(args, info, run, {"model": "trained"})
    if start.dataset is None:  # --cache_only: the cache is built
        return
    model, components, dataset, prompts, origin = (start.nets["model"], start.components, start.dataset,
                                                   start.prompts, start.record)
    run.log(f"starting from {origin['manifest']} (step {origin['step']}, predicts {origin['prediction']})")

    # DDP, or FSDP shards (--fsdp 1) before the optimizer; every weight trains, with AdamW (fused: one kernel for all
    # parameters; or 8-bit AdamW, 2 bytes a parameter of state instead of 8); the EMA starts at the weights
    train_model = data_parallel(model, info, args.compile, autocast_dtype(args.dtype, info.device))
    params = list(model.parameters())
    if args.optimizer == "adamw8bit":
        optimizer = import_torchao("--optimizer adamw8bit").optim.AdamW8bit(params, lr=args.learning_rate,
                                                                            weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    ema = EMA(model, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    stem = os.path.join(args.out_dir, run.name)

    def export(step, weights):  # the EMA weights (else the raw ones), a diffusers folder for v, what they came from
        record = run.weights_record(model.config, components, started_from={"weights": origin["manifest"],
                                                                            "step": origin["step"]})
        return export_weights(stem, step, model, weights, components, record, SAVE_DTYPES[args.save_dtype],
                              args.export_pipeline, args.export_single_file)

    def sample_model():
        return ema.swapped_in(model) if ema else contextlib.nullcontext(model)

    run.start(dataset, components, prompts, manifest_path(stem), exported=ema or model, first_grid=sample_model,
              model=model, optimizer=NamedOptimizerState(model, optimizer), ema=ema,
              validation=start.validation)  # step 0: the starting weights
    # Each step: this rank's micro-batches -> the flow loss -> backward, accumulated -> NaN guard, clipping, AdamW
    # step, EMA -> metrics; every --save_interval steps a save, every --sample_interval a grid (and both at the end)
    for batches in run.steps(train_model):
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        loss = run.backward(batches, lambda b: flow_matching_loss(train_model, components, b, run.generator, args))
        grad_norm = run.optimizer_step(optimizer, params, loss, args.grad_clip, ema)
        run.end_step(export, sample_model, loss=loss, lr=lr, grad_norm=grad_norm)


if __name__ == "__main__":
    run_main(main)
