"""Full fine-tune (SFT): continue training every weight of a trained model on your data.

    python trainer/train_full_sft.py                                   # from out/pretrain_tiny, built-in data
    torchrun --nproc_per_node 2 trainer/train_full_sft.py --data my_images/ --resolution 64
    python trainer/train_full_sft.py --from_weight path/to/weights.json --preset small
    python trainer/train_full_sft.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/

It trains the pretraining loss (trainer/flow_matching.py) from `--from_weight` (a stage name in --out_dir, or a
weights path; its preset must be --preset, and its prediction and components are kept) with AdamW and an EMA of the
weights; the numbers are the recipe at the end of parse_args. Writes out/sft_<preset>.json and the
files it names, sample grids in out/samples/ (step 0 shows the starting weights), metrics in
out/sft_<preset>_metrics.jsonl and the resume checkpoint checkpoints/sft_<preset>_resume.json. Stop with SIGTERM
or Ctrl-C; continue with --from_resume 1.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.errors import run_main  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
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
    parser.identity.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the size of the weights to "
                                 "start from")
    parser.identity.add_argument("--resolution", type=positive_int, default=32, help="training image size: the side "
                                 "of the square, or the area of the aspect-ratio buckets")
    parser.identity.add_argument("--prediction", default=None, choices=PREDICTIONS, help="must be what the weights "
                                 "predict (leave it unset: it is read from them)")
    parser.recipe.add_argument("--from_weight", default="pretrain", help="weights to start from: a stage name in "
                               "--out_dir ('pretrain' = pretrain_<preset>), the path of a weights manifest or of a "
                               "diffusers folder, or 'base' = --base's transformer")
    parser.recipe.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit"], help="adamw8bit = "
                               "torchao's 8-bit AdamW (2 bytes of state a parameter instead of 8)")
    add_optimizer_args(parser)  # batch, learning rate, weight decay, clipping, EMA, seed
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_flow_args(parser)  # sigmas, loss, weighting, caption dropout
    add_sampling_args(parser)
    add_export_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    # The recipe: one pass over 8,000 built-in samples in steps of 16, AdamW at a tenth of pretraining's rate with 20
    # warmup steps and a cosine decay to a tenth, an EMA of 0.995, pretraining's loss
    parser.set_defaults(num_samples=8000, batch_size=16, learning_rate=1e-4, warmup_steps=20, min_lr_ratio=0.1,
                        epochs=1, max_steps=0, weight_decay=0.0, grad_clip=1.0, ema_decay=0.995,
                        sigma_scheme="logit_normal", train_shift=1.0, loss="mse", weighting="none",
                        caption_dropout=0.1, save_interval=200, sample_interval=400)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    name = run_name("sft", args.preset)
    info, metrics, checkpointer, precision = open_run(args, "sft", name)
    torch.manual_seed(args.seed)

    # The components, the data and its cache, then the starting weights (their prediction and components are kept)
    start = start_up(args, info, precision, metrics.log, {"model": "trained"})
    if start.dataset is None:  # --cache_only: the cache is built
        return
    model, components, origin = start.nets["model"], start.components, start.record
    metrics.log(f"starting from {origin['manifest']} (step {origin['step']}, predicts {origin['prediction']})")
    recipe = FlowRecipe.of(args, start.prediction, precision.autocast)

    # DDP, or FSDP shards (--fsdp 1) before the optimizer; every weight trains, with AdamW (fused: one kernel for all
    # parameters; or 8-bit AdamW, 2 bytes a parameter of state instead of 8); the EMA starts at the weights
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    params = list(model.parameters())
    optimizer = import_torchao("--optimizer adamw8bit").optim.AdamW8bit(
        params, lr=args.learning_rate, weight_decay=args.weight_decay) if args.optimizer == "adamw8bit" else \
        torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    ema = EMA(model, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None

    # A save: the resume checkpoint, then the EMA weights (else the raw ones), recording what they started from
    sampling = grid_sampling(args)
    record = export_record(args, "sft", start.prediction, sampling, model.config, components,
                           started_from={"weights": origin["manifest"], "step": origin["step"]})
    export = WeightsExport(os.path.join(args.out_dir, name), model, components, record, SAVE_DTYPES[args.save_dtype],
                           args.export_pipeline, args.export_single_file)
    run = TrainingRun(args, info, start.dataset, metrics)
    checkpointer.start(run, export, exported=ema or model, resolved={"prediction": start.prediction,
                       **precision.as_args()}, model=model, optimizer=NamedOptimizerState(model, optimizer), ema=ema)
    previews = Previews(args, info, name, model, ema, components, start.prompts, sampling, start.prediction,
                        precision, start.validation, metrics.log)
    previews.first(run, metrics)  # step 0: the starting weights

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


if __name__ == "__main__":
    run_main(main)
