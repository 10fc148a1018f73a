"""What every stage does around its loop, defined here: a stage imports these from this file, and everything else
from the module that defines it (its import block is the map). The loop's own torch calls (the loss, backward,
clipping, the optimizer's step) stay in the stage.

    start a run     RunSettings (what the arguments say of it: args.run_settings), start_run -> RunStart (the
                    processes, the log, the resume checkpoint asked for, the precision, the seed)
    its memory      log_peak (each process's peak, measured)
    its loop        FlowLearner (what a flow-matching loop trains), run_graphs (its CUDA graphs), step_inputs
    resume          Outputs (what a run writes), resume_run: the run continued where its checkpoint left off
    the schedule    lr_at (warmup, then cosine decay, at the run's position) and set_lr
    a step          not_finite, NonFiniteSteps (the skip of a step that is not finite), write_steps
    save            save_step: what a save writes, and which older files it deletes; sample_grid
    the end         finish_run

Beside it: the networks a stage builds in trainer/networks.py (the starting weights, loaded as their role says,
adapters, the text encoders' LoRA). Below it: the data in dataset/training_data.py, the estimate in model/memory.py,
the mechanics in trainer/mechanics/ (processes, DDP and FSDP in distributed.py; the resume checkpoint in
checkpointer.py; the position, metrics, previews, EMA, optimizers, signals, the run lock). Nothing there imports
this module.
"""
import math
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dataset.training_data import warn_truncated
from model.errors import UserError
from model.memory import peak_rss
from model.model_lora import lora_layers, lora_parameters
from model.precision import run_precision
from model.rectified_flow import FlowRecipe, flow_inputs
from model.recompute import compiled_by_compile_block, has_dropout
from model.step_graphs import StepGraphs, graphs_choice, graphs_refusal
from trainer.mechanics.checkpointer import Checkpointer, checkpoint_stem, find_resume, resume_lines, resumed_dtype
from trainer.mechanics.distributed import gathered, init_distributed, leave_together
from trainer.mechanics.metrics import MetricsLog, Throughput
from trainer.mechanics.previews import Previews


# ----------------------------------------------------------------------------------------------------------------
# The run's start


@dataclass(frozen=True)
class RunSettings:
    """What a stage's arguments say of its run's start, each field the option of its name (the stage's parser
    fills it: args.run_settings): the processes (--fsdp...), the folders, the resume asked for, the precision asked
    for, the seed and wandb; `recipe_note`, which recipe is in force, and `arguments`, all of them (wandb's
    config)."""
    fsdp: int
    fsdp_shard_size: int
    dist_timeout: float
    out_dir: str
    save_dir: str
    from_resume: str
    cache_only: bool
    dtype: str
    frozen_dtype: str
    base: str
    seed: int
    use_wandb: bool
    wandb_project: str
    trained_dtype: str = "fp32"
    recipe_note: str = None
    arguments: dict = None


@dataclass(frozen=True)
class RunStart:
    """What start_run hands the stage: its processes (DistInfo), its log (MetricsLog: lines, the metrics file, the
    progress bar, wandb), the resume checkpoint (`saved`: read and verified; None for a fresh run) and the
    precision resolved (model/precision.Precision)."""
    info: object
    metrics: MetricsLog
    saved: dict
    precision: object


def start_run(rules, name, settings):
    """A run's start, the same in every stage: its processes (torchrun's, DDP or FSDP2's mesh), its log, the resume
    checkpoint asked for (every process reads and verifies it; none with --cache_only), the precision the stage's
    `rules` (model/precision.StagePrecision) allow, resolved against what a resumed run computed in, their lines and
    the recipe's, then the seed (the same initial weights, or adapters, on every rank). `name`: the run's (its
    files' stem); `settings`: RunSettings. -> RunStart"""
    info = init_distributed(settings.fsdp, settings.fsdp_shard_size, settings.dist_timeout)
    metrics = MetricsLog(info, rules.stage, name, settings.out_dir,
                         (settings.wandb_project, settings.arguments) if settings.use_wandb else None)
    saved = find_resume("0" if settings.cache_only else settings.from_resume,
                        checkpoint_stem(settings.save_dir, name), info)
    precision = run_precision(settings.dtype, settings.frozen_dtype, rules, info, bool(settings.base),
                              resumed_dtype(saved, info.world_size), settings.trained_dtype)
    for line in (*precision.notes, f"recipe: {settings.recipe_note}"):
        metrics.log(line)
    torch.manual_seed(settings.seed)
    return RunStart(info, metrics, saved, precision)


