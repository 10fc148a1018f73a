"""The small mechanics every training stage composes: stop signals, the learning-rate schedule, random states and
nested state trees. Their neighbours, each a module with one job: trainer/distributed.py (processes), ema.py,
resume.py (finding and checking a resume), training_run.py (the data position and the step's helpers),
checkpointer.py (saves and resume), metrics.py (the metrics file, progress bar, wandb), previews.py (sample grids,
validation). Nothing here computes a loss or builds an optimizer: the stage script does both.
"""
import math
import signal
import threading

import torch


# ----------------------------------------------------------------------------------------------------------------
# Stop signals


class StopSignal:
    """SIGTERM and SIGINT (what schedulers send before pre-emption, and Ctrl-C) only set `received`: the loop
    saves at the next step boundary and returns, so every rank exits 0. A second Ctrl-C stops at once."""

    def __init__(self):
        self.received, self.previous = None, {}

    def handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def ignore_sigint(worker_id):
    """Data loader workers leave Ctrl-C to the main process, which stops cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# ----------------------------------------------------------------------------------------------------------------
# Schedule, random states, state trees


def lr_at(step, total_steps, base_lr, warmup_steps, min_lr_ratio=0.1):
    """Linear warmup, then cosine decay to min_lr_ratio * base_lr. `step` counts from 0."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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
