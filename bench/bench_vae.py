"""What SD3's VAE takes beyond its weights to encode or decode an image: each case in a process of its own, its peak
resident memory after the call minus before it (the model and the input already made), per image pixel. This CPU's
RAM stands in for a GPU's memory; model/memory.py's VAE_ENCODE_BYTES / VAE_DECODE_BYTES come from these numbers.

    python bench/bench_vae.py                                    # encode and decode, 256 and 512 px, fp32 and bf16
    python bench/bench_vae.py --resolutions 512 1024 --dtypes bf16

The VAE is SD3's (its real config: bench/stand_in.py's SD3_VAE), random weights: activations do not depend on them.
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE_CASE = r"""
import json, resource, sys, torch
sys.path.insert(0, {repo!r})
from diffusers import AutoencoderKL
from bench.stand_in import SD3_VAE
op, side, dtype = {op!r}, {side}, getattr(torch, {dtype!r})
torch.manual_seed(0)
vae = AutoencoderKL(**SD3_VAE).to(dtype).eval().requires_grad_(False)
x = torch.randn(1, 3, side, side, dtype=dtype) if op == "encode" else torch.randn(1, 16, side // 8, side // 8,
                                                                                  dtype=dtype)
with torch.no_grad():  # a first, smaller call: the kernels' one-off set-up is not counted
    vae.encode(x[..., :64, :64]) if op == "encode" else vae.decode(x[..., :8, :8])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.no_grad():
    out = vae.encode(x).latent_dist.mean if op == "encode" else vae.decode(x).sample
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
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    print("| op | px | dtype | peak above weights and input | bytes a pixel |")
    print("|---|---|---|---|---|")
    for op in ("encode", "decode"):
        for dtype in args.dtypes:
            for side in args.resolutions:
                peak = measure(op, side, dtype)
                print(f"| {op} | {side} | {dtype} | {peak / 2 ** 20:.0f} MiB | {peak / side ** 2:.0f} |", flush=True)


if __name__ == "__main__":
    main()
