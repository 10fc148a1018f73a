"""What a forward without gradients takes beyond its weights: SD3's VAE encoding or decoding an image (per pixel), and
one SD3.5-Medium transformer block (per token and unit of width). Each case runs in a process of its own: its peak
resident memory after the call minus before it (the model and the input already made). This CPU's RAM stands in
for a GPU's memory; model/memory.py's VAE_ENCODE_VALUES, VAE_DECODE_VALUES and INFERENCE_WORDS come from these.

    python bench/bench_inference_memory.py                       # encode, decode (256, 512 px), a block; fp32
    python bench/bench_inference_memory.py --resolutions 512 1024 --dtypes bfloat16

The VAE is SD3's (its real config: bench/stand_in.py's SD3_VAE), random weights: activations do not depend on them.
The block is the 14th of SD3.5-Medium (plain: no second attention) at --resolution's tokens and CLIP + T5's 154.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE_CASE = r"""
import json, resource, sys, torch
sys.path.insert(0, {repo!r})
from diffusers import AutoencoderKL
from bench.stand_in import SD3_VAE
from model.model_sd3light import SD3Light, preset_config
op, side, dtype = {op!r}, {side}, getattr(torch, {dtype!r})
torch.manual_seed(0)
if op == "block":  # a batch of 2 (a guided sample) at the tokens of a side x side image and the text's 154
    config = preset_config("sd3.5-medium")
    with torch.device("meta"):
        block = SD3Light(config).transformer_blocks[13]
    block = block.to_empty(device="cpu").to(dtype).requires_grad_(False)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    n, width = (side // 16) ** 2, config.inner_dim
    x, c, t = torch.randn(2, n, width, dtype=dtype), torch.randn(2, 154, width, dtype=dtype), torch.randn(2, width,
                                                                                                          dtype=dtype)
    def call(k=None):
        return block(x[:, :k], c, t) if k else block(x, c, t)
else:
    vae = AutoencoderKL(**SD3_VAE).to(dtype).eval().requires_grad_(False)
    x = torch.randn(1, 3, side, side, dtype=dtype) if op == "encode" else torch.randn(1, 16, side // 8, side // 8,
                                                                                      dtype=dtype)
    def call(k=None):
        if op == "encode":
            return vae.encode(x[..., :k, :k] if k else x).latent_dist.mean
        return vae.decode(x[..., :k // 8, :k // 8] if k else x).sample
with torch.no_grad():  # a first, smaller call: the kernels' one-off set-up is not counted
    call(64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.no_grad():
    out = call()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"op": op, "side": side, "dtype": {dtype!r}, "bytes": after - before}}))
"""


def measure(op, side, dtype):
    """One case in a fresh process -> its peak above the model and input, in bytes."""
    code = ONE_CASE.format(repo=REPO, op=op, side=side, dtype=dtype)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        sys.exit(f"{op} at {side} px ({dtype}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["bytes"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--ops", nargs="+", default=["encode", "decode", "block"], choices=["encode", "decode", "block"])
    args = parser.parse_args(argv)
    print("| op | px | dtype | peak above weights and input | values a pixel (VAE) or a token and unit of width |")
    print("|---|---|---|---|---|")
    for op in args.ops:
        for dtype in args.dtypes:
            for side in args.resolutions:
                peak, size = measure(op, side, dtype), torch.finfo(getattr(torch, dtype)).bits // 8
                units = 2 * ((side // 16) ** 2 + 154) * 1536 if op == "block" else side ** 2
                print(f"| {op} | {side} | {dtype} | {peak / 2 ** 20:.0f} MiB | {peak / size / units:.1f} |", flush=True)


if __name__ == "__main__":
    main()
