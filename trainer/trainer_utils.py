"""The small mechanics every training stage's loop calls, each doing one thing: stop signals, the learning rate at a
step, the skip of a step that is not finite, random states and nested state trees. Their neighbours, each a
module with one job: trainer/distributed.py (processes), position.py (where a run is in its data), ema.py,
checkpointer.py (saves and resume), resume.py (whether a checkpoint fits the run), metrics.py (the metrics file,
progress bar, wandb), previews.py (sample grids, validation). Nothing here computes a loss or steps an optimizer:
the stage script does, and it says which optimizer it builds (adamw gives AdamW, fused, or torchao's 8-bit one).
"""
import contextlib
import math
import multiprocessing
import os
import signal
import threading
import time

import torch

from model.errors import UserError
from model.precision import import_torchao


# ----------------------------------------------------------------------------------------------------------------
# Stop signals


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# torchrun's agent passes the signal it got on to each rank: where every process of a job was signalled (Slurm
# signals a job's processes, `kill` may be given every group), a rank gets the stop twice, so under torchrun a
# second SIGINT this soon after the first is that copy
FORWARDED_SECONDS = 2.0


class StopSignal:
    """SIGTERM and SIGINT (what schedulers send before pre-emption, and Ctrl-C) only set `received`: the loop
    saves at the next step boundary and returns, so every rank exits 0. A second Ctrl-C stops at once (under
    torchrun, one FORWARDED_SECONDS or more after the first)."""

    def __init__(self):
        self.received, self.previous, self.at = None, {}, 0.0
        self.forwarded = FORWARDED_SECONDS if "TORCHELASTIC_RUN_ID" in os.environ else 0.0

    def handle(self, signum, frame):
        if self.received is None:
            self.received, self.at = signum, time.monotonic()
        elif signum == signal.SIGINT == self.received and time.monotonic() - self.at >= self.forwarded:
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stop_signals_held():
    """Hold SIGTERM and SIGINT while data loader workers start: they begin with both blocked (a signal to the whole
    process group would otherwise find a worker before its worker_init_fn has run), and this process gets them, as
    a StopSignal, once the workers have started."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks (and no fork)
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def leave_stopping_to_the_main_process(worker_id):
    """A data loader worker's start: a stop signalled to the whole process group (Ctrl-C, `timeout`,
    `kill -- -PGID`, a scheduler) reaches the workers too, and a worker that died of it made the main process fail
    wherever it was, in the middle of a save too. A worker ignores SIGINT, and SIGTERM but the trainer's (the
    loader ending a worker that did not stop), which it answers as torch's own handler does, by leaving quietly.
    (Processes a dataset starts in a worker inherit SIGTERM blocked.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS: no sender to tell apart; torch's handler, a group's SIGTERM
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # ends the worker as before
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # blocked since the fork, kept so
    trainer = multiprocessing.parent_process()  # (under forkserver the OS parent is not the trainer)
    threading.Thread(target=exit_on_sigterm_from, args=(trainer.pid if trainer else os.getppid(),),
                     daemon=True).start()


def exit_on_sigterm_from(trainer):
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != trainer:
        pass
    os._exit(0)  # what torch's worker handler does on its parent's SIGTERM: no clean-up, no message


# ----------------------------------------------------------------------------------------------------------------
# A step: its learning rate, the guard against one that is not finite


def lr_at(step, total_steps, base_lr, warmup_steps, min_lr_ratio):
    """Linear warmup, then cosine decay to min_lr_ratio * base_lr. `step` counts from 0."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(params, lr, weight_decay, eight_bit=False, bf16_rounding=None):
    """AdamW over `params`: torch's, fused (one kernel for all parameters, on a CPU too), or with `eight_bit`
    torchao's 8-bit AdamW (2 bytes of state a parameter instead of 8). For bf16 weights (`bf16_rounding`:
    "stochastic" or "nearest"), torchao's, which computes each update in fp32 and rounds it to bf16 as asked."""
    params = list(params)
    if bf16_rounding is None and not eight_bit:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    optim = import_torchao("--optimizer adamw8bit" if eight_bit else "--trained_dtype bf16").optim
    kind = optim.AdamW8bit if eight_bit else optim._AdamW  # _AdamW: torchao's AdamW for low-precision weights
    return kind(params, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=bf16_rounding == "stochastic")


