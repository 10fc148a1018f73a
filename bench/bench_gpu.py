"""The first GPU run, checked at once: every stage for a few steps (a save and its verification included) under DDP
and FSDP, in bf16, with compiled blocks and without, LoRA on an int8 base, 8-bit AdamW sharded; for each, whether
it finished, its seconds a step (the median after the first step) and each rank's peak memory (on a GPU what
torch allocated / what its allocator reserved; on a CPU the resident size), from the run's own log and metrics.

    python bench/bench_gpu.py                        # every scenario, on all of this node's GPUs (torchrun)
    python bench/bench_gpu.py --only lora_int8 pretrain_fsdp_adamw8bit
    python bench/bench_gpu.py --large 1              # also a 1024 px LoRA of the SD3.5-Large stand-in (GPU only;
                                                     # bench/stand_in.py writes it: 16 GB of disk)

On a CPU it runs what a CPU can, on two processes with gloo, and names the scenarios that need a GPU (native
bf16, compiled blocks worth timing, the 1024 px LoRA) instead of running them. The scenarios share one folder
(--work): the fine-tunes start from the pretrain scenario's weights.
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.stand_in import write_stand_in  # noqa: E402

QUICK = ["--max_steps", "6", "--save_interval", "3", "--sample_interval", "0", "--warmup_steps", "2",
         "--batch_size", "4"]
START = "{work}/pretrain_ddp/out/pretrain_tiny.json"  # what the fine-tunes start from
# name: (script, its arguments, needs a GPU, what it checks)
SCENARIOS = {
    "pretrain_ddp": ("train_pretrain.py", ["--num_samples", "256", "--prediction", "v"], False, "DDP, the main job"),
    "pretrain_fsdp": ("train_pretrain.py", ["--num_samples", "256", "--fsdp", "1"], False, "FSDP2"),
    "pretrain_fsdp_adamw8bit": ("train_pretrain.py", ["--num_samples", "256", "--fsdp", "1", "--optimizer",
                                                      "adamw8bit"], False, "8-bit AdamW sharded, its DCP save"),
    "pretrain_bf16": ("train_pretrain.py", ["--num_samples", "256", "--dtype", "bf16"], True, "bf16 autocast"),
    "pretrain_compile": ("train_pretrain.py", ["--num_samples", "256", "--dtype", "bf16", "--compile", "1"], True,
                         "compiled blocks, bf16"),
    "pretrain_compile_fsdp": ("train_pretrain.py", ["--num_samples", "256", "--dtype", "bf16", "--compile", "1",
                                                    "--fsdp", "1"], True, "compiled blocks under FSDP"),
    "sft_fsdp": ("train_full_sft.py", ["--from_weight", START, "--num_samples", "64", "--fsdp", "1"], False,
                 "full fine-tune, sharded"),
    "lora_int8": ("train_lora.py", ["--from_weight", START, "--frozen_dtype", "int8"], False,
                  "LoRA on an int8 base (DDP)"),
    "lora_fsdp_bf16": ("train_lora.py", ["--from_weight", START, "--frozen_dtype", "bf16", "--fsdp", "1"], False,
                       "LoRA on a sharded bf16 base"),
    "distill": ("train_distill.py", ["--from_weight", START, "--num_samples", "64", "--gen_steps", "2"], False,
                "DMD2: teacher, generator, fake score"),
    "dpo_lora": ("train_dpo.py", ["--from_weight", START, "--pairs", "{work}/pairs.jsonl", "--lora_rank", "4"],
                 False, "Flow-DPO on given pairs"),
    "lora_large_1024": ("train_lora.py", ["--base", "{large}", "--from_weight", "base", "--preset", "sd3.5-large",
                                          "--data", "{work}/images_1024", "--resolution", "1024", "--batch_size",
                                          "1", "--gradient_checkpointing", "1", "--frozen_dtype", "bf16"], True,
                        "LoRA of the SD3.5-Large stand-in at 1024 px"),
}


def write_pairs(work, count=8, size=32):
    """A .jsonl of `count` preference pairs of random images (what DPO reads from --pairs)."""
    folder, rng, lines = os.path.join(work, "pairs"), np.random.default_rng(0), []
    os.makedirs(folder, exist_ok=True)
    for i in range(count):
        paths = [os.path.join(folder, f"{i}_{which}.png") for which in ("chosen", "rejected")]
        for path in paths:
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        lines.append(json.dumps({"prompt": f"a red circle {i}", "chosen": paths[0], "rejected": paths[1]}))
    with open(os.path.join(work, "pairs.jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_images(folder, count=4, size=1024):
    """A folder of `count` random images with captions (the 1024 px LoRA's data)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i}.png"))
        with open(os.path.join(folder, f"{i}.txt"), "w", encoding="utf-8") as f:
            f.write(f"a photo of noise number {i}")


def command(name, work, processes, large):
    script, args, _, _ = SCENARIOS[name]
    args = [a.format(work=work, large=large) for a in args]
    folders = ["--out_dir", f"{work}/{name}/out", "--save_dir", f"{work}/{name}/ckpt", "--cache_dir",
               f"{work}/{name}/cache"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    grid = [] if script == "train_distill.py" else ["--sample_steps", "1"]  # a generator samples in its own steps
    return launcher + [os.path.join(REPO, "trainer", script), *QUICK, *grid, *args, *folders]


def step_seconds(out_dir):
    """The median seconds a step after the first (compilation, warm-up), from the metrics file."""
    rows = []
    for path in glob.glob(os.path.join(out_dir, "*_metrics.jsonl")):
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get("images_per_s") and r.get("samples_seen")]
    seconds = [(b["samples_seen"] - a["samples_seen"]) / b["images_per_s"] for a, b in zip(rows, rows[1:])]
    return statistics.median(seconds) if seconds else None


def run_scenario(name, work, processes, large):
    """-> (exit code, seconds a step, the peak line's numbers, the log's last line)."""
    log_path = os.path.join(work, f"{name}.log")
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(command(name, work, processes, large), stdout=log, stderr=subprocess.STDOUT,
                              cwd=REPO).returncode
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    peak = re.search(r"peak memory after the run: (.*?) GiB", text)
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    return code, step_seconds(os.path.join(work, name, "out")), peak.group(1) if peak else "-", last[0][-160:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="these scenarios (default: all)")
    parser.add_argument("--work", default=None, help="the scenarios' folder (default: a new temporary one)")
    parser.add_argument("--large", type=int, default=0, help="1 = also the 1024 px LoRA of the SD3.5-Large stand-in")
    parser.add_argument("--stand_in", default=os.path.join(REPO, "bench", "stand_ins", "sd3.5-large"),
                        help="where the SD3.5-Large stand-in is (written there if missing)")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    processes = torch.cuda.device_count() if gpu else 2
    work = args.work or tempfile.mkdtemp(prefix="bench_gpu_")
    os.makedirs(work, exist_ok=True)
    write_pairs(work)
    names = args.only or [n for n in SCENARIOS if n != "lora_large_1024" or args.large]
    if "lora_large_1024" in names and gpu:
        write_stand_in(args.stand_in, "sd3.5-large")
        write_images(os.path.join(work, "images_1024"))
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    print(f"{device} x{processes}, torch {torch.__version__}; folder {work}")
    print(f"| scenario | what | exit | s/step | peak GiB by rank{' (allocated / reserved)' if gpu else ''} |")
    print("|---|---|---|---|---|")
    for name in names:
        what, needs_gpu = SCENARIOS[name][3], SCENARIOS[name][2]
        if needs_gpu and not gpu:
            print(f"| {name} | {what} | needs a GPU: not run | | |")
            continue
        code, seconds, peak, last = run_scenario(name, work, processes, args.stand_in)
        shown = f"{seconds:.3f}" if seconds else "-"
        print(f"| {name} | {what} | {code} | {shown} | {peak} |" + ("" if code == 0 else f" {last}"), flush=True)


if __name__ == "__main__":
    main()
