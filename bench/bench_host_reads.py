"""How often a stage's loop makes the host wait for the device: the reads of device values (a loss turned into a
float, a finiteness check in an `if`, a tensor's tolist) in each step of a real run, and the lines that make them.

    python bench/bench_host_reads.py --work /tmp/reads     # LoRA, the full fine-tune (and stepped in backward),
                                                           # pretraining, distillation
    python bench/bench_host_reads.py --work /tmp/reads --steps 8 --only lora --log_interval 4

On a GPU each such read waits for every kernel queued before it, so a loop that reads once a step cannot run ahead
of the device, and a CUDA graph cannot hold the step. On a CPU nothing waits, but the reads are the same calls:
they are counted here, on the tiny default runs (the main job's weights first, a few steps, then each stage from
them), as the proxy for the GPU's syncs.

A read is counted where it reaches the dispatcher (aten._local_scalar_dense, aten.is_nonzero) and at the Tensor
methods that read (tolist and numpy, which do not reach it; item, bool, float and int, which do: counted once,
there); on a GPU a copy of a device tensor to the CPU (`.cpu()`) too, which a CPU run cannot see. The steps are
told apart by their backward (each step here has one micro-batch): the reads from one backward's start to the next
are one step's, the next step's forward included. Code that torch.compile runs whole (torchao's 8-bit AdamW,
`--compile 1`) does not run under a dispatch mode: those runs are not counted here. Each stage script runs in a
child process of this one (runpy), so bench/ imports nothing of trainer/.

A read of a tensor that lives on the host on a GPU too is counted as well, since a CPU run cannot tell it apart:
distillation's check of the teacher's guidance interval on the score sigmas as drawn (once in each generator
step's forward). DPO is not run here: the main job's two steps draw images all alike, which give no pairs;
tests/test_throughput.py counts its loop through a stand-in verifier.
"""
import argparse
import collections
import json
import os
import runpy
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READ_OPS = ("aten._local_scalar_dense", "aten.is_nonzero")
# the Tensor methods that read, wrapped: tolist and numpy do not reach the dispatcher; the others do, and are named
WRAPPED = ("tolist", "numpy", "item", "__bool__", "__float__", "__int__")
# (label, script, extra arguments): each from the main job's weights in the same out folder
RUNS = {"lora": ("trainer/train_lora.py", []),
        "full_sft": ("trainer/train_full_sft.py", []),
        "full_sft_step_in_backward": ("trainer/train_full_sft.py", ["--step_in_backward", "1"]),
        "pretrain": ("trainer/train_pretrain.py", ["--out_dir", "{work}/pretrain_out"]),  # (its own export)
        "distill": ("trainer/train_distill.py", ["--gen_update_ratio", "2"])}  # the generator every other step


def caller():
    """The innermost frame of this repository's code (not this file's) that led here: 'path:line'."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(REPO + os.sep) and path != os.path.abspath(__file__):
            return f"{os.path.relpath(path, REPO)}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside the repository)"


class HostReads(TorchDispatchMode):
    """Counts the host's reads of tensor values while entered, by step and by the line that made them."""

    def __init__(self):
        super().__init__()
        self.steps, self.lines, self.wrapped = [[]], collections.Counter(), 0

    def read(self, kind):
        where = f"{caller()} ({kind})"
        self.steps[-1].append(where)
        self.lines[where] += 1

    def new_step(self):
        self.steps.append([])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = str(func.overloadpacket), kwargs or {}
        if self.wrapped:  # inside a wrapped Tensor method, counted there
            return func(*args, **kwargs)
        if name in READ_OPS or name == "aten._to_copy" and to_host(args[0], kwargs.get("device")):
            self.read(name)
        return func(*args, **kwargs)


def to_host(tensor, device):
    """Whether a copy of `tensor` to `device` brings a device's values to the host (never on a CPU run)."""
    return tensor.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"


def wrap(counter, name, new_step=False):
    """Tensor.<name> counting a read (or starting a step) before it runs."""
    original = getattr(torch.Tensor, name)

    def counted(self, *args, **kwargs):
        if new_step:
            counter.new_step()
            return original(self, *args, **kwargs)
        if not counter.wrapped:
            counter.read(f"Tensor.{name}")
        counter.wrapped += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.wrapped -= 1

    setattr(torch.Tensor, name, counted)


def counted_run(script, argv):
    """Run `script` with `argv` in this process with the reads counted -> {"steps": reads a step, "lines": ...}."""
    counter = HostReads()
    for name in WRAPPED:
        wrap(counter, name)
    wrap(counter, "backward", new_step=True)
    sys.argv = [script] + argv
    code = 0
    with counter:
        try:
            runpy.run_path(os.path.join(REPO, script), run_name="__main__")
        except SystemExit as stop:
            code = stop.code or 0
    # steps[0]: the set-up before the first backward; the last: after the last backward (the save, the end)
    steady = counter.steps[1:-1]
    return {"code": code, "setup": len(counter.steps[0]), "steps": [len(s) for s in steady],
            "after": len(counter.steps[-1]),
            "step_lines": collections.Counter(w for s in steady for w in s).most_common()}


def run(script, argv):
    """`script` in a child process with the reads counted -> its summary."""
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", script, "--"] + argv, cwd=REPO,
                            capture_output=True, text=True)
    rows = [line[6:] for line in result.stdout.splitlines() if line.startswith("READS ")]
    if result.returncode or not rows:
        sys.exit(f"{script} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return json.loads(rows[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", help="an empty folder for the runs' outputs")
    parser.add_argument("--steps", type=int, default=6, help="each stage's steps")
    parser.add_argument("--only", nargs="*", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--log_interval", type=int, default=1, help="the stages' --log_interval")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        print("READS " + json.dumps(counted_run(args.child, rest[1:] if rest[:1] == ["--"] else rest)))
        return
    if not args.work:
        parser.error("--work is required")
    out = os.path.join(os.path.abspath(args.work), "out")
    quiet = ["--out_dir", out, "--sample_interval", "0", "--val_interval", "1000000"]
    subprocess.run([sys.executable, "trainer/train_pretrain.py", "--max_steps", "2", "--out_dir", out,
                    "--save_dir", os.path.join(args.work, "main")], cwd=REPO, check=True, capture_output=True)
    print("| run | reads before the first backward | reads a step | after the last backward | the steps' reads |")
    print("|---|---|---|---|---|")
    for label in args.only:
        script, extra = RUNS[label]
        summary = run(script, ["--max_steps", str(args.steps), "--log_interval", str(args.log_interval),
                               "--save_dir", os.path.join(args.work, label)] + quiet +
                      [a.format(work=os.path.abspath(args.work)) for a in extra])
        lines = "; ".join(f"{where} x{n}" for where, n in summary["step_lines"])
        print(f"| {label} | {summary['setup']} | {summary['steps']} | {summary['after']} | {lines} |")


if __name__ == "__main__":
    main()
