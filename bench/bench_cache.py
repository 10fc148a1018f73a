"""Cached vs uncached training steps on SD3 components: the real pretrain script, run twice with the same settings,
once encoding every batch with the frozen VAE and text encoders (--cache 0) and once reading the cache (--cache 1,
built first with --cache_only, and timed on its own).

    python bench/bench_cache.py                                  # a tiny SD3 folder built here (tests/tiny_sd3.py)
    python bench/bench_cache.py --base /models/sd3-medium --preset base --data my_images/ --resolution 512

Step time = the median over the steps after the first few of global batch / images per second, from the run's
metrics file: the data loading, the encoders (uncached) and the transformer's forward, backward and update.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.bench_model import machine_name  # noqa: E402
from tests.tiny_sd3 import build_folder  # noqa: E402


def run(argv):
    """trainer/train_pretrain.py with the arguments `argv` -> seconds."""
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "trainer/train_pretrain.py", *argv], cwd=REPO, capture_output=True,
                            text=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(argv)}\n{result.stderr[-2000:]}")
    return time.perf_counter() - t0


def step_times(metrics, batch, skip):
    with open(metrics, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [batch / row["images_per_s"] for row in rows[skip:]]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="an SD3 folder; default: a tiny one built in a temp folder")
    parser.add_argument("--preset", default="sd3-tiny")
    parser.add_argument("--data", default="builtin")
    parser.add_argument("--num_samples", type=int, default=512)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the median (warm-up)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        base = args.base or build_folder(os.path.join(tmp, "tiny-sd3"))
        common = ["--base", base, "--preset", args.preset, "--data", args.data, "--num_samples", str(args.num_samples),
                  "--resolution", str(args.resolution), "--batch_size", str(args.batch_size), "--max_steps",
                  str(args.steps), "--sample_interval", "0", "--sample_steps", "1", "--save_interval", "100000",
                  "--cache_dir", os.path.join(tmp, "cache")]
        results = {}
        for cache in ("0", "1"):
            out = os.path.join(tmp, f"out{cache}")
            if cache == "1":
                results["build"] = run([*common, "--cache_only", "--out_dir", out, "--save_dir", out])
            results[cache] = step_times(os.path.join(out, f"pretrain_{args.preset}_metrics.jsonl"), args.batch_size,
                                        args.skip) if run([*common, "--cache", cache, "--out_dir", out, "--save_dir",
                                                            out]) else None
    uncached, cached = statistics.median(results["0"]), statistics.median(results["1"])
    print(f"{datetime.date.today()}, {machine_name(device)}, torch {torch.__version__}, {device}")
    print(f"command: python bench/bench_cache.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"base {args.base or 'tiny SD3 folder (tests/tiny_sd3.py)'}, preset {args.preset}, {args.data} "
          f"({args.num_samples} samples) at {args.resolution}px, batch {args.batch_size}, median of steps "
          f"{args.skip + 1}-{args.steps}")
    print("| | step time | images/s |")
    print("|---|---|---|")
    print(f"| uncached (--cache 0) | {uncached * 1000:.0f} ms | {args.batch_size / uncached:.0f} |")
    print(f"| cached (--cache 1) | {cached * 1000:.0f} ms | {args.batch_size / cached:.0f} |")
    print(f"speed-up {uncached / cached:.2f}x; building the cache ({args.num_samples} samples, a whole run of the "
          f"script with --cache_only) took {results['build']:.1f} s")


if __name__ == "__main__":
    main()