@dataclass(frozen=True)
class FlowLearner:
    """What a flow-matching stage's loop trains: the model, and the model as its processes train it (`train_model`:
    DDP, or the model itself on one process and under FSDP), its optimizers, its EMA (or None), what its loss
    reads (the components and the recipe), and the CUDA graphs its step may run as (StepGraphs: run_graphs; None
    in the stages that do not capture theirs), and the text encoders that train with it (`text`: {file prefix:
    encoder}, text_adapters'; their optimizer the last)."""
    model: torch.nn.Module
    train_model: torch.nn.Module
    optimizers: list
    ema: object
    components: object
    recipe: FlowRecipe
    graphs: object = None
    text: dict = None


# ----------------------------------------------------------------------------------------------------------------
# The schedule: the learning rate at a step


def lr_at(step, total_steps, base_lr, warmup_steps, min_lr_ratio):
    """Linear warmup, then cosine decay to min_lr_ratio * base_lr. `step`: the steps done, counted from 0 (the
    stages pass position.progress: the samples seen over the run's first global batch, so a resume on another
    number of processes keeps the schedule); `total_steps`: the schedule's length (position.plan_steps:
    --max_steps, or --epochs times the steps one epoch of the data makes at that global batch)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr):
    """Set the learning rate of `optimizer` (or of each of a list) -> `lr`."""
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        for group, ratio in zip(opt.param_groups, getattr(opt, "lr_ratios", [1.0] * len(opt.param_groups))):
            rate = lr * ratio  # (a text encoder's group: its own rate)
            if isinstance(group["lr"], torch.Tensor):  # torchao's 8-bit AdamW keeps it as a tensor
                group["lr"].fill_(rate)
            else:
                group["lr"] = rate
    return lr


# ----------------------------------------------------------------------------------------------------------------
# A step: the skip of one that is not finite


class NonFiniteSteps:
    """The guard against a step that is not finite: a loss or gradient norm that is NaN or infinite (the same on
    every rank: both are global) skips the update; `limit` in a row end the run, naming the folder of the last
    good save."""

    def __init__(self, save_dir, limit=10):
        self.save_dir, self.limit, self.in_a_row = save_dir, limit, 0

    def skip(self, loss, grad_norm, step):
        """-> None when the update went on (the loss and the gradient norm, numbers, both finite), else the warning
        to log."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
        if self.in_a_row >= self.limit:
            raise UserError(f"loss was not finite for {self.in_a_row} steps in a row (at step {step} the {what}; "
                            f"last good save in {self.save_dir}): lower --learning_rate or check the data")
        return f"warning: {what} at step {step}; update skipped ({self.in_a_row} in a row)"


