"""Time to quality of the main job: run trainer/train_pretrain.py with a recipe, note the wall clock and CPU time at
each save, then score the saved weights there: the held-out loss and the GenEval-style score (held-out and
training-grammar prompts, once per seed), so "the same score in fewer minutes" is a number.

    python bench/bench_main_job.py --label default                          # the main job as the README runs it
    python bench/bench_main_job.py --label short -- --max_steps 2500        # a recipe: pretrain's flags after --
    python bench/bench_main_job.py --table                                  # the markdown table of every run so far

Each run trains in out/bench_main_job/<label>/ (its own out/ and checkpoints/, so the README's weights are left
alone) and writes its row to out/bench_main_job/<label>.json. The clock runs while the training runs alone: the
weights of each save are copied aside as it appears (milliseconds) and scored only after the run ends. CPU time
is the training process's user + system time (all its threads), read from /proc at each save and from
getrusage at the end. --score_steps picks which saves to score (default: the last; scoring costs about 2 minutes a
seed on a 2-core CPU).
"""
import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_model import machine_name  # noqa: E402
from bench.demo_scores import measure  # noqa: E402
from dataset.image_folder import build_dataset  # noqa: E402
from eval.eval_geneval import PROMPTS_PER_TASK, all_prompts  # noqa: E402
from eval.eval_loss import quantile_losses  # noqa: E402
from eval.sampling import load_for_sampling, sampler_for  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.file_io import atomic_write_text  # noqa: E402
from model.weights import DEFAULT_OUT_DIR, REPO_ROOT  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid):
    """User + system CPU seconds of a running process, all its threads (/proc/<pid>/stat), or None once gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15 of stat)
    except (OSError, IndexError, ValueError):
        return None


def snapshot(out_dir, seen, snapshots):
    """Copy the weights of a save not seen yet (the manifest and the files it names) into snapshots/step_<N>/
    -> the step, or None when no new save is there."""
    for manifest in glob.glob(os.path.join(out_dir, "pretrain_*.json")):
        try:
            with open(manifest, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced: the next poll reads it
        step = record.get("step")
        if step is None or step in seen:
            continue
        target = os.path.join(snapshots, f"step_{step:08d}")
        os.makedirs(target, exist_ok=True)
        try:
            for name in record["files"]:
                shutil.copy2(os.path.join(out_dir, name), os.path.join(target, name))
        except OSError:
            shutil.rmtree(target)
            continue  # replaced by the next save while copying: that save is taken instead
        with open(os.path.join(target, os.path.basename(manifest)), "w", encoding="utf-8") as f:
            json.dump(record, f)
        seen.add(step)
        return step
    return None


def train(work, recipe, poll_s=0.2):
    """Run the main job with `recipe` (pretrain's flags) in `work` -> {"saves": [{"step", "wall_s", "cpu_s"}],
    "wall_s", "cpu_s", "peak_rss_gb", "log"}."""
    out_dir, snapshots = os.path.join(work, "out"), os.path.join(work, "snapshots")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(out_dir)
    command = [sys.executable, os.path.join(REPO_ROOT, "trainer", "train_pretrain.py"), "--out_dir", out_dir,
               "--save_dir", os.path.join(work, "checkpoints"), "--cache_dir", os.path.join(work, "cache"), *recipe]
    log_path = os.path.join(work, "train.log")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    saves, seen, t0 = [], set(), time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        while True:
            running = child.poll() is None
            cpu = process_cpu_seconds(child.pid) if running else None
            step = snapshot(out_dir, seen, snapshots)
            if step is not None:
                saves.append({"step": step, "wall_s": time.perf_counter() - t0, "cpu_s": cpu})
            if not running and step is None:
                break
            time.sleep(poll_s)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode != 0:
        raise UserError(f"the training run failed (exit {child.returncode}): see {log_path}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if saves and saves[-1]["cpu_s"] is None:  # the last save was seen after the process ended
        saves[-1]["cpu_s"] = cpu
    # ru_maxrss (KiB on Linux): the largest child's peak, the training process here
    return {"saves": saves, "wall_s": wall, "cpu_s": cpu, "peak_rss_gb": after.ru_maxrss / 2 ** 20, "log": log_path}


def quality(weights, seeds, device, batch_size=256):
    """A save's held-out loss (eval_loss's 512 samples, fixed noise) and GenEval-style scores per seed."""
    model, components, record, _ = load_for_sampling(weights, os.path.dirname(weights), device)
    dataset = build_dataset("builtin", record["resolution"], split="heldout", num_samples=512, seed=0,
                            log=lambda msg: None)
    losses = quantile_losses(model, components, dataset, 512, 64, device, record["prediction"])
    specs = all_prompts(PROMPTS_PER_TASK)
    scores = {}
    for seed in seeds:
        result = measure(model, components, specs, sampler_for(record), seed, batch_size)
        scores[seed] = {"heldout": result["heldout"], "train": result["train"], "tasks": result["tasks"]}
        print(f"  step {record['step']} seed {seed}: held-out {result['heldout']:.3f}, train {result['train']:.3f}",
              flush=True)
    return {"heldout_loss": sum(losses.values()) / len(losses), "scores": scores}


def mean_score(row, split):
    return sum(s[split] for s in row["scores"].values()) / len(row["scores"])


def table(rows):
    """The time-to-quality table: a line per scored save of every run."""
    lines = ["| run | recipe | step | wall clock | CPU min | held-out loss | held-out score (per seed) | mean | "
             "train score (per seed) | mean |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for save in row["saves"]:
            if "scores" not in save:
                continue
            wall = f"{int(save['wall_s'] // 60)}:{save['wall_s'] % 60:04.1f}"
            per_seed = {split: " / ".join(f"{s[split]:.3f}" for s in save["scores"].values())
                        for split in ("heldout", "train")}
            lines.append(f"| {row['label']} | `{' '.join(row['recipe']) or '(default)'}` | {save['step']} | {wall} | "
                         f"{save['cpu_s'] / 60:.1f} | {save['heldout_loss']:.4f} | {per_seed['heldout']} | "
                         f"{mean_score(save, 'heldout'):.3f} | {per_seed['train']} | {mean_score(save, 'train'):.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="*", help="train_pretrain.py's flags (after --)")
    parser.add_argument("--label", default="default", help="names the run: out/bench_main_job/<label>")
    parser.add_argument("--score_steps", type=int, nargs="*", default=None, help="saves to score (default: the "
                        "last)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="noise seeds of the GenEval scores")
    parser.add_argument("--root", default=os.path.join(DEFAULT_OUT_DIR, "bench_main_job"))
    parser.add_argument("--table", action="store_true", help="print the table of the runs in --root and exit")
    args = parser.parse_args()
    if args.table:
        paths = sorted(glob.glob(os.path.join(args.root, "*.json")))
        print(table([json.load(open(path, encoding="utf-8")) for path in paths]))
        return
    work = os.path.join(args.root, args.label)
    print(f"training {args.label}: train_pretrain.py {' '.join(args.recipe)} (log: {work}/train.log)", flush=True)
    run = train(work, args.recipe)
    if not run["saves"]:
        raise UserError(f"the run saved no weights: see {run['log']}")
    print(f"trained in {run['wall_s'] / 60:.1f} min wall, {run['cpu_s'] / 60:.1f} CPU-min, {run['peak_rss_gb']:.2f} "
          f"GB peak; {len(run['saves'])} saves", flush=True)
    steps = set(args.score_steps or [run["saves"][-1]["step"]])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for save in run["saves"]:
        if save["step"] in steps:
            folder = os.path.join(work, "snapshots", f"step_{save['step']:08d}")
            save.update(quality(glob.glob(os.path.join(folder, "*.json"))[0], args.seeds, device))
    row = {"label": args.label, "recipe": args.recipe, "machine": machine_name(device.type), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), **run}
    atomic_write_text(os.path.join(args.root, f"{args.label}.json"), json.dumps(row, indent=2) + "\n")
    print(table([row]))


if __name__ == "__main__":
    run_main(main)
