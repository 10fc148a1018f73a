"""What the cheaper full fine-tune modes cost in quality: the default SFT run (the tiny model, from the main job's
weights) with fp32 weights, with bf16 weights updated by stochastic rounding, and with plain bf16 (rounded to the
nearest); each scored like the main job (held-out loss, GenEval-style score per seed), with its wall clock.

    python bench/bench_sft_precision.py                          # trains the main job first (about 17 min)
    python bench/bench_sft_precision.py --from_weight out/pretrain_tiny.json
    python bench/bench_sft_precision.py --work /tmp/sft_precision --seeds 0 1
    python bench/bench_sft_precision.py --main_job_steps 1000    # from a shorter main job (its own schedule)

Each run writes into --work/<mode>/ (its own out/ and checkpoints/); the table is printed at the end and kept in
--work/table.md.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_main_job import quality  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
    "fp32": [],
    "bf16, stochastic rounding": ["--trained_dtype", "bf16", "--stochastic_rounding", "1"],
    "bf16, nearest": ["--trained_dtype", "bf16", "--stochastic_rounding", "0"],
}


def run(script, folder, flags):
    """One stage run in `folder` (out/, checkpoints/, its log) -> wall seconds."""
    os.makedirs(folder, exist_ok=True)
    command = [sys.executable, os.path.join(REPO_ROOT, "trainer", script), "--out_dir", os.path.join(folder, "out"),
               "--save_dir", os.path.join(folder, "checkpoints"), *flags]
    t0 = time.perf_counter()
    with open(os.path.join(folder, "train.log"), "w", encoding="utf-8") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, check=True)
    return time.perf_counter() - t0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench_sft_precision"))
    parser.add_argument("--from_weight", default=None, help="the main job's weights (default: train them here)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="noise seeds of the GenEval scores")
    parser.add_argument("--main_job_steps", type=int, default=0, help="train the main job this many steps (its "
                        "schedule shortened to them); 0 = as the README runs it")
    args = parser.parse_args(argv)
    start = args.from_weight
    if start is None:
        steps = ["--max_steps", str(args.main_job_steps)] if args.main_job_steps else []
        wall = run("train_pretrain.py", os.path.join(args.work, "main_job"), steps)
        start = os.path.join(args.work, "main_job", "out", "pretrain_tiny.json")
        print(f"main job: {wall / 60:.1f} min", flush=True)
    rows = ["| SFT weights | wall clock | held-out loss | held-out score (per seed) | mean |", "|---|---|---|---|---|"]
    for mode, flags in MODES.items():
        folder = os.path.join(args.work, mode.replace(", ", "_").replace(" ", "_"))
        wall = run("train_full_sft.py", folder, ["--from_weight", start, *flags])
        result = quality(os.path.join(folder, "out", "sft_tiny.json"), args.seeds, "cpu")
        scores = [s["heldout"] for s in result["scores"].values()]
        rows.append(f"| {mode} | {wall / 60:.1f} min | {result['heldout_loss']:.4f} | "
                    f"{' / '.join(f'{s:.3f}' for s in scores)} | {sum(scores) / len(scores):.3f} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    with open(os.path.join(args.work, "table.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
