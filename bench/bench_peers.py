"""Our LoRA training step beside diffusers' SD3Transformer2DModel with a peft LoRA on it (the computation of
diffusers' examples/dreambooth/train_dreambooth_lora_sd3.py), on the same stand-in folder, alternating in one run.

    python bench/stand_in.py /tmp/standin/base --preset base
    python bench/bench_peers.py --folder /tmp/standin/base --resolution 256
    python bench/bench_peers.py --folder /tmp/standin/medium --resolution 512 --steps 3 --rounds 1

Both sides take the same inputs: random latents at resolution / 8 (16 channels), SD3's text sequence (77 CLIP + 77
T5 tokens, 4096 wide) and pooled vector, logit-normal sigmas, the flow-matching MSE on the velocity. Both: the
transformer's weights frozen in bf16, computing under bf16 autocast (what the example's --mixed_precision bf16
does; --dtype fp32 for both on a CPU without bf16 arithmetic), a LoRA of the same rank on the same layers (the
example's default: the 8 projections of the joint attention), gradient checkpointing, AdamW, gradients clipped
to 1. It runs on the CPU (a GPU comparison would time with synchronisation and read torch.cuda's peak). Ours
keeps its adapters in fp32 (SD3-Light and model/model_lora.py), theirs as peft makes them; ours also with token
routing (model/token_routing.py: --route_ratio of the image tokens past blocks --route_first..--route_last).

Each side runs in a process of its own, so its peak resident memory (getrusage) is its own; the rounds alternate
the order. The step time is the median over the steps after the first (which warms up).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_model import machine_name  # noqa: E402
from model.file_io import atomic_write_text  # noqa: E402
from model.flops import FlopCount  # noqa: E402
from model.model_lora import apply_lora  # noqa: E402
from model.model_sd3light import SD3LightConfig  # noqa: E402
from model.rectified_flow import sample_sigmas  # noqa: E402
from model.token_routing import TokenRouting  # noqa: E402
from model.weights import diffusers_source, load_transformer  # noqa: E402

TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out"]  # the example's default --lora_layers
TEXT_TOKENS = 154  # 77 CLIP + 77 T5 (the example's --max_sequence_length 77)


def step_inputs(config, batch, resolution, steps, seed=0, text_tokens=TEXT_TOKENS, shift=1.0):
    """The same inputs for every side: [(latents, text, pooled, sigmas, noise)] a step, drawn on the CPU (sigmas
    logit-normal, shifted by `shift`)."""
    g = torch.Generator().manual_seed(seed)
    side = resolution // 8
    return [(torch.randn(batch, config.in_channels, side, side, generator=g),
             torch.randn(batch, text_tokens, config.joint_attention_dim, generator=g),
             torch.randn(batch, config.pooled_projection_dim, generator=g),
             sample_sigmas(batch, shift=shift, generator=g),
             torch.randn(batch, config.in_channels, side, side, generator=g))
            for _ in range(steps)]


def ours(folder, rank, dtype, routing_args):
    """SD3-Light from the folder, frozen in `dtype`, fp32 adapters -> (forward(x, text, pooled, t, generator),
    params, the routing)."""
    model = load_transformer(diffusers_source(folder, base=folder), dtype=dtype, frozen=True)
    apply_lora(model, TARGETS, rank=rank)
    model.gradient_checkpointing = True
    routing = TokenRouting.for_model(model.config, *routing_args)

    def forward(x, text, pooled, t, generator):
        return model(x, text, pooled, t, route=routing.draw(x, generator))
    return forward, [p for p in model.parameters() if p.requires_grad], routing


def theirs(folder, rank, dtype):
    """diffusers' SD3Transformer2DModel in `dtype` with a peft LoRA, as the example builds them."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    model = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=dtype)
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=TARGETS))
    model.train()

    def forward(x, text, pooled, t, generator):
        return model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                     return_dict=False)[0]
    return forward, [p for p in model.parameters() if p.requires_grad], TokenRouting()


