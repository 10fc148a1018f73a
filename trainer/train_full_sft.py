"""Full fine-tune (SFT): continue training every weight of a trained model on your data.

    python trainer/train_full_sft.py                                   # from out/pretrain_tiny, built-in data
    torchrun --nproc_per_node 2 trainer/train_full_sft.py --data my_images/ --resolution 64
    python trainer/train_full_sft.py --from_weight path/to/weights.json --preset small
    python trainer/train_full_sft.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/

It trains the pretraining loss (model/rectified_flow.py) from `--from_weight` (a stage name in --out_dir, or a
weights path; its preset must be --preset, and its prediction and components are kept) with AdamW and an EMA of the
weights; the recipe's values are parse_args' set_defaults. Writes out/sft_<preset>.json and the files it names,
sample grids in out/samples/ (step 0 shows the starting weights), metrics in out/sft_<preset>_metrics.jsonl and the
resume checkpoint checkpoints/sft_<preset>_resume.json. Stop with SIGTERM or Ctrl-C; continue with --from_resume 1.

Read top to bottom: parse_args is the recipe, main the set-up, outputs what the run writes, accumulate the
loss and backward of a step's micro-batches, train the loop.
The two files it names: model/rectified_flow.py (the loss: flow_inputs and flow_loss_of, and the sigmas, noise and
velocity target it uses) and trainer/trainer_utils.py (everything around the loop: start_run, lr_at the learning
rate, save_step what a save writes and deletes).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.training_data import stage_data  # noqa: E402
from model.block_swap import BlockSwap, swap_request  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.memory import MemoryPlan, fit_memory  # noqa: E402
from model.model_sd3light import PRESETS, SD3LightConfig  # noqa: E402
from model.precision import StagePrecision, torch_dtype  # noqa: E402
from model.rectified_flow import PREDICTIONS, FlowRecipe, Sampler, flow_loss_of  # noqa: E402
from model.token_routing import TokenRouting  # noqa: E402
from model.weights import WeightsExport, check_export, load_components, run_name  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_block_swap_args, add_data_args, add_export_args, add_flow_args, add_graph_args,
    add_optimizer_args, add_plumbing_args, add_routing_args, add_sampling_args, add_schedule_args,
    add_validation_args, add_weights_memory_args, positive_int,
)
from trainer.mechanics.checkpointer import Checkpointer, RunSpec, checkpoint_stem  # noqa: E402
from trainer.mechanics.distributed import (  # noqa: E402
    NamedOptimizerState, any_process, data_parallel, launched_world_size, mean_over_processes, sync_gradients,
    whole,
)
from trainer.mechanics.ema import EMA  # noqa: E402
from trainer.mechanics.metrics import StepRows, Throughput  # noqa: E402
from trainer.mechanics.optimizers import StepInBackward, adamw, check_step_in_backward  # noqa: E402
from trainer.mechanics.position import Position  # noqa: E402
from trainer.mechanics.previews import Previews, step_zero  # noqa: E402
from trainer.mechanics.run_lock import hold_run_folders  # noqa: E402
from trainer.mechanics.signals import StopSignal  # noqa: E402
from trainer.networks import load_network, start_weights_source  # noqa: E402
from trainer.trainer_utils import (  # noqa: E402
    FlowLearner, NonFiniteSteps, Outputs, finish_run, log_peak, lr_at, not_finite, resume_run, run_graphs,
    sample_grid, save_step, set_lr, start_run, step_inputs, write_steps,
)


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
    add_weights_memory_args(parser)  # bf16 weights with stochastic rounding; the step fused into backward
    add_block_swap_args(parser)  # with the step fused into backward: the first blocks streamed from host memory
    add_graph_args(parser)  # the step as a CUDA graph (auto: off for now)
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_flow_args(parser)  # sigmas, loss, weighting, caption dropout
    add_routing_args(parser)  # token routing (off)
    add_sampling_args(parser)
    add_export_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    # The recipe: one pass over the built-in samples, AdamW at a tenth of pretraining's rate with a short warmup and
    # a cosine decay, an EMA, pretraining's loss
    parser.set_defaults(num_samples=8000, batch_size=16, accumulation_steps=1, learning_rate=1e-4, weight_decay=0.0,
                        grad_clip=1.0, ema_decay=0.995, seed=0, warmup_steps=20, min_lr_ratio=0.1, epochs=1,
                        max_steps=0, sigma_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, train_shift=1.0,
                        loss="mse", weighting="none", caption_dropout=0.1, save_interval=200, sample_interval=400,
                        save_dtype="bf16")
    # The real-model recipe, for published SD3 / SD3.5 weights (--preset sd3-medium, sd3.5-medium, sd3.5-large), in
    # place of the demo's; any flag you pass still wins. Where each value comes from:
    #   trained_dtype bf16 (stochastic rounding on), optimizer adamw8bit, no EMA: 6 bytes a parameter instead of
    #     20, what fits SD3.5-Medium on a 24 GB card (BENCHMARKS.md); SimpleTuner's SD3 quickstart trains bf16
    #     weights with stochastic rounding (optimizer adamw_bf16) and no EMA (use_ema off by default)
    #   learning_rate 1e-5: SimpleTuner's SD3 quickstart ("1e-5 works with StableAdamW but 4e-5 could explode")
    #   batch_size 1, accumulation_steps 4, constant rate without warmup, max_steps 500, resolution 1024:
    #     diffusers' examples/dreambooth/README_sd3.md full fine-tune command (train_dreambooth_sd3.py);
    #     weight_decay 1e-4: its --adam_weight_decay
    #   gradient_checkpointing auto: as many blocks recomputed as 1024 px needs on the card (without any the estimate
    #     is 21 GiB; on 24 GB some, on 16 GB all)
    #   logit-normal sigmas (0, 1) shifted by 3: as the LoRA stage (diffusers draws timesteps from the model's
    #     scheduler, shift 3.0)
    #   export_single_file: the result in ComfyUI's Load Diffusion Model and Forge, beside the diffusers folder
    #   blocks_to_swap auto: with --step_in_backward 1, the fewest blocks streamed from host memory for the card
    #     (none where it holds the run); without it, none (a block's update must run while it is on the GPU)
    parser.set_real_model_defaults(trained_dtype="bf16", optimizer="adamw8bit", ema_decay=0.0, learning_rate=1e-5,
                                   batch_size=1, accumulation_steps=4, warmup_steps=0, min_lr_ratio=1.0,
                                   max_steps=500, weight_decay=1e-4, resolution=1024, gradient_checkpointing="auto",
                                   train_shift=3.0, export_single_file=True, blocks_to_swap="auto", log_interval=10)
    return parser.parse_args(argv)


def memory_plan(args, config):
    """What the memory estimate weighs (model/memory.py): one trained transformer, in --trained_dtype, its
    optimizer, the EMA, one micro-batch, whether the step is fused into backward, and the blocks swapped (which
    needs the step in backward, and no --fsdp 1: one line)."""
    streamable = None if args.step_in_backward else (
        "a full fine-tune swaps blocks with the step fused into backward, so that each block is updated while it is "
        "on the GPU: add --step_in_backward 1 --accumulation_steps 1, or pass --blocks_to_swap 0")
    return MemoryPlan(("trained",), args.optimizer, args.ema_decay > 0, args.ema_device, args.batch_size,
                      args.resolution, args.gradient_checkpointing, args.trained_dtype,
                      bool(args.step_in_backward),
                      swap_request(args.blocks_to_swap, bool(args.fsdp), streamable, config.num_layers))


def main(argv=None):
    """The set-up as plain calls, one large thing in memory at a time; the run resumed or started; the loop."""
    args = parse_args(argv)
    if args.step_in_backward:  # what it does not go with: one line now
        check_step_in_backward(args.accumulation_steps, launched_world_size())
    # The processes, the log, the resume checkpoint asked for (read and verified; None: a fresh run), the precision
    # (--trained_dtype), the seed
    name = run_name("sft", args.preset)
    run = start_run(StagePrecision("sft"), name, args.run_settings)
    info, metrics, saved, precision = run.info, run.metrics, run.saved, run.precision

    # The starting weights' record and components; the data and its cache (text encoders then freed); the weights
    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    prediction, config = source["prediction"], SD3LightConfig.from_dict(source["transformer"])
    # the token routing and the memory plan, checked now: a bad value is one line before any work
    routing = TokenRouting.for_model(config, args.route_ratio, args.route_first, args.route_last)
    plan = memory_plan(args, config)
    components = load_components(source, info.device, torch_dtype(precision.frozen))
    check_export(components, prediction, args.export_pipeline, args.export_single_file)
    data = stage_data(args.data_settings, components, config, info, args.batch_size, metrics.log)
    if data.dataset is None:  # --cache_only: the cache is built
        return None
    plan = fit_memory(config, plan, components, precision, info, metrics.log)
    model = load_network(source, "trained", precision.frozen, info, precision.trained, plan.blocks_to_swap)
    model.gradient_checkpointing = plan.checkpointing
    log_peak(info, "the weights loaded", metrics.log)
    metrics.log(f"starting from {source['manifest']} (step {source['step']}, predicts {prediction})")

    # DDP, or FSDP shards (--fsdp 1) before the optimizer; every weight trains (optimizers_for); the EMA starts at
    # the weights
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    optimizers, fused = optimizers_for(args, model, plan.blocks_to_swap, info, metrics.log)
    ema = EMA(model, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    recipe = FlowRecipe(prediction=prediction, sigma_scheme=args.sigma_scheme, logit_mean=args.logit_mean,
                        logit_std=args.logit_std, train_shift=args.train_shift, loss=args.loss,
                        weighting=args.weighting, caption_dropout=args.caption_dropout, autocast=precision.autocast,
                        routing=routing)
    graphs = run_graphs(args.cuda_graph, info, model, routing, fused is not None, metrics.log)  # or one line
    learner = FlowLearner(model, train_model, optimizers, ema, components, recipe, graphs)
    # where the run is in its data, and the schedule: --max_steps, or --epochs (the loop's lr_at reads it)
    position = Position(data.dataset, args.resolution, args.batch_size, args.accumulation_steps, args.seed, info,
                        args.num_workers)
    position.plan(args.max_steps, args.epochs)
    folders = hold_run_folders((args.out_dir, args.save_dir), name, info)  # before the first write: one run of it
    out = outputs(args, info, position, learner, metrics, source, precision)
    resume_run(saved, out, "sft", model.parameters(), info)  # a resume that does not fit the run: one line
    if saved is None:  # step 0: the starting weights' grid and validation loss, to compare with
        step_zero(out.previews, metrics, data)
    del saved  # its memory-mapped tensors are the run's own now: the file is not held for the rest of the run
    return train(args, info, position, data, learner, out, fused)


def optimizers_for(args, model, swapped, info, log):
    """What steps every weight -> (the optimizers, the StepInBackward that steps them in backward, or None): AdamW
    (fused, or 8-bit: 2 bytes of state a parameter instead of 8; bf16 weights: updates rounded stochastically), or
    one AdamW per parameter stepped in backward (--step_in_backward 1), the first `swapped` blocks then streamed from
    host memory, each stepped while it is on the device (model/block_swap.py)."""
    rounding = ("stochastic" if args.stochastic_rounding else "nearest") if args.trained_dtype == "bf16" else None
    eight_bit = args.optimizer == "adamw8bit"
    if not args.step_in_backward:
        return [adamw(model.parameters(), args.learning_rate, args.weight_decay, eight_bit, rounding)], None
    fused = StepInBackward(model.parameters(), args.learning_rate, args.weight_decay, eight_bit, rounding,
                           args.grad_clip)
    if swapped:
        model.block_swap = BlockSwap(model.transformer_blocks, swapped, info.device, fused.optimizer_of, log)
    return fused.optimizers, fused


def outputs(args, info, position, learner, metrics, source, precision):
    """What the run writes: the metrics; the resume checkpoint (the position, the model, its optimizer, the EMA,
    the metrics' wandb id); the EMA weights (else the raw ones), recording what they started from (`source`);
    sample grids and the validation loss of those weights."""
    name, model, ema, components, prediction = metrics.name, learner.model, learner.ema, learner.components, \
        learner.recipe.prediction
    sampling = {"steps": args.sample_steps, "cfg": args.sample_cfg, "shift": args.sample_shift}
    export = WeightsExport(os.path.join(args.out_dir, name), model, components, {
        "stage": "sft", "preset": args.preset, "resolution": args.resolution, "prediction": prediction,
        "ema": ema is not None, "save_dtype": args.save_dtype, "transformer": model.config.to_dict(),
        "components": components.spec, "sampling": sampling,
        "started_from": {"weights": source["manifest"], "step": source["step"]}, "args": vars(args)},
        SAVE_DTYPES[args.save_dtype], args.export_pipeline, args.export_single_file)
    spec = RunSpec("sft", {"kind": "full"}, vars(args), args.resume_kinds,
                   {"prediction": prediction, **precision.as_args()})
    checkpointer = Checkpointer(checkpoint_stem(args.save_dir, name), info, spec, position, {
        "model": model, "optimizer": NamedOptimizerState(model, learner.optimizers), "ema": ema, "metrics": metrics})
    sampler = Sampler(args.resolution, **sampling, prediction=prediction, autocast=precision.autocast)
    previews = Previews(model, ema, components, sampler, args.seed, info, os.path.join(args.out_dir, "samples", name))
    throughput, line = Throughput.of_model(model, components, learner.recipe.routing, None, info.device,
                                           precision.autocast)
    metrics.log(line)
    return Outputs(metrics, previews, checkpointer, export, throughput)


def accumulate(args, inputs, learner, fused):
    """The step's micro-batches (flow_inputs each): the flow loss of each, backpropagated scaled so that the
    gradients accumulate to their mean (DDP all-reduces them in the last one's backward) -> the sum of their
    losses, on the device. With `fused` (StepInBackward) the backward steps every parameter, but where the loss is
    not finite (on the device)."""
    total = 0.0
    for micro, batch in enumerate(inputs):
        sync_gradients(learner.train_model, micro == args.accumulation_steps - 1)
        loss = flow_loss_of(learner.train_model, batch, learner.recipe)
        if fused is not None:  # a step in backward cannot be taken back: none where the loss is not finite
            fused.watch(loss)
        (loss / args.accumulation_steps).backward()
        total = total + loss.detach().double()  # on the device: read at the log step, after the all-reduce
    return total


def train(args, info, position, data, learner, out, fused):
    """The loop, from `position` to the end of the schedule or a stop signal; `fused`: the StepInBackward that steps
    each parameter in backward, or None. Between log steps nothing is read to the host: a GPU runs ahead (with
    --cuda_graph 1, learner.graphs: each shape's step captured at its third step, replayed after)."""
    log, ema, params = out.metrics.log, learner.ema, list(learner.model.parameters())
    stopping, guard, rows = False, NonFiniteSteps(args.save_dir), StepRows()
    graphs = learner.graphs.prepare(learner.optimizers)  # after the resume: its rates in tensors a graph reads
    with StopSignal() as stop:  # SIGTERM or Ctrl-C: saved at the next log step's end, and the loop ends
        while not (position.finished or stopping):
            started, batches = time.perf_counter(), position.next_step()  # step + 1: this rank's micro-batches
            lr = set_lr(learner.optimizers, lr_at(position.progress, position.plan_steps, args.learning_rate,
                                                  args.warmup_steps, args.min_lr_ratio))
            inputs, flops = step_inputs(batches, learner, position.generator, out.throughput)  # the host's draws
            if not graphs.captured(inputs):  # eager; or, at a shape's third step with --cuda_graph 1, captured
                with graphs.recording(inputs) as recorded:
                    total = accumulate(args, recorded, learner, fused)  # each micro-batch's loss and backward
                    # the loss, the gradients' norm (clipped; stepped in backward: each parameter alone, the norm
                    # before), whether either is not finite: on the device, where the update and EMA skip if so
                    loss = mean_over_processes(total / args.accumulation_steps, info)
                    grad_norm = fused.grad_norm() if fused else \
                        whole(torch.nn.utils.clip_grad_norm_(params, args.grad_clip))
                    skipped = not_finite(loss, grad_norm)
                    for optimizer in learner.optimizers if not fused else ():  # fused: stepped in backward
                        optimizer.found_inf = skipped  # AdamW (fused, or model/flat_adamw's): no update where 1
                        optimizer.step()
                    for optimizer in learner.optimizers:
                        optimizer.zero_grad(set_to_none=True)
                    graphs.outputs(loss, grad_norm, skipped)
            loss, grad_norm, skipped = graphs.run(inputs)  # a captured step replayed on these inputs
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
                log_peak(info, f"step {position.step}", log)  # what a save adds to it: the line after it
                # the resume checkpoint, then what other tools read (the EMA, else the weights); older ones deleted;
                # the peak again, measured after the save
                save_step(out, ema or learner.model, position, info, stopping, peak=True)
            if position.due(args.sample_interval) and not stopping:
                sample_grid(out, position.step, data.prompts)
    return finish_run(out, learner.components, info, stopping, stop.received)


if __name__ == "__main__":
    run_main(main)
