"""Forward+backward step time of SD3Light vs diffusers' SD3Transformer2DModel on the same config and inputs.

Both models hold the same weights, see the same inputs, dtype and thread count, and are timed in interleaved
rounds (the order alternates each round) so drift in machine load hits both alike. Prints median times, the
ratio (SD3Light / diffusers; below 1.0 means SD3Light is faster), tokens/s and achieved FLOP/s.

    python bench/bench_model.py --preset tiny
    python bench/bench_model.py --preset small --batch_size 4 --iters 10
    python bench/bench_model.py --preset base --device cuda --dtype bf16 --compile   # on a GPU
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

if not __package__:  # run as a script (imported as a module, the repo root is already importable)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.flops import GPU_PEAKS, training_flops_per_sample  # noqa: E402
from model.model_sd3light import SD3Light, count_parameters, preset_config  # noqa: E402


def machine_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--latent_size", type=int, default=None,
                        help="latent height=width; default: the preset's sample_size")
    parser.add_argument("--text_len", type=int, default=None,
                        help="text tokens; default 32 for built-in presets, 154 (2 x 77) for SD3 ones")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="bf16 = autocast over fp32 weights, as in training")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20, help="timed rounds; each round times both models once")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--only_ours", action="store_true", help="skip diffusers (for shapes it cannot fit in memory)")
    return parser.parse_args(argv)


def build_models(config, device, only_ours):
    """SD3Light with random weights (initialize_weights zeroes adaLN and the output layer: randomised, so every
    path does real arithmetic) and, unless `only_ours`, diffusers' transformer holding the same weights."""
    ours = SD3Light(config).to(device)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.02)
    models = {"SD3Light": ours}
    if not only_ours:
        from diffusers import SD3Transformer2DModel

        theirs = SD3Transformer2DModel(**config.to_dict()).to(device)
        theirs.load_state_dict(ours.state_dict(), strict=True)
        models["diffusers"] = theirs
    return models


def training_steps(models, inputs, target, device, dtype, compile_models):
    """-> {name: a function running one forward and backward of that model on the same batch}."""
    steps = {}
    for name, model in models.items():
        fn = torch.compile(model) if compile_models else model

        def step(name=name, fn=fn, model=model):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                out = fn(*inputs)
                loss = ((out if name == "SD3Light" else out.sample).float() - target).pow(2).mean()
            loss.backward()
            model.zero_grad(set_to_none=True)

        steps[name] = step
    return steps


def time_steps(steps, device, warmup, iters):
    """-> {name: seconds of each timed round}, the models taking turns (first one, then the other first)."""
    def timed(step):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(warmup):
        for step in steps.values():
            step()
    times, names = {name: [] for name in steps}, list(steps)
    for i in range(iters):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(timed(steps[name]))
    return times


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = preset_config(args.preset)
    size = args.latent_size or config.sample_size
    text_len = args.text_len or (32 if config.joint_attention_dim <= 256 else 154)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    models = build_models(config, device, args.only_ours)
    B = args.batch_size
    inputs = (torch.randn(B, config.in_channels, size, size, device=device),
              torch.randn(B, text_len, config.joint_attention_dim, device=device),
              torch.randn(B, config.pooled_projection_dim, device=device), torch.rand(B, device=device) * 1000)
    target = torch.randn(B, config.output_channels, size, size, device=device)
    times = time_steps(training_steps(models, inputs, target, device, args.dtype, args.compile), device,
                       args.warmup, args.iters)

    flops = training_flops_per_sample(config, size, size, text_len) * B
    tokens = B * ((size // config.patch_size) ** 2 + text_len)
    peak = next((v for k, v in GPU_PEAKS.items() if device.type == "cuda" and machine_name("cuda").endswith(k)), None)
    print(f"date {datetime.date.today()}  machine {machine_name(device.type)}  torch {torch.__version__}  "
          f"threads {args.threads}")
    print(f"preset {args.preset} ({count_parameters(config) / 1e6:.1f}M params)  batch {B}  latent {size}x{size}  "
          f"text tokens {text_len}  dtype {args.dtype}  compile {args.compile}  rounds {args.iters}")
    medians = {}
    for name, ts in times.items():
        medians[name] = statistics.median(ts)
        mfu = f"  MFU {flops / medians[name] / peak:.1%}" if peak and args.dtype == "bf16" else ""
        print(f"{name:>10}: median {medians[name] * 1000:9.2f} ms  "
              f"(min {min(ts) * 1000:.2f}, max {max(ts) * 1000:.2f})  "
              f"{tokens / medians[name]:10.0f} tokens/s  {flops / medians[name] / 1e9:8.1f} GFLOP/s{mfu}")
    if "diffusers" in medians:
        print(f"ratio SD3Light/diffusers: {medians['SD3Light'] / medians['diffusers']:.3f}")


if __name__ == "__main__":
    main()
