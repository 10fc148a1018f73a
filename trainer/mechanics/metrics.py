"""What a run shows while it trains: its lines (rank 0, through the progress bar while it shows), the metrics file
out/<run>_metrics.jsonl (a row a step), the progress bar, wandb, the curves drawn from the file, and the FLOP/s
and MFU of its steps (Throughput).
"""
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch

from eval.plot_metrics import plot_runs
from model.components import text_tokens
from model.file_io import atomic_write_text
from model.flops import FlopCount, peak_flops
from model.token_routing import TokenRouting


PLOT_EVERY = 60  # seconds at least between two drawings of the curves, but for the one at the run's last save
FORMATS = {"lr": "{:.2e}", "tflop_s": "{:.3g}", "mfu": "{:.1%}"}  # how the progress bar shows a value


@dataclass(frozen=True)
class Throughput:
    """The FLOPs a run's steps compute (model/flops.FlopCount, on latents `downscale` times smaller than its images)
    and the peak FLOP/s of one device that MFU divides by."""
    count: FlopCount
    downscale: int
    peak: float

    @classmethod
    def of_model(cls, model, components, routing, lora, device, dtype):
        """The count for `model` (its config and gradient checkpointing) trained on `components`, routed as
        `routing` says, with LoRA's (rank, target suffixes) or None, computing in `dtype` (None: fp32) on `device`
        -> (Throughput, the line that says where the peak comes from)."""
        count = FlopCount(model.config, text_tokens(components), routing, lora, model.gradient_checkpointing)
        peak, source = peak_flops(device, dtype or torch.float32)
        return cls(count, components.downscale, peak), \
            f"MFU = model FLOPs a second / {peak / 1e12:.3g} TFLOP/s ({source})"

    def flops(self, batch, samples=1, grad=True, routed=None):
        """FLOPs (model/flops.Flops) of one forward of micro-batch `batch` (`samples` times its samples), with its
        backward if `grad`, routed if `routed` (default: when `grad`)."""
        n, height, width = latent_shape(batch, self.downscale)
        return self.count.forward(n * samples, height, width, grad, routed)

    def unrouted(self):
        """The same count for a network that never routes (one a stage trains beside the routed one)."""
        return replace(self, count=replace(self.count, routing=TokenRouting()))

    def rates(self, flops, seconds):
        """The metrics of a step that computed `flops` (model FLOPs, this process) in `seconds`."""
        return {"tflop_s": flops / seconds / 1e12, "mfu": flops / seconds / self.peak}


def latent_shape(batch, downscale):
    """(samples, latent height, latent width) of a micro-batch: of its cached latents, or of its images (pairs:
    of one side)."""
    for key in ("latents", "chosen_latents"):
        if key in batch:
            return len(batch[key]), batch[key].shape[-2], batch[key].shape[-1]
    images = batch["image"] if "image" in batch else batch["chosen"]
    return len(images), images.shape[-2] // downscale, images.shape[-1] // downscale


@dataclass(frozen=True)
class At:
    """What a metrics row records of where a step left the run."""
    step: int
    epoch: int
    samples_seen: int


@dataclass(frozen=True)
class StepRow:
    """A step read at a log step: where it left the run (`at`), its values as numbers, the (loss, gradient norm)
    pairs its updates were decided by (`checks`, numbers: one a network stepped), its FLOPs, the dataset indices it
    trained on (or None), and its share of the seconds the steps since the last read took."""
    at: At
    values: dict
    checks: list
    flops: float
    ids: list
    seconds: float


class StepRows:
    """The steps since the last log step: each one's values kept as they are (a loss, a gradient norm: tensors on
    the device) until the log step reads them all to the host in one copy, the only wait for the device between
    two log steps (--log_interval)."""

    def __init__(self):
        self.pending = []

    def add(self, position, values, checks, flops, started, ids=None):
        """The step that `position` has just ended, begun at `started` (time.perf_counter()), with `values` (its
        row) and `checks`: the (loss, gradient norm) of each network it stepped, in the order it stepped them."""
        at = At(position.step, position.epoch, position.samples_seen)
        self.pending.append((at, values, [tuple(pair) for pair in checks], flops, started, ids))

    def read(self):
        """-> [StepRow]: the steps since the last read, their tensors read at once; each step's seconds are the
        mean over them (a step queued on a GPU ends when the read does)."""
        tensors = [v.double() for _, values, checks, *_ in self.pending
                   for v in [*values.values(), *(v for pair in checks for v in pair)] if isinstance(v, torch.Tensor)]
        numbers = iter(torch.stack(tensors).tolist() if tensors else [])

        def number(v):  # (in the order the tensors were gathered: a step's values, then its checks)
            return next(numbers) if isinstance(v, torch.Tensor) else v

        seconds = (time.perf_counter() - self.pending[0][4]) / len(self.pending)
        rows = [StepRow(at, {k: number(v) for k, v in values.items()}, [tuple(map(number, pair)) for pair in checks],
                        flops, ids, seconds) for at, values, checks, flops, _, ids in self.pending]
        self.pending = []
        return rows


