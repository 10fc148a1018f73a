"""Generate images from trained weights into a captioned PNG grid (Euler sampler, classifier-free guidance).

    python eval/eval_sample.py --weights pretrain_tiny --prompt "a large red circle in the center"
    python eval/eval_sample.py --weights out/pretrain_tiny.json --prompt_file prompts.txt --seeds 4
    python eval/eval_sample.py --lora demo --prompt "a large white star in the center"      # on the LoRA's base
    python eval/eval_sample.py --lora demo --lora_scale 0.5 --merge --prompt "two white circles"
    python eval/eval_sample.py --weights /models/sd3-medium --prompt "a cat" --steps 28 --cfg 7      # diffusers folder

A LoRA is applied as trained (an extra low-rank term in each adapted layer), or with --merge folded into the
weights first; both give the same images.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.image_folder import read_prompt_file  # noqa: E402
from eval.sampling import load_for_sampling, output_path, sample_images, sampler_for, save_grid  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.weights import DEFAULT_OUT_DIR  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default=None, help="a stage name in --out_dir, a path, or a diffusers folder "
                        "(a pipeline, or a transformer with --base); default: the LoRA's base weights, else "
                        "pretrain_tiny")
    parser.add_argument("--base", default=None, help="the SD3 folder to take the VAE and text encoders from, instead "
                        "of the one the weights name")
    parser.add_argument("--lora", default=None, help="a LoRA name in out/lora (as --lora_name trained it), or a path")
    parser.add_argument("--lora_scale", type=float, default=1.0, help="0 = the base model, 1 = as trained")
    parser.add_argument("--merge", action="store_true", help="merge the LoRA into the weights before sampling")
    parser.add_argument("--prompt", action="append", default=[], help="repeatable")
    parser.add_argument("--prompt_file", default=None, help="one prompt per line")
    parser.add_argument("--seeds", type=int, default=1, help="images per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="default: what the run sampled with")
    parser.add_argument("--cfg", type=float, default=None)
    parser.add_argument("--shift", type=float, default=None)
    parser.add_argument("--resolution", type=int, default=None, help="default: what the run trained at")
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--out", default=None, help="PNG path; default samples/<weights>_eval.png beside the "
                        "weights (out/samples/ for out/'s runs)")
    args = parser.parse_args(argv)

    prompts = list(args.prompt) + (read_prompt_file(args.prompt_file) if args.prompt_file else [])
    if not prompts:
        raise UserError("no prompts: pass --prompt TEXT (repeatable) or --prompt_file FILE")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, components, record, lora_record = load_for_sampling(args.weights, args.out_dir, device, args.lora,
                                                               args.lora_scale, args.merge, args.base)
    sampler = sampler_for(record, args.steps, args.cfg, args.shift, args.resolution)
    all_prompts = [p for p in prompts for _ in range(args.seeds)]
    images = sample_images(model, components, all_prompts, args.seed, sampler, device)
    merged = "_merged" if args.merge and lora_record is not None else ""
    out = args.out or output_path(record, lora_record, args.out_dir, f"samples/{{name}}{merged}_eval.png")
    save_grid(out, images, all_prompts, columns=max(args.seeds, min(len(all_prompts), 8)))
    lora = f" + LoRA {args.lora} x{args.lora_scale:g}{' merged' if args.merge else ''}" if args.lora else ""
    print(f"{len(all_prompts)} images ({sampler.steps} steps, cfg {sampler.cfg}, shift {sampler.shift}) "
          f"from step {record['step']}{lora}: {out}")


if __name__ == "__main__":
    run_main(main)
