"""What a verified save costs: the resume checkpoint and the weights export of one preset, written the way
training writes them (temp file, fsync, rename, read back and compared, sha256, manifest), against a plain
`torch.save` + fsync + rename of the same resume state, and what loading with the manifest check costs.

    python bench/bench_checkpoint.py --preset tiny
    python bench/bench_checkpoint.py --preset small --dir /fast/disk/tmp
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_model import machine_name  # noqa: E402
from model.file_io import atomic_path  # noqa: E402
from model.model_sd3light import SD3Light, count_parameters, preset_config  # noqa: E402
from model.checkpoint import checkpoint_file, load_torch, read_manifest, save_checkpoint  # noqa: E402
from model.weights import save_weights  # noqa: E402


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()

    model = SD3Light(preset_config(args.preset))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for p in model.parameters():  # one step, so the optimizer holds its moments as during training
        p.grad = torch.zeros_like(p)
    optimizer.step()
    ema = {k: v.detach().float().clone() for k, v in model.state_dict().items()}  # what an EMA holds: an fp32 copy
    resume = {"kind": "resume", "step": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "ema": ema, "rng": [{"train": torch.Generator().get_state(), "torch": torch.get_rng_state()}]}
    record = {"stage": "bench", "preset": args.preset, "transformer": model.config.to_dict()}

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        plain_path, stem = os.path.join(directory, "plain.pt"), os.path.join(directory, "bench")
        step = iter(range(1, 10 ** 6))

        def plain_save():
            with atomic_path(plain_path) as tmp:
                torch.save(resume, tmp)

        plain = timed(plain_save, args.repeats)
        verified_resume = timed(lambda: save_checkpoint(stem + "_resume", next(step), {"kind": "resume"},
                                                        {".pt": resume}), args.repeats)
        weights = timed(lambda: save_weights(stem, next(step), model, ema, {}, record, torch.bfloat16),
                        args.repeats)

        def load():
            manifest = read_manifest(stem + "_resume", "resume")
            load_torch(checkpoint_file(stem + "_resume", manifest, ".pt"))

        load_time = timed(load, args.repeats)
        resume_mb = os.path.getsize(plain_path) / 1e6
        weights_mb = sum(e["bytes"] for e in read_manifest(stem, "weights")["files"].values()) / 1e6

    print(f"{datetime.date.today()}  {machine_name('cpu')}  torch {torch.__version__}")
    print(f"preset {args.preset}: {count_parameters(model.config) / 1e6:.1f}M parameters; median of {args.repeats}")
    print(f"resume checkpoint {resume_mb:.0f} MB: plain save {plain:.2f} s, verified save {verified_resume:.2f} s "
          f"({verified_resume / plain:.1f}x), load with manifest check {load_time:.2f} s")
    print(f"weights export (bf16) {weights_mb:.0f} MB: verified save {weights:.2f} s")


if __name__ == "__main__":
    main()
