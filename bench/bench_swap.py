"""The small cards' commands on a large GPU capped to their size: each README command for an 8 GB or 12 GB card run
for --steps steps at 1024 px on a published-size stand-in (bench/stand_in.py), its process capped with
torch.cuda.set_per_process_memory_fraction to the card's size less what a CUDA context takes; then the same command
uncapped with nothing swapped and the same blocks recomputed. Prints, for each: the capped run's estimate, blocks
swapped, peak allocated / reserved, the sample grid's seconds, s/step against the uncapped run's, and whether the
losses of the two are the same (the copies and the compute race only on a GPU).

    python bench/bench_swap.py --work /tmp/swap                      # 8 GB SD3.5-Large LoRA, then 12 GB SD3.5-M SFT
    python bench/bench_swap.py --work /tmp/swap --only "Large LoRA on an 8 GB" --steps 5

The stand-ins' text encoders are one layer deep: the cache build is quick and its T5 small, so what this measures is
training and the grids. Each run has --timeout seconds.
"""
import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.bench_cards import card_commands, with_folder  # noqa: E402
from bench.bench_gpu import write_images  # noqa: E402
from bench.stand_in import write_stand_in  # noqa: E402

CONTEXT_BYTES = 0.5 * 2 ** 30  # what a CUDA context and torch's kernels take outside torch's allocator on a card
DEFAULT_ONLY = ("SD3.5-Large LoRA on an 8 GB card", "SD3.5-Medium full fine-tune on a 12 GB card")
# The process capped to a card before anything touches the GPU, then the stage script run as `python script ...`
CAPPED = """import runpy, sys, torch
card = {card_bytes}
if card and torch.cuda.is_available():  # (a CPU dry run of this script: nothing to cap)
    torch.cuda.set_per_process_memory_fraction((card - {context}) / torch.cuda.get_device_properties(0).total_memory)
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(words, card_bytes, run_dir, timeout):
    """Run the command's words (script first) capped to `card_bytes` (0: uncapped) into `run_dir` -> (exit code,
    its log, the metric rows)."""
    os.makedirs(run_dir, exist_ok=True)
    argv = [*words, "--out_dir", os.path.join(run_dir, "out"), "--save_dir", os.path.join(run_dir, "ckpt"),
            "--cache_dir", os.path.join(os.path.dirname(run_dir), "cache")]
    code = CAPPED.format(card_bytes=card_bytes, context=CONTEXT_BYTES, argv=argv)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
        returncode, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        returncode, log = "timeout", (e.stdout or b"").decode() + (e.stderr or b"").decode()
    with open(os.path.join(run_dir, "log.txt"), "w", encoding="utf-8") as f:
        f.write(log)
    rows = []
    metrics = [os.path.join(run_dir, "out", name) for name in os.listdir(os.path.join(run_dir, "out"))
               if name.endswith("_metrics.jsonl")] if os.path.isdir(os.path.join(run_dir, "out")) else []
    for path in metrics:
        with open(path, encoding="utf-8") as f:
            rows += [row for row in map(json.loads, f) if "loss" in row]
    return returncode, log, rows


def found(pattern, log, default="?"):
    hits = re.findall(pattern, log.replace("\r", "\n"))
    return hits[-1] if hits else default


def seconds_a_step(rows, global_batch):
    """The median of the steps after the first two (compiling, allocating), or of all where there are no more."""
    rates = [row["images_per_s"] for row in rows[2:] or rows if row.get("images_per_s")]
    return global_batch / statistics.median(rates) if rates else float("nan")


def measure(comment, words, flags, work, timeout):
    """The capped run of `words` plus `flags` (the card in `comment`), then the uncapped one with its
    recomputation, in folders of `work` -> one table row."""
    card = int(re.findall(r"(\d+) GB card", comment)[0]) * 2 ** 30
    base = os.path.join(work, re.sub(r"\W+", "_", comment)[:60])
    started = time.time()
    code, log, capped = run([*words, *flags], card, os.path.join(base, "capped"), timeout)
    estimate = found(r"memory estimate per process: ([\d.]+) GiB", log)
    swapped = found(r"blocks swapped to host memory: (\d+) of", log, "0")
    recomputed = found(r"blocks recomputed in backward: (\d+) of", log)
    peak = found(r"peak memory after the run: ([\d.]+ / [\d.]+) GiB", log)
    grid = found(r"sample grid: \S+ \(([^)]*)\)", log)
    batch = int(words[words.index("--batch_size") + 1]) if "--batch_size" in words else 1
    row = {"command": comment, "exit": code, "estimate_gib": estimate, "swapped": swapped, "recomputed": recomputed,
           "peak_allocated_reserved_gib": peak, "grid": grid, "s_step": seconds_a_step(capped, batch),
           "capped_wall_s": round(time.time() - started)}
    if code == 0 and recomputed != "?":
        code, _, uncapped = run([*words, *flags, "--blocks_to_swap", "0", "--gradient_checkpointing", recomputed], 0,
                                os.path.join(base, "uncapped"), timeout)
        row.update(uncapped_exit=code, uncapped_s_step=seconds_a_step(uncapped, batch),
                   same_losses=[r["loss"] for r in capped] == [r["loss"] for r in uncapped],
                   losses=[r["loss"] for r in capped][:5])
        row["slowdown"] = row["s_step"] / row["uncapped_s_step"] if row["uncapped_s_step"] else None
    else:
        row["tail"] = log[-1500:]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="stand-ins, images and runs go here (about 20 GB)")
    parser.add_argument("--only", nargs="+", default=list(DEFAULT_ONLY), help="commands whose comment holds this")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resolution", type=int, default=1024, help="(a CPU dry run of this script: 64)")
    parser.add_argument("--extra", default="", help="flags added to each command (a CPU dry run: --frozen_dtype fp32, "
                        "which a CPU without native bf16 computes many times faster)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    args = parser.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        commands = [(c, w) for c, w in card_commands(f.read()) if any(o in c for o in args.only)]
    presets = {w[w.index("--preset") + 1] for _, w in commands}
    folders = {p: os.path.join(args.work, p) for p in presets}
    for preset, folder in folders.items():
        write_stand_in(folder, preset)
    data = os.path.join(args.work, "images")
    write_images(data, count=8, size=max(args.resolution, 64))
    prompts = os.path.join(args.work, "prompts.txt")
    with open(prompts, "w", encoding="utf-8") as f:
        f.write("a photo\n")
    flags = ["--resolution", str(args.resolution), "--max_steps", str(args.steps), "--sample_interval", "0",
             "--sample_steps", "2", "--sample_prompts", prompts, "--save_interval", str(10 ** 6),
             *shlex.split(args.extra)]
    for comment, words in commands:
        words = with_folder(words, folders, data)
        print(json.dumps(measure(comment, words, flags, args.work, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
