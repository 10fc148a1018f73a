"""Graphed against eager: the LoRA, full fine-tune and Flow-DPO stages run the same steps with --cuda_graph 0 and 1,
and this compares their losses step by step and times their steps. A CUDA GPU only: what `--cuda_graph auto` waits for.

    python bench/bench_cuda_graphs.py --work /tmp/graphs                  # the tiny defaults, 20 steps each
    python bench/bench_cuda_graphs.py --work /tmp/graphs --steps 40 --stages lora

The main job's weights come first (trainer/train_pretrain.py, a few steps); each stage then runs from them twice,
eager and graphed, with the same seed and data, a row a step in its metrics file (--log_interval 10). Both follow
the same random streams (drawn on the host), so their losses should agree to the last bit; the bound this checks is
one bf16 rounding of the loss (2^-8 relative), the noise a changed order of a reduction would make. The speeds
are the median images a second of the metrics' rows after the capture (step 4 on). Flow-DPO runs twice: all
weights on a manifest of built-in images (each caption's own image chosen, another's rejected), and adapters (the
reference: the policy with them off) on pairs it draws every 5 steps, between replays, scored by brightness
(tests/dpo_stand_in.py: the main job's few steps draw no shapes the shape scorer could tell apart).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from dataset.shapes import ShapesDataset  # noqa: E402

# each stage's script, its metrics file, and the loss it logs
STAGES = {"lora": ("trainer/train_lora.py", "lora_demo_tiny_metrics.jsonl", "loss"),
          "sft": ("trainer/train_full_sft.py", "sft_tiny_metrics.jsonl", "loss"),
          "dpo": ("trainer/train_dpo.py", "dpo_tiny_metrics.jsonl", "dpo"),
          "dpo_lora": ("tests/dpo_stand_in.py", "lora_dpo_tiny_metrics.jsonl", "dpo")}
# what a stage's runs take besides (main adds the "dpo" runs' manifest of pairs)
EXTRA = {"dpo_lora": ["--lora_rank", "4", "--pair_refresh", "5", "--pair_prompts", "16", "--pair_images", "4",
                     "--pair_sample_steps", "2"]}
BOUND = 2 ** -8  # one bf16 rounding, relative


def run(script, out, save, extra, timeout):
    command = [sys.executable, script, "--out_dir", out, "--save_dir", save, "--sample_interval", "0",
               "--sample_steps", "1", *extra]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result.stdout


def pair_manifest(folder, count):
    """`count` preference pairs of built-in images in `folder`: a caption's own image chosen, the next sample's
    rejected -> the manifest's path (--pairs)."""
    data, lines = ShapesDataset(num_samples=count + 1), []
    for i in range(count):
        (chosen, caption, _), rejected = data.sample(i), data.sample(i + 1)[0]
        chosen.save(os.path.join(folder, f"chosen{i}.png"))
        rejected.save(os.path.join(folder, f"rejected{i}.png"))
        lines.append(json.dumps({"prompt": caption, "chosen": f"chosen{i}.png", "rejected": f"rejected{i}.png"}))
    path = os.path.join(folder, "pairs.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def losses_and_speed(path, loss):
    """A metrics file and the name of its loss -> (each step's loss, the median images a second after the
    capture)."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    rows = [row for row in rows if row.get(loss) is not None]
    speeds = [row["images_per_s"] for row in rows[3:] if row.get("images_per_s")]
    return [row[loss] for row in rows], statistics.median(speeds) if speeds else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="an empty folder for the runs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", nargs="*", default=list(STAGES), choices=list(STAGES))
    parser.add_argument("--timeout", type=int, default=300, help="seconds a run may take")
    parser.add_argument("--modes", nargs=2, default=["0", "1"], help="the two --cuda_graph values compared (on a "
                        "CPU, `0 auto` checks this script's plumbing)")
    args = parser.parse_args(argv)
    work = os.path.abspath(args.work)
    main_out = os.path.join(work, "out")
    run("trainer/train_pretrain.py", main_out, os.path.join(work, "main_ckpt"), ["--max_steps", "4"], args.timeout)
    extra = dict(EXTRA)
    if "dpo" in args.stages:
        pairs = os.path.join(work, "pairs")
        os.makedirs(pairs, exist_ok=True)
        extra["dpo"] = ["--pairs", pair_manifest(pairs, 64)]
    print("| stage | steps | largest relative loss difference | within 2^-8 | eager images/s | graphed images/s | "
          "captures logged |\n|---|---|---|---|---|---|---|")
    for stage in args.stages:
        script, metrics, loss = STAGES[stage]
        results, logs = {}, {}
        for graph in args.modes:
            out = os.path.join(work, f"{stage}_graph{graph}")
            os.makedirs(out, exist_ok=True)
            for name in os.listdir(main_out):  # the main job's weights, which the stage starts from
                if not os.path.exists(os.path.join(out, name)):
                    os.symlink(os.path.join(main_out, name), os.path.join(out, name))
            logs[graph] = run(script, out, os.path.join(work, f"{stage}_ckpt{graph}"),
                              ["--max_steps", str(args.steps), "--log_interval", "10", "--cuda_graph", graph,
                               *extra.get(stage, [])], args.timeout)
            results[graph] = losses_and_speed(os.path.join(out, metrics), loss)
        (eager, eager_speed), (graphed, graphed_speed) = (results[mode] for mode in args.modes)
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager, graphed))
        captures = sum("CUDA graph " in line and "captured" in line for line in logs[args.modes[1]].splitlines())
        agree = "yes" if worst <= BOUND and len(eager) == len(graphed) else "NO"
        print(f"| {stage} | {len(eager)} | {worst:.2e} | {agree} | {eager_speed or float('nan'):.1f} | "
              f"{graphed_speed or float('nan'):.1f} | {captures} |")


if __name__ == "__main__":
    main()
