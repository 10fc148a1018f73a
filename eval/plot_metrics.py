"""Draw a run's curves from its metrics file: the loss (raw and smoothed) with the validation loss, the learning
rate, the gradient norm, images/s, and any other number a stage logs (distillation's and DPO's losses), one
panel each. Several runs draw on the same panels, to compare them.

    python eval/plot_metrics.py pretrain_tiny                       # out/pretrain_tiny_metrics.jsonl
    python eval/plot_metrics.py lora_demo_tiny lora_mine_tiny --out compare.png
    python eval/plot_metrics.py path/to/run_metrics.jsonl

Training draws the same chart at each save, beside the sample grids: out/samples/<run>_metrics.png.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.errors import UserError, run_main  # noqa: E402
from model.file_io import atomic_path  # noqa: E402
from model.weights import DEFAULT_OUT_DIR  # noqa: E402

NOT_PLOTTED = ("step", "epoch", "samples_seen", "sample_ids")
TIMING = ("images_per_s", "tflop_s", "mfu")  # the columns a step's time sets: they differ between equal runs
FIRST = ("loss", "lr", "grad_norm", "images_per_s")  # the panels' order; other numbers follow, sorted
UNSMOOTHED = ("lr",)  # a schedule: already smooth (the validation loss is drawn as dots on the loss panel)
TITLES = {"loss": "loss (smoothed; validation: dots)", "lr": "learning rate", "grad_norm": "gradient norm",
          "images_per_s": "images / s"}


def read_metrics(path):
    """The rows of a metrics file (one JSON object a line); a last line cut short by a kill is passed over."""
    if not os.path.isfile(path):
        raise UserError(f"no metrics file at {path}: pass a run name in --out_dir (e.g. pretrain_tiny) or the path "
                        "of a <run>_metrics.jsonl")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return [row for row in rows if isinstance(row, dict) and "step" in row]


def series(rows):
    """{name: ([steps], [values])} of every finite number the rows log."""
    found = {}
    for row in rows:
        for name, value in row.items():
            if name in NOT_PLOTTED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                steps, values = found.setdefault(name, ([], []))
                steps.append(row["step"])
                values.append(value)
    return found


def smoothed(values):
    """An exponential moving average over about a twentieth of the points, bias-corrected at the start."""
    decay = 1 - 1 / max(1.0, len(values) / 20)
    out, average, weight = [], 0.0, 0.0
    for value in values:
        average, weight = decay * average + (1 - decay) * value, decay * weight + (1 - decay)
        out.append(average / weight if weight else value)
    return out


def panels_of(runs):
    """The panels to draw, in order: the loss (which also holds the validation loss), then the rest."""
    names = {name for curves in runs.values() for name in curves if name != "val_loss"}
    if any("val_loss" in curves for curves in runs.values()):
        names.add("loss")
    return [n for n in FIRST if n in names] + sorted(names - set(FIRST))


def plot_runs(paths, out, title=None, labels=None):
    """Draw the runs of the metrics files `paths` into the PNG `out` (written atomically) -> out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = labels or [os.path.basename(p).removesuffix("_metrics.jsonl") for p in paths]
    runs = {label: series(read_metrics(path)) for label, path in zip(labels, paths)}
    panels = panels_of(runs)
    if not panels:
        raise UserError(f"nothing to plot yet in {', '.join(paths)}: no step has been logged")
    rows = math.ceil(len(panels) / 2)
    # fixed margins, in inches: matplotlib's constrained layout would double the time of a drawing (0.5 -> 1 s)
    height = 3.4 * rows
    figure = Figure(figsize=(12, height), dpi=100)
    figure.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / height, top=1 - 0.75 / height, wspace=0.18,
                           hspace=0.9 / 3.4 * 2)
    FigureCanvasAgg(figure)
    for k, name in enumerate(panels):
        axes = figure.add_subplot(rows, 2, k + 1)
        for n, (label, curves) in enumerate(runs.items()):
            color = f"C{n}"
            if name in curves:
                steps, values = curves[name]
                if name in UNSMOOTHED:
                    axes.plot(steps, values, color=color, label=label)
                else:
                    axes.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                    axes.plot(steps, smoothed(values), color=color, label=label)
            if name == "loss" and "val_loss" in curves:
                axes.plot(*curves["val_loss"], "o--", color=color, markersize=4, label=f"{label} validation")
        axes.set_title(TITLES.get(name, name))
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        values = [v for c in runs.values() for v in c.get(name, ([], []))[1]]
        if name in ("loss", "grad_norm") and values and 0 < min(values) and 20 * min(values) < max(values):  # decades
            axes.set_yscale("log")
        if len(runs) > 1 or (name == "loss" and any("val_loss" in c for c in runs.values())):
            axes.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    with atomic_path(out) as tmp:
        figure.savefig(tmp, format="png")
    return out


def metrics_path(run, out_dir):
    """A run name in `out_dir` (pretrain_tiny -> out_dir/pretrain_tiny_metrics.jsonl) or a path."""
    return run if run.endswith(".jsonl") else os.path.join(out_dir, f"{run}_metrics.jsonl")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run names in --out_dir (e.g. pretrain_tiny) or metrics .jsonl paths")
    parser.add_argument("--out", default=None, help="the PNG to write; default out/samples/<run>_metrics.png, or "
                        "<run>_vs_<run>.png for several")
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    paths = [metrics_path(run, args.out_dir) for run in args.runs]
    names = [os.path.basename(p).removesuffix("_metrics.jsonl") for p in paths]
    out = args.out or os.path.join(args.out_dir, "samples", ("_vs_".join(names) if len(names) > 1 else
                                                             f"{names[0]}_metrics") + ".png")
    print(plot_runs(paths, out, labels=names))


if __name__ == "__main__":
    run_main(main)