def one_side(args):
    """Time --steps training steps of one side (in this process) -> its row."""
    torch.manual_seed(0)
    started = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    forward, params, routing = theirs(args.folder, args.rank, dtype) if args.side == "diffusers" else \
        ours(args.folder, args.rank, dtype, (args.route_ratio, args.route_first, args.route_last))
    loaded = time.perf_counter() - started
    config = SD3LightConfig.load_json(os.path.join(args.folder, "transformer"))
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=params[0].dtype == torch.float32)
    generator, times = torch.Generator().manual_seed(1), []
    for latents, text, pooled, s, noise in step_inputs(config, args.batch_size, args.resolution, args.steps):
        started = time.perf_counter()
        x_t = (1 - s.view(-1, 1, 1, 1)) * latents + s.view(-1, 1, 1, 1) * noise
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            pred = forward(x_t, text, pooled, s * 1000, generator)
        loss = (pred.float() - (noise - latents)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    side = args.resolution // 8
    flops = FlopCount(config, TEXT_TOKENS, routing, (args.rank, tuple(TARGETS)), True).forward(
        args.batch_size, side, side)
    return {"side": args.side, "route_ratio": args.route_ratio if args.side == "ours" else 0.0,
            "seconds_per_step": statistics.median(times[1:]), "steps": times, "load_seconds": loaded,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
            "adapter_dtype": str(params[0].dtype), "adapters": sum(p.numel() for p in params),
            "model_tflop_per_step": flops.model / 1e12, "recompute_tflop_per_step": flops.recompute / 1e12}


def run_side(args, side, ratio):
    command = [sys.executable, os.path.abspath(__file__), "--side", side, "--route_ratio", str(ratio),
               *[f"--{k}={getattr(args, k)}" for k in ("folder", "resolution", "batch_size", "rank", "steps",
                                                      "route_first", "route_last", "dtype")]]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{side} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", required=True, help="a diffusers SD3 folder (bench/stand_in.py makes one)")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the frozen weights and the "
                        "computation: bf16 (autocast, the example's --mixed_precision bf16) or fp32 (for a CPU "
                        "without bf16 arithmetic, where bf16 is emulated)")
    parser.add_argument("--steps", type=int, default=6, help="steps a side a round; the first warms up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--route_ratio", type=float, default=0.5)
    parser.add_argument("--route_first", type=int, default=2)
    parser.add_argument("--route_last", type=int, default=-2)
    parser.add_argument("--json", default=None, help="where the rows go (default: print only)")
    parser.add_argument("--side", default=None, choices=["ours", "diffusers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(args)))
        return
    sides = [("diffusers", 0.0), ("ours", 0.0), ("ours", args.route_ratio)]
    rows = []
    for round_ in range(args.rounds):
        for side, ratio in sides if round_ % 2 == 0 else sides[::-1]:
            row = {**run_side(args, side, ratio), "round": round_}
            rows.append(row)
            print(f"round {round_} {side:<9} routing {ratio:<4g} {row['seconds_per_step']:7.2f} s/step  peak "
                  f"{row['peak_gib']:.2f} GiB  adapters {row['adapter_dtype']}", flush=True)
    summary = {}
    for side, ratio in sides:
        mine = [r for r in rows if r["side"] == side and r["route_ratio"] == ratio]
        summary[f"{side} routing {ratio:g}"] = {
            "seconds_per_step": statistics.median(r["seconds_per_step"] for r in mine),
            "peak_gib": max(r["peak_gib"] for r in mine)}
    base = summary["diffusers routing 0"]["seconds_per_step"]
    for name, value in summary.items():
        print(f"{name:<22} {value['seconds_per_step']:7.2f} s/step  {base / value['seconds_per_step']:5.2f}x "
              f"diffusers' speed  peak {value['peak_gib']:.2f} GiB")
    record = {"machine": machine_name("cpu"), "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows,
              "summary": summary}
    if args.json:
        atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
