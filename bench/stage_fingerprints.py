"""Whether a change of the code changed what the stages compute: the sha256 of each default run's exported weights
and of its metric rows, to compare before and after a restructuring (they must not move).

    python bench/stage_fingerprints.py --work /tmp/fp            # the main job 200 steps, each stage 20 steps
    python bench/stage_fingerprints.py --work /tmp/fp --repo ../other_checkout --main_steps 20

The main job (`trainer/train_pretrain.py --max_steps 200`) runs first; pretraining, SFT, LoRA, distillation and
DPO then run their defaults for --steps steps, the last four from the main job's weights, one after the other.
A weights hash covers every tensor of the run's exported .safetensors files (name, dtype, shape, bytes; the files'
metadata left out, it holds paths and dates); a metrics hash covers the rows of its metrics file without the
timing fields (images_per_s, tflop_s, mfu).
"""
import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import time

import torch
from safetensors import safe_open

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (label, script, its metrics file, its exported files in the out folder)
RUNS = [("pretrain", "trainer/train_pretrain.py", "pretrain_tiny_metrics.jsonl", "pretrain_tiny.step*.safetensors"),
        ("sft", "trainer/train_full_sft.py", "sft_tiny_metrics.jsonl", "sft_tiny.step*.safetensors"),
        ("lora", "trainer/train_lora.py", "lora_demo_tiny_metrics.jsonl", "lora/lora_demo_tiny.safetensors"),
        ("distill", "trainer/train_distill.py", "distill_tiny_metrics.jsonl", "distill_tiny.step*.safetensors"),
        ("dpo", "trainer/train_dpo.py", "dpo_tiny_metrics.jsonl", "dpo_tiny.step*.safetensors")]


def weights_hash(paths):
    """sha256 over every tensor of the files (sorted by file name, then tensor name)."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=os.path.basename):
        with safe_open(path, "pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name).contiguous()
                digest.update(f"{os.path.basename(path)}:{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
                digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def metrics_hash(path):
    """sha256 of the metric rows without the columns a step's time sets (images_per_s, tflop_s, mfu), keys in
    their written order."""
    digest = hashlib.sha256()
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = {k: v for k, v in json.loads(line).items() if k not in ("images_per_s", "tflop_s", "mfu")}
            digest.update((json.dumps(row) + "\n").encode())
    return digest.hexdigest()


def train(repo, script, out_dir, save_dir, steps):
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, script, "--max_steps", str(steps), "--out_dir", out_dir, "--save_dir",
                             save_dir], cwd=repo, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{script} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="an empty folder for the runs' outputs")
    parser.add_argument("--repo", default=REPO_ROOT, help="the checkout whose stages run")
    parser.add_argument("--main_steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    work, repo = os.path.abspath(args.work), os.path.abspath(args.repo)
    rows = []
    main_out = os.path.join(work, "main", "out")
    seconds = train(repo, RUNS[0][1], main_out, os.path.join(work, "main", "ckpt"), args.main_steps)
    _, _, metrics, weights = RUNS[0]
    rows.append((f"main job, {args.main_steps} steps", weights_hash(glob.glob(os.path.join(main_out, weights))),
                 metrics_hash(os.path.join(main_out, metrics)), seconds))
    for label, script, metrics, weights in RUNS:
        # pretraining in its own folder; the others beside the main job's weights, which they start from
        out = os.path.join(work, "pretrain", "out") if label == "pretrain" else main_out
        seconds = train(repo, script, out, os.path.join(work, label, "ckpt"), args.steps)
        rows.append((f"{label}, {args.steps} steps", weights_hash(glob.glob(os.path.join(out, weights))),
                     metrics_hash(os.path.join(out, metrics)), seconds))
    print("| run | weights sha256 | metrics sha256 | seconds |\n|---|---|---|---|")
    for label, weights, metrics, seconds in rows:
        print(f"| {label} | {weights} | {metrics} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
