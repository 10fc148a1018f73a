"""Pretrain SD3-Light from scratch with rectified flow.

    python trainer/train_pretrain.py                                   # tiny model, built-in shapes, on a CPU
    torchrun --nproc_per_node 2 trainer/train_pretrain.py              # the same on 2 processes (DDP)
    python trainer/train_pretrain.py --data my_images/ --resolution 64 --preset small
    python trainer/train_pretrain.py --base /models/sd3-medium --preset base --data my_images/ --resolution 256

It trains the flow-matching loss (trainer/flow_matching.py) with AdamW, a warmup and a cosine decay, and keeps an
EMA of the weights; the numbers are the recipe at the end of parse_args. Writes out/pretrain_<preset>.json
and the files it names (weights for sampling and fine-tuning; a v-prediction model also as a diffusers transformer
in out/pretrain_<preset>/transformer/), sample grids in out/samples/, metrics in
out/pretrain_<preset>_metrics.jsonl, and the resume checkpoint checkpoints/pretrain_<preset>_resume.json (+ its
file). Stop with SIGTERM or Ctrl-C; continue with --from_resume 1 (a larger --max_steps or --epochs trains on).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.errors import run_main  # noqa: E402
from model.model_sd3light import PRESETS, SD3Light  # noqa: E402
from model.precision import import_torchao  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.weights import WeightsExport, run_name  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_export_args, add_flow_args, add_optimizer_args, add_plumbing_args,
    add_sampling_args, add_schedule_args, add_validation_args, positive_int,
)
from trainer.checkpointer import export_record  # noqa: E402
from trainer.ema import EMA  # noqa: E402
from trainer.flow_matching import FlowRecipe, flow_matching_loss  # noqa: E402
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.previews import Previews, grid_sampling  # noqa: E402
from trainer.startup import open_run, start_up  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    parser.identity.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the transformer's size "
                                 "(python -m model.model_sd3light); its channels and text widths are the components'")
    parser.identity.add_argument("--resolution", type=positive_int, default=32, help="training image size: the side "
                                 "of the square, or the area of the aspect-ratio buckets")
    parser.identity.add_argument("--prediction", default=None, choices=PREDICTIONS, help="what the transformer "
                                 "outputs: x = the clean latent (cleaner images, steadier shapes in pixel space: the "
                                 "default on the built-in components), v = the velocity (SD3's own, what diffusers "
                                 "samples: the default with --base)")
    parser.recipe.add_argument("--optimizer", default="adamw", choices=["adamw", "muon", "adamw8bit"], help="muon = "
                               "Muon for the blocks' 2-D weights (its step scaled to AdamW's size, so one "
                               "--learning_rate serves both), AdamW for the rest; adamw8bit = torchao's 8-bit AdamW "
                               "(2 bytes of state a parameter instead of 8)")
    add_optimizer_args(parser)  # batch, learning rate, weight decay, clipping, EMA, seed
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_flow_args(parser)  # sigmas, loss, weighting, caption dropout
    add_sampling_args(parser)
    add_export_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    # The recipe: 4 epochs of the 20,000 built-in samples in steps of 16, AdamW at 1e-3 with 100 warmup steps and a
    # cosine decay to a tenth, an EMA of 0.995, logit-normal sigmas, 10% caption dropout
    parser.set_defaults(num_samples=20000, batch_size=16, learning_rate=1e-3, warmup_steps=100, min_lr_ratio=0.1,
                        epochs=4, max_steps=0, weight_decay=0.0, grad_clip=1.0, ema_decay=0.995,
                        sigma_scheme="logit_normal", train_shift=1.0, loss="mse", weighting="none",
                        caption_dropout=0.1, save_interval=200, sample_interval=400)
    return parser.parse_args(argv)


def make_optimizer(model, args):
    """AdamW (fused: one kernel for all parameters, on a CPU too); or Muon for the blocks' matrices (orthogonalised)
    with AdamW for embeddings, norms and biases; or 8-bit AdamW (2 bytes of state a parameter instead of 8)."""
    params = list(model.parameters())
    if args.optimizer == "muon":
        hidden, rest = model.block_matrices_and_rest()
        return [torch.optim.Muon(hidden, lr=args.learning_rate, weight_decay=args.weight_decay,
                                 adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)]
    if args.optimizer == "adamw8bit":
        return import_torchao("--optimizer adamw8bit").optim.AdamW8bit(params, lr=args.learning_rate,
                                                                       weight_decay=args.weight_decay)
    return torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)


def main(argv=None):
    args = parse_args(argv)
    name, prediction = run_name("pretrain", args.preset), args.prediction or ("v" if args.base else "x")
    info, metrics, checkpointer, precision = open_run(args, "pretrain", name)
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    # The frozen components, the data (and its cache); a fresh transformer: the preset's size on the components'
    # widths
    start = start_up(args, info, precision, metrics.log, {"model": "trained"}, fresh=SD3Light, prediction=prediction)
    if start.dataset is None:  # --cache_only: the cache is built
        return 0
    model, components = start.nets["model"], start.components
    recipe = FlowRecipe.of(args, prediction, precision.autocast)

    # DDP, or FSDP shards (--fsdp 1) before the optimizer; every weight trains; an EMA follows them
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    params, optimizer = list(model.parameters()), make_optimizer(model, args)
    ema = EMA(model, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None

    # A save: the resume checkpoint (model, optimizer, EMA, data position), then the EMA weights (else the raw ones)
    # in --save_dtype, and for v-prediction a diffusers folder
    sampling = grid_sampling(args)
    record = export_record(args, "pretrain", prediction, sampling, start.config, components)
    export = WeightsExport(os.path.join(args.out_dir, name), model, components, record, SAVE_DTYPES[args.save_dtype],
                           args.export_pipeline, args.export_single_file)
    run = TrainingRun(args, info, start.dataset, metrics)
    checkpointer.start(run, export, exported=ema or model, resolved={"prediction": prediction, **precision.as_args()},
                       model=model, optimizer=NamedOptimizerState(model, optimizer), ema=ema)
    previews = Previews(args, info, name, model, ema, components, start.prompts, sampling, prediction, precision,
                        start.validation, metrics.log)

    for batches in run.steps(train_model):
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        for batch in batches:  # the flow loss of each micro-batch; the gradients accumulate
            run.backward(flow_matching_loss(train_model, components, batch, run.generator, recipe))
        loss = run.mean_losses()["loss"]
        grad_norm = run.optimizer_step(optimizer, params, loss, args.grad_clip, ema)  # clipped; skipped if not finite
        run.end_step()
        metrics.write(run, loss=loss, lr=lr, grad_norm=grad_norm, val_loss=previews.validate(run))
        checkpointer.save(run)  # every --save_interval steps, at the end, and on a stop signal
        previews.grid(run)  # every --sample_interval steps and at the end
    checkpointer.finish(run, components)
    return run.step


if __name__ == "__main__":
    run_main(main)