def not_finite(loss, grad_norm):
    """1.0 (a float32 tensor on the device) where the step's loss or gradient norm is NaN or infinite, else 0.0:
    the flag fused AdamW skips its update by (`optimizer.found_inf`, as AMP's GradScaler hands it), and the EMA
    too, with nothing read to the host."""
    return (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()


def run_graphs(choice, info, model, routing, step_in_backward, log):
    """The StepGraphs (model/step_graphs.py) of a run training `model` on `info`'s processes, --cuda_graph being
    `choice`: on only where asked and the step can be captured (one line where asked and it cannot: UserError);
    `routing`: the recipe's TokenRouting; `step_in_backward`: the full fine-tune's parameters stepped in backward
    (not captured)."""
    dropout = has_dropout(model)
    recomputed = model.gradient_checkpointing not in (False, 0)
    compiled = any(compiled_by_compile_block(block) for block in model.transformer_blocks)
    refusal = graphs_refusal(info.device, info.world_size if not info.sharded else 2, model.block_swap is not None,
                             step_in_backward, routing.ratio > 0, dropout and recomputed, compiled and recomputed)
    on, line = graphs_choice(choice, refusal, info.device)
    if line is not None:
        log(line)
    for layer in lora_layers(model).values() if on else ():  # a replay repeats a cast made in its step
        layer.cast_once = False
    return StepGraphs(on, info.device, log)


def step_inputs(batches, learner, generator, throughput, training_text=True):
    """A step's micro-batches (an iterator: each fetched as it is read) on the device with their random draws, made
    on the host (rectified_flow.flow_inputs each), -> (those inputs, their FLOPs). Where text encoders train
    (learner.text; `training_text`: this step, else they encode without gradients), each micro-batch's inputs are
    made as it is read, so each encoder graph is freed by its micro-batch's backward (the draws keep their order)."""
    batches = list(batches)
    for encoder in (learner.text or {}).values():
        for p in lora_parameters(encoder):
            p.requires_grad_(training_text)
    inputs = (flow_inputs(learner.model, learner.components, batch, generator, learner.recipe) for batch in batches)
    return inputs if learner.text else list(inputs), sum(throughput.flops(batch).model for batch in batches)


def write_steps(rows, guard, out, validation, global_batch):
    """A log step's writing: the steps since the last one (`rows`: StepRows) read at once, the validation loss of
    `validation` (its batches, or None when not due) on the last of them, then each step's row in the metrics with
    its FLOP/s and images a second, or, for one whose update was skipped on the device, the guard's warning for
    each (loss, gradient norm) that was not finite (`guard`: NonFiniteSteps, which checks them in the order they
    were stepped and ends the run after many in a row)."""
    steps = rows.read()
    if validation is not None:
        steps[-1].values["val_loss"] = out.previews.validation_loss(validation)
    for step in steps:
        skipped = False
        for loss, grad_norm in step.checks:
            warning = guard.skip(loss, grad_norm, step.at.step)  # (logged at once: the next may end the run)
            if warning:
                out.metrics.log(warning)
                skipped = True
        out.metrics.write(step.at, {**step.values, **out.throughput.rates(step.flops, step.seconds)},
                          global_batch / step.seconds, skipped, step.ids)


# ----------------------------------------------------------------------------------------------------------------
# A run's lines: what trains, how it ended


def run_line(stage, parameters, position, info):
    """One line: what trains (`parameters`, each counted once), on how much data, in how many steps, on how many
    processes."""
    count = sum({id(p): p.numel() for p in parameters}.values())
    how = (f"FSDP over mesh {tuple(info.mesh.shape)}" if info.sharded else
           "DDP" if info.world_size > 1 else "one process")
    return (f"{stage}: {count / 1e6:.1f}M trainable parameters, {len(position.dataset)} samples, global batch "
            f"{position.global_batch}, {position.step + position.steps_left} steps, {info.world_size} process(es) "
            f"on {info.device.type} ({how})")


def stop_message(received, step):
    """The last line of a run a stop signal ended (`received`: this process's signal, None if another's)."""
    what = signal.Signals(received).name if received else "a stop signal on another rank"
    return f"stopped by {what} at step {step}, checkpoint saved: continue with --from_resume 1"


# ----------------------------------------------------------------------------------------------------------------
# The peak memory


def log_peak(info, what, log):
    """Each process's peak memory so far, measured, beside the estimate: on a GPU what torch allocated and what its
    allocator reserved (what the GPU lost to the run: allocated plus what it keeps cached); on a CPU resident."""
    if info.device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(info.device), torch.cuda.max_memory_reserved(info.device))
    else:
        peak = (peak_rss(),)
    peaks = [peak]
    if info.world_size > 1:
        peaks = [None] * info.world_size
        dist.all_gather_object(peaks, peak)
    shown = ", ".join(" / ".join("not measured here" if p is None else f"{p / 2 ** 30:.2f}" for p in each)
                      for each in peaks)
    how = " (allocated / reserved)" if info.device.type == "cuda" else ""
    log(f"peak memory after {what}: {shown} GiB{how} (by rank)")