class MetricsLog:
    """The lines, metric rows, progress bar and wandb run of the run `name` of `stage`, its files in `out_dir`;
    rank 0 alone writes. `wandb`: (project, config) to log to wandb, or None. Its state (state_dict) is the wandb
    run's id, which a resume continues."""

    def __init__(self, info, stage, name, out_dir, wandb=None):
        self.info, self.stage, self.name, self.out_dir, self.wandb = info, stage, name, out_dir, wandb
        self.path = os.path.join(out_dir, f"{name}_metrics.jsonl")
        self.bar = self.bar_span = self.wandb_run = self.wandb_id = self.last_val = self.shown_warning = None
        self.plotted = time.monotonic()

    def log(self, msg):
        """Print on rank 0 only (through the progress bar while it shows, so lines do not break it)."""
        if self.info.is_main:
            if self.bar is not None:
                self.bar.write(msg)
            else:
                print(msg, flush=True)

    def state_dict(self):
        return {"wandb_id": self.wandb_id}

    def load_state_dict(self, state):
        self.wandb_id = state["wandb_id"]

    def open(self, first_step, last_step, resumed):
        """Rows past `first_step` belong to an earlier run, or to the lost tail of the resumed one: dropped (a fresh
        run keeps none). wandb continues the resumed run's."""
        self.bar_span = (first_step, last_step)  # the bar opens when the first step ends (write)
        if not self.info.is_main:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        truncate_metrics(self.path, first_step if resumed else -1)
        if self.wandb is not None:
            import wandb

            project, config = self.wandb
            self.wandb_run = wandb.init(project=project, name=self.name, id=self.wandb_id, resume="allow",
                                        config=config, dir=self.out_dir,
                                        mode="online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb_id = self.wandb_run.id

    def write(self, position, values, images_per_s, skipped=False, ids=None):
        """The step's row: the position's step and epoch, `values` (one that is None, a validation loss not
        scored this step, left out), the images a second that training alone ran at, the samples seen, and the
        dataset indices it trained on if given (`ids`); none for a step whose update was skipped. The bar moves on
        either way."""
        self._open_bar()
        values = {name: value for name, value in values.items() if value is not None}
        if self.info.is_main and not skipped:
            row = {"step": position.step, "epoch": position.epoch, **values, "images_per_s": images_per_s,
                   "samples_seen": position.samples_seen}
            self.write_row(row if ids is None else {**row, "sample_ids": ids})
            self.last_val = values.get("val_loss", self.last_val)  # the bar keeps the last validation loss in view
            shown = {name: FORMATS.get(name, "{:.4f}").format(value) for name, value in
                     {**values, "val_loss": self.last_val}.items()
                     if name != "grad_norm" and isinstance(value, float)}
            self.bar.set_postfix(shown, img_s=f"{images_per_s:.0f}")
        if self.bar is not None:
            self.bar.update(1)

    def write_row(self, row):
        """One row of the metrics file (rank 0), and to wandb."""
        if not self.info.is_main:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=row["step"])

    def _open_bar(self):
        """The progress bar, from the end of the first step on: an error in the first step (the one that meets bad
        data, memory limits, an empty pair set) then prints as one line, with no half-drawn bar around it."""
        if self.info.is_main and self.bar is None:
            from tqdm import tqdm

            first, total = self.bar_span
            self.bar = tqdm(total=total, initial=first, desc=self.stage, dynamic_ncols=True)
            # a warning (torch's, a library's) while the bar is drawn goes above it, on a line of its own
            self.shown_warning, warnings.showwarning = warnings.showwarning, self.show_warning

    def show_warning(self, message, category, filename, lineno, file=None, line=None):
        """warnings.showwarning's, while the bar is drawn: the warning written above the bar, the bar below it (once
        an error has closed the bar, as before it)."""
        if self.bar is None or self.bar.disable:
            return self.shown_warning(message, category, filename, lineno, file, line)
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        self.bar.write(text, file or sys.stderr)

    def plot(self, step, last):
        """The run's curves so far (eval/plot_metrics.py) beside its sample grids, at a save: at the run's `last`
        (finished or stopping), and at the others once PLOT_EVERY seconds have passed since the run began or last
        drew them (a drawing costs 0.5-1 s of CPU: a run that saved every few seconds spent a third of its time
        drawing). A failure is a warning, never the end of training."""
        if not self.info.is_main or not last and time.monotonic() - self.plotted < PLOT_EVERY:
            return
        self.plotted = time.monotonic()
        path = os.path.join(self.out_dir, "samples", f"{self.name}_metrics.png")
        try:
            plot_runs([self.path], path, title=f"{self.name} (step {step})")
        except Exception as e:  # a plot is a convenience: the weights are saved already
            self.log(f"warning: could not draw {path}: {' '.join(str(e).split())[:200]}")
            return
        self.log(f"curves: {path}")

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            warnings.showwarning = self.shown_warning
        if self.wandb_run is not None:
            self.wandb_run.finish()


def truncate_metrics(path, step):
    """Drop metric rows past `step` (-1 for a fresh run: all of them, its step-0 row too), and a last line cut
    short by a kill."""
    if not os.path.exists(path):
        return
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:  # a line without its newline is the half-written last row of a killed run
                if line.endswith("\n") and json.loads(line)["step"] <= step:
                    rows.append(line)
            except (ValueError, KeyError, TypeError):
                pass
    atomic_write_text(path, "".join(rows))
