"""The distillation demo, measured: the teacher with its own sampler (20 Euler steps, classifier-free guidance) vs
the distilled student in 4, 2 and 1 steps without guidance, on the same prompts and noise.

    python trainer/train_pretrain.py          # the teacher: out/pretrain_tiny
    python trainer/train_distill.py           # the student: out/distill_tiny
    python bench/bench_distill_demo.py        # scores, evaluations and time per image; docs/distill_demo.png

Scores are eval_geneval's six tasks on the training-grammar and held-out prompts, once per --seeds (each seed
draws other noise for every image). Transformer evaluations per image: steps, twice with guidance. Time per image:
the wall clock of sampling the score's images, over their number (batches of --batch_size, this machine).
"""
import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.shapes import ShapesDataset  # noqa: E402
from bench.demo_scores import IMAGES_PER_PROMPT, grid_row, measure_row, per_seed, task_table  # noqa: E402
from eval.eval_geneval import PROMPTS_PER_TASK, all_prompts  # noqa: E402
from eval.sampling import load_for_sampling, sampler_for, save_grid  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.file_io import atomic_write_text  # noqa: E402
from model.weights import DEFAULT_OUT_DIR, REPO_ROOT  # noqa: E402


def samplers(teacher_record, student_record, student_steps):
    """(label, which weights, sampler settings): the teacher's own; the teacher's weights in the student's steps,
    with their guidance and deterministic Euler, and as the student samples (re-noising, no guidance: the student
    before distillation); then the student's at each step count."""
    steps = student_record["sampling"]["steps"]
    rows = [("teacher", "teacher", sampler_for(teacher_record)),
            (f"teacher {steps} steps", "teacher", sampler_for(teacher_record, steps=steps)),
            (f"undistilled {steps} steps", "teacher", replace(sampler_for(student_record), steps=steps,
                                                              prediction=teacher_record["prediction"],
                                                              resolution=teacher_record["resolution"]))]
    rows += [(f"student {steps} step{'s' * (steps > 1)}", "student", sampler_for(student_record, steps=steps))
             for steps in student_steps]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="pretrain_tiny")
    parser.add_argument("--student", default="distill_tiny")
    parser.add_argument("--student_steps", type=int, nargs="+", default=[4, 2, 1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="noise seeds of the scores")
    parser.add_argument("--prompts_per_task", type=int, default=PROMPTS_PER_TASK)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--grid", default=os.path.join(REPO_ROOT, "docs", "distill_demo.png"))
    parser.add_argument("--json", default=None, help="default: out/bench_<student>.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = {"teacher": load_for_sampling(args.teacher, args.out_dir, device)[:3],
              "student": load_for_sampling(args.student, args.out_dir, device)[:3]}
    specs, demo_prompts = all_prompts(args.prompts_per_task), ShapesDataset().sample_prompts()
    report = {"teacher": loaded["teacher"][2]["manifest"], "student": loaded["student"][2]["manifest"],
              "student_step": loaded["student"][2]["step"], "prompts_per_task": args.prompts_per_task,
              "images_per_prompt": IMAGES_PER_PROMPT, "rows": []}
    grid_images, grid_captions = [], []
    for label, which, sampler in samplers(loaded["teacher"][2], loaded["student"][2], args.student_steps):
        model, components, _ = loaded[which]
        row = {"label": label, "sampling": sampler.settings(),
               "evaluations": sampler.steps * (2 if sampler.cfg != 1.0 else 1)}
        report["rows"].append(measure_row(row, sampler, model, components, specs, args.seeds, args.batch_size))
        grid_images.append(grid_row(model, components, demo_prompts, sampler, device))
        grid_captions += [f"{label}: {p or '(unconditional)'}" for p in demo_prompts]

    print(f"\n| sampler | evaluations / image | held-out ({', '.join(f'seed {s}' for s in args.seeds)}) | train | "
          "ms / image |\n|---|---|---|---|---|")
    for row in report["rows"]:
        ms = sum(r["s_per_image"] for r in row["seeds"].values()) / len(row["seeds"]) * 1000
        print(f"| {row['label']} | {row['evaluations']} | {per_seed(row, 'heldout')} | {per_seed(row, 'train')} | "
              f"{ms:.1f} |")
    print(f"\nby task, mean of the seeds\n{task_table(report['rows'], 'heldout')}")
    save_grid(args.grid, torch.cat(grid_images), grid_captions, columns=len(demo_prompts))
    json_path = args.json or os.path.join(args.out_dir, f"bench_{args.student}.json")
    atomic_write_text(json_path, json.dumps(report, indent=1) + "\n")
    print(f"grid {args.grid} (a row per sampler); report {json_path}")


if __name__ == "__main__":
    run_main(main)