def set_lr(optimizer, lr):
    """Set the learning rate of `optimizer` (or of each of a list) -> `lr`."""
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's 8-bit AdamW keeps it as a tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
    return lr


class NonFiniteSteps:
    """The guard against a step that is not finite: a loss or gradient norm that is NaN or infinite (the same on
    every rank: both are global) skips the update; `limit` in a row end the run, naming the folder of the last
    good save."""

    def __init__(self, save_dir, limit=10):
        self.save_dir, self.limit, self.in_a_row = save_dir, limit, 0

    def skip(self, loss, grad_norm, step):
        """-> None when the update may go on (`grad_norm` None: not computed, the loss was not finite), else the
        warning to log."""
        if grad_norm is not None and math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        what = f"{'loss' if grad_norm is None else 'gradient norm'} is {loss if grad_norm is None else grad_norm}"
        if self.in_a_row >= self.limit:
            raise UserError(f"loss was not finite for {self.in_a_row} steps in a row (at step {step} the {what}; "
                            f"last good save in {self.save_dir}): lower --learning_rate or check the data")
        return f"warning: {what} at step {step}; update skipped ({self.in_a_row} in a row)"


# ----------------------------------------------------------------------------------------------------------------
# A run's lines: what trains, how it ended


def run_line(stage, parameters, position, info):
    """One line: what trains (`parameters`, each counted once), on how much data, in how many steps, on how many
    processes."""
    count = sum({id(p): p.numel() for p in parameters}.values())
    how = f"FSDP over mesh {tuple(info.mesh.shape)}" if info.sharded else \
        "DDP" if info.world_size > 1 else "one process"
    return (f"{stage}: {count / 1e6:.1f}M trainable parameters, {len(position.dataset)} samples, global batch "
            f"{position.global_batch}, {position.step + position.steps_left} steps, {info.world_size} process(es) "
            f"on {info.device.type} ({how})")


def stop_message(received, step):
    """The last line of a run a stop signal ended (`received`: this process's signal, None if another's)."""
    what = signal.Signals(received).name if received else "a stop signal on another rank"
    return f"stopped by {what} at step {step}, checkpoint saved: continue with --from_resume 1"


# ----------------------------------------------------------------------------------------------------------------
# Random states, state trees


def rng_state(generator, device):
    """This process's random streams: the training generator (sigmas, noise, caption dropout) and torch's own."""
    return {"train": generator.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, generator, device):
    generator.set_state(state["train"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def leaves(tree, path=()):
    """-> {path: tensor} of every tensor in a nested dict/list state (path: the keys on the way, as a tuple)."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {p: t for key, sub in items for p, t in leaves(sub, path + (key,)).items()}


def map_leaves(tree, fn, path=()):
    """The same nested state with each tensor replaced by fn(path, tensor)."""
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(v, fn, path + (i,)) for i, v in enumerate(tree))
    return tree


def to_cpu(obj):
    """A nested state with every tensor on the CPU (what a resume file holds)."""
    return map_leaves(obj, lambda path, tensor: tensor.detach().cpu())


def fresh_like(tensor):
    """A tensor to read `tensor` back into: empty, of its type and layout. torchao's 8-bit optimizer state (a
    tensor subclass of codes, scales and a code map; a DTensor's local part under FSDP) has no empty_like: it is
    rebuilt from empty codes and scales, keeping its code map, a constant a load does not write."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(tensor, DTensor):
        return DTensor.from_local(fresh_like(tensor.to_local()), tensor.device_mesh, tensor.placements,
                                  run_check=False, shape=tensor.shape, stride=tensor.stride())
    if not is_traceable_wrapper_subclass(tensor):
        return torch.empty_like(tensor)
    names, context = tensor.__tensor_flatten__()
    inner = {name: getattr(tensor, name).clone() if name == "qmap" else fresh_like(getattr(tensor, name))
             for name in names}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.shape, tensor.stride())


def chunk_of(tensor):
    """(offsets, sizes) of the part of `tensor` this process holds: a DTensor's shard, or all of it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)
