"""The main job's step, lever by lever: one training step (forward, backward, optimizer) of a preset at the main
job's batch, in fp32 and under bf16 autocast, with AdamW or Muon (+ AdamW for the rest), eager or with each block
compiled, timed in interleaved rounds so drift in machine load hits all alike. Prints the median step time of
each, its speed against the default (fp32, AdamW, eager), the compile time, and what the start-up bf16 check
(model/precision.py's measurement, repeated here) finds on this CPU.

    python bench/bench_levers.py                       # tiny preset, batch 16, 32 px (latent 16), 2 threads
    python bench/bench_levers.py --no_compile          # skip the compiled variants (their compile takes minutes)
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.model_sd3light import SD3Light, preset_config  # noqa: E402
from model.precision import cpu_bf16_speedup  # noqa: E402
from model.recompute import compile_block  # noqa: E402


def make_optimizer(model, kind, lr=1e-3):
    """As train_pretrain.py builds them: AdamW on everything, or Muon on the blocks' matrices + AdamW on the rest."""
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=lr, fused=True)]
    hidden, rest = model.block_matrices_and_rest()
    return [torch.optim.Muon(hidden, lr=lr, adjust_lr_fn="match_rms_adamw"), torch.optim.AdamW(rest, lr=lr, fused=True)]


def make_variant(preset, dtype, optimizer, compiled):
    torch.manual_seed(0)
    model = SD3Light(preset_config(preset)).train()
    if compiled:
        for block in model.transformer_blocks:
            compile_block(block)
    return {"model": model, "bf16": dtype == "bf16", "optimizers": make_optimizer(model, optimizer)}


def train_step(variant, inputs):
    """-> seconds of one step."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant["bf16"]):
        out = variant["model"](*inputs)
    out.float().square().mean().backward()
    torch.nn.utils.clip_grad_norm_(variant["model"].parameters(), 1.0)
    for opt in variant["optimizers"]:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--latent_size", type=int, default=16, help="32 px images through the built-in VAE")
    parser.add_argument("--text_len", type=int, default=24, help="text tokens: the built-in encoder's 24")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's own (the cores)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no_compile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = preset_config(args.preset)
    inputs = (torch.randn(args.batch_size, config.in_channels, args.latent_size, args.latent_size),
              torch.randn(args.batch_size, args.text_len, config.joint_attention_dim),
              torch.randn(args.batch_size, config.pooled_projection_dim), torch.rand(args.batch_size))
    names = [("fp32", "adamw", False), ("bf16", "adamw", False), ("fp32", "muon", False), ("bf16", "muon", False)]
    if not args.no_compile:
        names += [("fp32", "adamw", True), ("bf16", "adamw", True)]
    variants, warm = {}, {}
    for name in names:
        variants[name] = make_variant(args.preset, *name)
        t0 = time.perf_counter()
        train_step(variants[name], inputs), train_step(variants[name], inputs)  # compiles, if compiled
        warm[name] = time.perf_counter() - t0
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(train_step(variants[name], inputs))
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    base = median[names[0]]
    print(f"{args.preset}, batch {args.batch_size}, latent {args.latent_size}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; start-up check: bf16 at {cpu_bf16_speedup():.2f}x fp32's speed")
    print("| dtype | optimizer | blocks | step (median) | speed vs default | first two steps |")
    print("|---|---|---|---|---|---|")
    for name in names:
        dtype, optimizer, compiled = name
        print(f"| {dtype} | {optimizer} | {'compiled' if compiled else 'eager'} | {median[name] * 1000:.1f} ms | "
              f"{base / median[name]:.2f}x | {warm[name]:.1f} s |")


if __name__ == "__main__":
    main()