# ----------------------------------------------------------------------------------------------------------------
# What a run writes; its start from a resume, and its end


@dataclass(frozen=True)
class Outputs:
    """A run's log and metrics (MetricsLog), its sample grids and validation loss (Previews), its resume checkpoint
    (Checkpointer, holding the position and the named objects) and what other tools read (`export`:
    model/weights.WeightsExport or model/model_lora.LoRAExport), and the FLOPs and peak its MFU is counted from
    (metrics.Throughput)."""
    metrics: MetricsLog
    previews: Previews
    checkpointer: Checkpointer
    export: object
    throughput: Throughput


def resume_run(saved, out, stage, parameters, info):
    """Start the run where `saved` (the resume checkpoint, or None: a fresh run) left off: checked against the run
    (check_resume in trainer/mechanics/checkpointer.py: a misfit is one line), the position and every named object
    restored; then the lines that say so and what trains (`parameters`, of `stage`), and the metrics opened from
    that step (rows past it dropped, wandb's run continued)."""
    position, checkpointer = out.checkpointer.position, out.checkpointer
    notes = resume_lines(saved, checkpointer.spec, position, checkpointer.stem)
    checkpointer.restore(saved)
    for line in notes + [run_line(stage, parameters, position, info)]:
        out.metrics.log(line)
    out.metrics.open(position.step, position.step + position.steps_left, saved is not None)


def save_step(out, weights, position, info, stopping, peak=False):
    """A save, the same in every stage (the loop decides when); every process calls it. It writes, each file
    verified as it is read back before its manifest commits it:
      1. the resume checkpoint (out.checkpointer: model/checkpoint.py's save_checkpoint): the position, every rank's
         random streams and each named object, in checkpoints/<run>_resume.step<N>.pt (and a .dcp folder of shards
         when sharded), committed by checkpoints/<run>_resume.json;
      2. what other tools read (out.export): `weights` (the EMA, else what trains) made whole on rank 0 and written
         by model/weights.py's WeightsExport (out/<run>.step<N>.safetensors committed by out/<run>.json, and the
         diffusers or single-file copies asked for) or model/model_lora.py's LoRAExport (one LoRA file, written
         to a temp file and renamed over the last);
      then a line, with `peak` the peak memory measured after it (log_peak), and the curves (at the run's last
      save, at its end or at a stop (`stopping`), else at most once a minute).
    Which older files it deletes: after each commit, the step files and temp files of that stem that its manifest
    no longer names (model/checkpoint.py's remove_leftovers): a run keeps its last resume checkpoint and its last
    export, and nothing else in its folders is touched."""
    began = time.perf_counter()
    written = out.checkpointer.save()
    whole = gathered(weights.state_dict(), info)  # one tensor at a time on the device
    if info.is_main:
        written += out.export.write(position.step, whole, position.samples_seen)
    out.metrics.log(f"saved step {position.step}: {written / 1e6:.0f} MB written and verified in "
                    f"{time.perf_counter() - began:.1f} s")
    if peak:
        log_peak(info, f"saving step {position.step}", out.metrics.log)
    out.metrics.plot(position.step, last=position.finished or stopping)


def sample_grid(out, step, prompts):
    """The grid of `prompts` drawn with the weights the run exports, at `step` (every rank of a sharded run draws
    it), and its line."""
    path, took = out.previews.grid(step, prompts)
    out.metrics.log(f"sample grid: {path} ({took})")


def finish_run(out, components, info, stopped, received):
    """The run's end: the progress bar and wandb closed, the data loader let go, every process waiting for the
    others (rank 0 may still be writing), the captions CLIP cut short counted, and the last line: where the output
    is, or, for a run a stop signal ended (`stopped`; `received`: this process's signal, None if another's), how to
    continue it. -> the step the run ended at."""
    out.metrics.close()
    out.checkpointer.position.close()
    leave_together(info)
    log_peak(info, "the run", out.metrics.log)
    warn_truncated(components, info, out.metrics.log)
    position = out.checkpointer.position
    out.metrics.log(stop_message(received, position.step) if stopped else
                    f"done: {out.export.output} (step {position.step})")
    return position.step
