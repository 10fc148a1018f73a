"""The preference-tuning demo, measured: the starting weights vs the tuned ones on the GenEval-style prompts, each
with its own recorded sampler, on the same prompts and noise; and the run's reward curve from its metrics.

    python trainer/train_pretrain.py          # out/pretrain_tiny
    python trainer/train_dpo.py               # out/dpo_tiny
    python bench/bench_dpo_demo.py            # scores per task, the curve, docs/dpo_demo.png

Scores are eval_geneval's six tasks on the training-grammar and held-out prompts, once per --seeds (each seed
draws other noise for every image). The curve: per round of pairs, the score of the images the policy drew for
them (the fraction of their prompts' clauses that hold, and the fraction right), and the mean DPO loss and
implicit reward accuracy of the round's steps.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.demo_scores import IMAGES_PER_PROMPT, grid_row, measure_row, per_seed, task_table  # noqa: E402
from dataset.shapes import ShapesDataset  # noqa: E402
from eval.eval_geneval import PROMPTS_PER_TASK, all_prompts  # noqa: E402
from eval.sampling import load_for_sampling, sampler_for, save_grid  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.file_io import atomic_write_text  # noqa: E402
from model.weights import DEFAULT_OUT_DIR, REPO_ROOT  # noqa: E402


def reward_curve(metrics_path):
    """The run's metrics rows, grouped by round of pairs (a row that drew pairs starts one) -> [{"step", "pair_score",
    "pair_right", "dpo", "reward_accuracy", "reward_margin"}], the last three averaged over the round's steps."""
    if not os.path.isfile(metrics_path):
        raise UserError(f"no metrics at {metrics_path}: run trainer/train_dpo.py first (or pass --metrics)")
    with open(metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rounds = []
    for row in rows:
        if "pair_score" in row or not rounds:
            rounds.append({"step": row["step"], "pair_score": row.get("pair_score"),
                           "pair_right": row.get("pair_right"), "rows": []})
        rounds[-1]["rows"].append(row)
    for r in rounds:
        for key in ("dpo", "reward_accuracy", "reward_margin"):
            r[key] = sum(row[key] for row in r["rows"]) / len(r["rows"])
        del r["rows"]
    return rounds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="pretrain_tiny")
    parser.add_argument("--after", default="dpo_tiny")
    parser.add_argument("--metrics", default=None, help="the tuning run's metrics; default: out/<after>_metrics.jsonl")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="noise seeds of the scores")
    parser.add_argument("--prompts_per_task", type=int, default=PROMPTS_PER_TASK)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--grid", default=os.path.join(REPO_ROOT, "docs", "dpo_demo.png"))
    parser.add_argument("--json", default=None, help="default: out/bench_<after>.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    curve = reward_curve(args.metrics or os.path.join(args.out_dir, f"{args.after}_metrics.jsonl"))
    specs, demo_prompts = all_prompts(args.prompts_per_task), ShapesDataset().sample_prompts()
    report = {"prompts_per_task": args.prompts_per_task, "images_per_prompt": IMAGES_PER_PROMPT, "rows": [],
              "curve": curve}
    grid_images, grid_captions = [], []
    for label, weights in (("before", args.before), ("after", args.after)):
        model, components, record, _ = load_for_sampling(weights, args.out_dir, device)
        sampler = sampler_for(record)
        row = {"label": label, "weights": record["manifest"], "step": record["step"], "sampling": sampler.settings()}
        report["rows"].append(measure_row(row, sampler, model, components, specs, args.seeds, args.batch_size))
        grid_images.append(grid_row(model, components, demo_prompts, sampler, device))
        grid_captions += [f"{label}: {p or '(unconditional)'}" for p in demo_prompts]

    print(f"\n| weights | held-out ({', '.join(f'seed {s}' for s in args.seeds)}) | train |\n|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['label']} | {per_seed(row, 'heldout')} | {per_seed(row, 'train')} |")
    for split in ("heldout", "train"):
        print(f"\nby task, mean of the seeds\n{task_table(report['rows'], split)}")
    print("\n| round from step | images' clauses held | images right | DPO loss | reward accuracy | reward margin |\n"
          "|---|---|---|---|---|---|")
    for r in curve:
        drawn = f"{r['pair_score']:.3f} | {r['pair_right']:.3f}" if r["pair_score"] is not None else "- | -"
        print(f"| {r['step']} | {drawn} | {r['dpo']:.4f} | {r['reward_accuracy']:.3f} | {r['reward_margin']:.3f} |")
    save_grid(args.grid, torch.cat(grid_images), grid_captions, columns=len(demo_prompts))
    json_path = args.json or os.path.join(args.out_dir, f"bench_{args.after}.json")
    atomic_write_text(json_path, json.dumps(report, indent=1) + "\n")
    print(f"grid {args.grid} (before, then after); report {json_path}")


if __name__ == "__main__":
    run_main(main)
