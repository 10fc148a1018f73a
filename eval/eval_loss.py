"""Held-out loss at fixed sigma quantiles with fixed noise, so curves from different runs compare.

    python eval/eval_loss.py --weights pretrain_tiny                 # built-in held-out split
    python eval/eval_loss.py --weights pretrain_tiny --split train
    python eval/eval_loss.py --weights out/sft_tiny.json --data my_images/

Prints the loss at sigma 0.1 ... 0.9 and their mean (the last line). Captions are always used (no dropout).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.image_folder import build_dataset  # noqa: E402
from dataset.training_data import caption_options, encode_heldout  # noqa: E402
from model.file_io import atomic_write_text  # noqa: E402
from model.rectified_flow import add_noise, flow_loss, predict_velocity  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.weights import DEFAULT_OUT_DIR, load_weights, run_name  # noqa: E402

SIGMAS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


@torch.no_grad()
def heldout_losses(model, batches, prediction, seed=0, autocast=None, components=None):
    """{sigma: mean MSE of the velocity} over encoded batches (encode_heldout); noise is seeded per item and sigma.
    `autocast`: the dtype the model computes in (None: fp32). `components`: what conditions a batch that keeps its
    text features (its text encoders train), as it is now."""
    device = next(model.parameters()).device
    totals, n = {s: 0.0 for s in SIGMAS}, sum(len(batch["latents"]) for batch in batches)
    for batch in batches:
        latents = batch["latents"].to(device)
        tokens, pooled = (batch["tokens"].to(device), batch["pooled"].to(device)) if "text" not in batch else \
            components.condition({k: v.to(device) for k, v in batch["text"].items()})
        for k, s in enumerate(SIGMAS):
            noise = torch.stack([torch.randn(latents.shape[1:], generator=torch.Generator().manual_seed(
                seed + 1000003 * k + batch["first"] + j)) for j in range(len(latents))]).to(device)
            sigma = torch.full((len(latents),), s, device=device)
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                pred = predict_velocity(model, add_noise(latents, noise, sigma), tokens, pooled, sigma, prediction)
            totals[s] += flow_loss(pred, latents, noise, sigma).item() * len(latents)
    return {s: total / n for s, total in totals.items()}


def quantile_losses(model, components, dataset, num_samples, batch_size, device, prediction):
    """{sigma: mean MSE of the velocity} over the first num_samples items of `dataset`, with the noise of seed 0."""
    return heldout_losses(model, encode_heldout(components, dataset, num_samples, batch_size, device), prediction)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="pretrain_tiny", help="a stage name in --out_dir, or a path")
    parser.add_argument("--data", default="builtin")
    parser.add_argument("--split", default="heldout", choices=["heldout", "train"], help="for the built-in data")
    parser.add_argument("--num_samples", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, components, record = load_weights(args.weights, args.out_dir, device)
    # the held-out split is drawn from its own seed stream, so it never repeats a training sample; user captions get
    # the trigger word (--caption_prefix, --caption_suffix) the weights were trained with
    captions = caption_options(record.get("args", {}))
    dataset = build_dataset(args.data, record["resolution"], split=args.split, num_samples=args.num_samples,
                            seed=args.seed, log=lambda msg: None, captions=captions)
    batches = encode_heldout(components, dataset, args.num_samples, args.batch_size, device)
    losses = heldout_losses(model, batches, record["prediction"], args.seed)
    mean = sum(losses.values()) / len(losses)
    name = run_name(record["stage"], record["preset"])
    print(f"{name} step {record['step']}, {min(args.num_samples, len(dataset))} samples of {args.data} "
          f"({args.split if args.data == 'builtin' else 'user data'})")
    print("sigma  " + "  ".join(f"{s:6.1f}" for s in SIGMAS))
    print("loss   " + "  ".join(f"{v:6.4f}" for v in losses.values()))
    if args.json:
        atomic_write_text(args.json, json.dumps({"weights": name, "step": record["step"], "losses": losses,
                                                 "mean": mean}, indent=2) + "\n")
    print(f"mean held-out loss: {mean:.4f}" if args.split == "heldout" else f"mean loss: {mean:.4f}")


if __name__ == "__main__":
    run_main(main)
