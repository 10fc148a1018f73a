"""Pretrain SD3-Light from scratch with rectified flow.

    python trainer/train_pretrain.py                                   # tiny model, built-in shapes, on a CPU
    torchrun --nproc_per_node 2 trainer/train_pretrain.py              # the same on 2 processes (DDP)
    python trainer/train_pretrain.py --data my_images/ --resolution 64 --preset small
    python trainer/train_pretrain.py --base /models/sd3-medium --preset base --data my_images/ --resolution 256

It trains the flow-matching loss (model/rectified_flow.py) with AdamW, a warmup and a cosine decay, and keeps an
EMA of the weights; the recipe's values are parse_args' set_defaults. Writes out/pretrain_<preset>.json and the
files it names (weights for sampling and fine-tuning; a v-prediction model also as a diffusers transformer in
out/pretrain_<preset>/transformer/), sample grids in out/samples/, metrics in out/pretrain_<preset>_metrics.jsonl,
and the resume checkpoint checkpoints/pretrain_<preset>_resume.json (+ its file). Stop with SIGTERM or Ctrl-C;
continue with --from_resume 1 (a larger --max_steps or --epochs trains on).

Read top to bottom: parse_args is the recipe, main the set-up, outputs what the run writes, accumulate the
loss and backward of a step's micro-batches, train the loop.
The two files it names: model/rectified_flow.py (the loss: flow_matching_loss, and the sigmas, noise and velocity
target it uses) and trainer/trainer_utils.py (everything around the loop: start_run, lr_at the learning rate, save_step
what a save writes and deletes).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.shapes import GRAMMAR_WORDS  # noqa: E402
from dataset.training_data import stage_data  # noqa: E402
from model.components import new_components, transformer_widths  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.memory import MemoryPlan, fit_memory  # noqa: E402
from model.model_sd3light import PRESETS, SD3Light, meta_model, preset_config  # noqa: E402
from model.precision import StagePrecision, torch_dtype  # noqa: E402
from model.rectified_flow import PREDICTIONS, FlowRecipe, Sampler, flow_matching_loss  # noqa: E402
from model.token_routing import TokenRouting  # noqa: E402
from model.weights import WeightsExport, check_export, run_name  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_export_args, add_flow_args, add_optimizer_args, add_plumbing_args,
    add_routing_args, add_sampling_args, add_schedule_args, add_validation_args, positive_int,
)
from trainer.mechanics.checkpointer import Checkpointer, RunSpec, checkpoint_stem  # noqa: E402
from trainer.mechanics.distributed import (  # noqa: E402
    NamedOptimizerState, any_process, data_parallel, mean_over_processes, sync_gradients, whole,
)
from trainer.mechanics.ema import EMA  # noqa: E402
from trainer.mechanics.metrics import StepRows, Throughput  # noqa: E402
from trainer.mechanics.optimizers import SkippingMuon, adamw  # noqa: E402
from trainer.mechanics.position import Position  # noqa: E402
from trainer.mechanics.previews import Previews  # noqa: E402
from trainer.mechanics.run_lock import hold_run_folders  # noqa: E402
from trainer.mechanics.signals import StopSignal  # noqa: E402
from trainer.trainer_utils import (  # noqa: E402
    FlowLearner, NonFiniteSteps, Outputs, finish_run, log_peak, lr_at, not_finite, resume_run, sample_grid, save_step,
    set_lr, start_run, write_steps,
)


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
    add_routing_args(parser)  # token routing (off)
    add_sampling_args(parser)
    add_export_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    # The recipe: a few epochs of the built-in samples, AdamW with a warmup and a cosine decay, an EMA, logit-normal
    # sigmas, caption dropout (for classifier-free guidance)
    parser.set_defaults(num_samples=20000, batch_size=16, accumulation_steps=1, learning_rate=1e-3, weight_decay=0.0,
                        grad_clip=1.0, ema_decay=0.995, seed=0, warmup_steps=100, min_lr_ratio=0.1, epochs=4,
                        max_steps=0, sigma_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, train_shift=1.0,
                        loss="mse", weighting="none", caption_dropout=0.1, save_interval=200, sample_interval=400,
                        save_dtype="bf16")
    return parser.parse_args(argv)


def make_optimizers(model, args):
    """[Muon for the blocks' matrices (orthogonalised), AdamW for embeddings, norms and biases]; or [AdamW] (fused)
    or [8-bit AdamW] (2 bytes of state a parameter instead of 8)."""
    params = list(model.parameters())
    if args.optimizer == "muon":
        hidden, rest = model.block_matrices_and_rest()
        return [SkippingMuon(hidden, lr=args.learning_rate, weight_decay=args.weight_decay,
                             adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)]
    return [adamw(params, args.learning_rate, args.weight_decay, eight_bit=args.optimizer == "adamw8bit")]


def main(argv=None):
    """The set-up as plain calls, one large thing in memory at a time; the run resumed, or started; then the loop
    (train)."""
    args = parse_args(argv)
    # The processes, the log, the resume checkpoint asked for (read and verified; None: a fresh run), the precision
    # and the seed (the same initial weights on every rank)
    name = run_name("pretrain", args.preset)
    run = start_run(StagePrecision("pretrain"), name, args.run_settings)
    info, metrics, saved, precision = run.info, run.metrics, run.saved, run.precision

    # The frozen components; the data and its cache (the text encoders then freed); the estimate; a fresh
    # transformer of the preset's size on the components' widths
    components = new_components(args.base, args.t5_max_length, GRAMMAR_WORDS, info.device,
                                torch_dtype(precision.frozen)).to(info.device)
    config = preset_config(args.preset, **transformer_widths(components))
    # the token routing, checked now: a bad value is one line before any work
    routing = TokenRouting.for_model(config, args.route_ratio, args.route_first, args.route_last)
    prediction = args.prediction or ("v" if args.base else "x")
    check_export(components, prediction, args.export_pipeline, args.export_single_file)
    data = stage_data(args.data_settings, components, config, info, args.batch_size, metrics.log)
    if data.dataset is None:  # --cache_only: the cache is built
        return 0
    plan = MemoryPlan(("trained",), args.optimizer, args.ema_decay > 0, args.ema_device, args.batch_size,
                      args.resolution, args.gradient_checkpointing)
    plan = fit_memory(config, plan, components, precision, info, metrics.log)
    # rank 0 draws the weights (on the CPU in a sharded run, whose other ranks hold none: rank 0's fill the shards)
    model = meta_model(config) if info.sharded and not info.is_main else SD3Light(config).to(info.load_device)
    model.gradient_checkpointing = plan.checkpointing
    log_peak(info, "the weights loaded", metrics.log)

    # DDP, or FSDP shards (--fsdp 1) before the optimizer; every weight trains; an EMA follows them
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    optimizers = make_optimizers(model, args)
    ema = EMA(model, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    recipe = FlowRecipe(prediction=prediction, sigma_scheme=args.sigma_scheme, logit_mean=args.logit_mean,
                        logit_std=args.logit_std, train_shift=args.train_shift, loss=args.loss,
                        weighting=args.weighting, caption_dropout=args.caption_dropout, autocast=precision.autocast,
                        routing=routing)
    learner = FlowLearner(model, train_model, optimizers, ema, components, recipe)
    # where the run is in its data, and the schedule: --max_steps, or --epochs (the loop's lr_at reads it)
    position = Position(data.dataset, args.resolution, args.batch_size, args.accumulation_steps, args.seed, info,
                        args.num_workers)
    position.plan(args.max_steps, args.epochs)
    folders = hold_run_folders((args.out_dir, args.save_dir), name, info)  # before the first write: one run of it
    out = outputs(args, info, position, learner, metrics, precision)
    resume_run(saved, out, "pretrain", model.parameters(), info)  # a resume that does not fit the run: one line
    del saved  # its memory-mapped tensors are the run's own now: the file is not held for the rest of the run
    return train(args, info, position, data, learner, out)


def outputs(args, info, position, learner, metrics, precision):
    """What the run writes: the metrics; the resume checkpoint (the position, the model, its optimizers, the EMA,
    the metrics' wandb id); the EMA weights (else the raw ones) in --save_dtype, and for v-prediction a diffusers
    folder; sample grids and the validation loss of those weights."""
    name, model, ema, components, prediction = metrics.name, learner.model, learner.ema, learner.components, \
        learner.recipe.prediction
    sampling = {"steps": args.sample_steps, "cfg": args.sample_cfg, "shift": args.sample_shift}
    export = WeightsExport(os.path.join(args.out_dir, name), model, components, {
        "stage": "pretrain", "preset": args.preset, "resolution": args.resolution, "prediction": prediction,
        "ema": ema is not None, "save_dtype": args.save_dtype, "transformer": model.config.to_dict(),
        "components": components.spec, "sampling": sampling, "args": vars(args)},
        SAVE_DTYPES[args.save_dtype], args.export_pipeline, args.export_single_file)
    spec = RunSpec("pretrain", {"kind": "full"}, vars(args), args.resume_kinds,
                   {"prediction": prediction, **precision.as_args()})
    checkpointer = Checkpointer(checkpoint_stem(args.save_dir, name), info, spec, position, {
        "model": model, "optimizer": NamedOptimizerState(model, learner.optimizers), "ema": ema, "metrics": metrics})
    sampler = Sampler(args.resolution, **sampling, prediction=prediction, autocast=precision.autocast)
    previews = Previews(model, ema, components, sampler, args.seed, info, os.path.join(args.out_dir, "samples", name))
    throughput, line = Throughput.of_model(model, components, learner.recipe.routing, None, info.device,
                                           precision.autocast)
    metrics.log(line)
    return Outputs(metrics, previews, checkpointer, export, throughput)


def accumulate(args, batches, learner, generator, throughput):
    """The step's micro-batches: the flow loss of each, backpropagated scaled so that the gradients accumulate to
    their mean (DDP all-reduces them in the last one's backward) -> the sum of their losses, and their FLOPs."""
    total, flops = 0.0, 0.0
    for micro, batch in enumerate(batches):
        sync_gradients(learner.train_model, micro == args.accumulation_steps - 1)
        loss = flow_matching_loss(learner.train_model, learner.components, batch, generator, learner.recipe)
        (loss / args.accumulation_steps).backward()
        total = total + loss.detach().double()  # on the device: read at the log step, after the all-reduce
        flops += throughput.flops(batch).model
    return total, flops


def train(args, info, position, data, learner, out):
    """The loop, from `position` (resumed, or at the start) to the end of the schedule or a stop signal. Between two
    log steps (--log_interval) nothing is read to the host: a GPU runs ahead (but for Muon's skip flag, a read a
    step)."""
    ema, params = learner.ema, list(learner.model.parameters())
    stopping, guard, rows = False, NonFiniteSteps(args.save_dir), StepRows()
    with StopSignal() as stop:  # SIGTERM or Ctrl-C: saved at the next log step's end, and the loop ends
        while not (position.finished or stopping):
            started, batches = time.perf_counter(), position.next_step()  # step + 1: this rank's micro-batches
            lr = set_lr(learner.optimizers, lr_at(position.progress, position.plan_steps, args.learning_rate,
                                                  args.warmup_steps, args.min_lr_ratio))
            total, flops = accumulate(args, batches, learner, position.generator, out.throughput)  # loss, backward
            # the loss over micro-batches and processes, the gradients' norm (then clipped), and whether either is
            # not finite: all on the device, where the update and the EMA are skipped if so
            loss = mean_over_processes(total / args.accumulation_steps, info)
            grad_norm = whole(torch.nn.utils.clip_grad_norm_(params, args.grad_clip))
            skipped = not_finite(loss, grad_norm)
            for optimizer in learner.optimizers:
                optimizer.found_inf = skipped  # AdamW (fused, or model/flat_adamw's), Muon: no update where 1
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(position.step, skipped)
            position.end_step()
            rows.add(position, {"loss": loss, "lr": lr, "grad_norm": grad_norm, "val_loss": None}, [(loss, grad_norm)],
                     flops, started, position.step_ids() if args.log_sample_ids else None)

            saving = position.due(args.save_interval)
            validating = data.validation and position.due(args.val_interval)
            if saving or validating or position.step % args.log_interval == 0 or stop.received and info.world_size == 1:
                # a log step, where the host reads; processes agree to stop here (one alone stops at once)
                stopping = any_process(stop.received is not None, info)
                # every step's values since the last log step read at once, the validation loss on the last if
                # due; each step's row, or the warning of one skipped as not finite (many in a row: the end)
                write_steps(rows, guard, out, data.validation if validating else None, position.global_batch)
            if saving or stopping:
                # the resume checkpoint, then what other tools read (the EMA, else the weights); older ones deleted
                save_step(out, ema or learner.model, position, info, stopping)
            if position.due(args.sample_interval) and not stopping:
                sample_grid(out, position.step, data.prompts)
    return finish_run(out, learner.components, info, stopping, stop.received)


if __name__ == "__main__":
    run_main(main)
