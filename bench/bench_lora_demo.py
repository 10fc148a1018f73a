"""The LoRA demo, measured: how well the model draws the colour the adapter taught it, with and without the
adapter, and whether what it drew before survives.

    python trainer/train_lora.py              # the demo: teach out/pretrain_tiny the word "white"
    python bench/bench_lora_demo.py           # its scores, and docs/lora_demo_before_after.png

Scores are eval_geneval's six tasks, on prompts that each hold a white object (read by the scorer with white
added to its palette), and on the usual training-grammar and held-out prompts; each for the base model (LoRA
scale 0) and with the adapter (scale 1), with the same noise.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.shapes import NEW_COLORS, SHAPES, ShapesDataset  # noqa: E402
from eval.eval_geneval import PROMPTS_PER_TASK, TASKS, all_prompts, generate, prompt_set, score  # noqa: E402
from eval.shape_scorer import COLOR_NAMES  # noqa: E402
from model.file_io import atomic_write_text  # noqa: E402
from model.model_lora import lora_layers, lora_parameters, set_lora_scale  # noqa: E402
from eval.sampling import load_for_sampling, sample_images, sampler_for, save_grid  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.weights import DEFAULT_OUT_DIR, REPO_ROOT, resolve_lora  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lora", default="demo", help="a LoRA name in out/lora, or a path")
    parser.add_argument("--weights", default=None, help="default: the LoRA's base weights")
    parser.add_argument("--color", default="white", choices=list(NEW_COLORS), help="the colour the LoRA taught")
    parser.add_argument("--prompts_per_task", type=int, default=PROMPTS_PER_TASK)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--grid", default=os.path.join(REPO_ROOT, "docs", "lora_demo_before_after.png"))
    parser.add_argument("--json", default=None, help="default: out/bench_lora_<lora>.json")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_lora(args.lora, args.out_dir)
    model, components, record, lora_record = load_for_sampling(args.weights, args.out_dir, device, path)
    sampler = sampler_for(record)
    # the transformer and any text encoder the file adapts too (--train_text_encoders): scaled together
    adapted = [model] + [m for m in components.text_models().values() if m is not None and lora_layers(m)]
    new_pairs = [(args.color, shape) for shape in SHAPES]
    new_specs = [dict(spec, split="new") for task in TASKS
                 for spec in prompt_set(task, "train", args.prompts_per_task, pairs=new_pairs)]
    usual_specs = all_prompts(args.prompts_per_task)
    report = {"lora": path, "bytes": os.path.getsize(path), "weights": record["manifest"],
              "trainable_parameters": sum(p.numel() for m in adapted for p in lora_parameters(m)),
              "lora_step": lora_record.get("step"), "sampling": sampler.settings(), "seeds": args.seeds, "scores": {}}
    demo_prompts = ShapesDataset(colors=(args.color,)).sample_prompts()
    grid_images, grid_captions = [], []
    for label, scale in (("base", 0.0), ("lora", 1.0)):
        for m in adapted:
            set_lora_scale(m, scale)
        new_table, new_overall, _ = score(new_specs, generate(model, components, new_specs, args.seeds, sampler),
                                          colors=COLOR_NAMES + (args.color,))
        table, overall, _ = score(usual_specs, generate(model, components, usual_specs, args.seeds, sampler))
        report["scores"][label] = {
            "new": {task: new_table[task]["new"] for task in TASKS}, "new_overall": new_overall["new"],
            "train_overall": overall["train"], "heldout_overall": overall["heldout"],
            "train": {task: table[task]["train"] for task in TASKS},
            "heldout": {task: table[task]["heldout"] for task in TASKS}}
        grid_images.append(sample_images(model, components, demo_prompts, 0, sampler, device))
        grid_captions += [f"{label}: {p or '(unconditional)'}" for p in demo_prompts]

    scores = report["scores"]
    print(f"{'task':<14} {args.color + ' base':>11} {args.color + ' LoRA':>11}")
    for task in TASKS:
        print(f"{task:<14} {scores['base']['new'][task]:>11.3f} {scores['lora']['new'][task]:>11.3f}")
    for key, what in (("new_overall", f"{args.color} overall"), ("train_overall", "training grammar"),
                      ("heldout_overall", "held-out")):
        print(f"{what:<18} {scores['base'][key]:>7.3f} {scores['lora'][key]:>11.3f}")
    save_grid(args.grid, torch.cat(grid_images), grid_captions)
    json_path = args.json or os.path.join(args.out_dir, f"bench_{os.path.basename(path)[:-len('.safetensors')]}.json")
    atomic_write_text(json_path, json.dumps(report, indent=1) + "\n")
    print(f"{report['trainable_parameters']} trainable parameters, {report['bytes']} bytes; grid {args.grid}; "
          f"report {json_path}")


if __name__ == "__main__":
    run_main(main)
