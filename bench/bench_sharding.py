"""What sharding saves: per-GPU memory of the training state under DDP and FSDP, computed from parameter counts,
and the peak memory of each process measured on this machine for a real pretraining run under both.

    python bench/bench_sharding.py                      # the table, then DDP vs FSDP, 2 processes, preset small
    python bench/bench_sharding.py --table_only
    python bench/bench_sharding.py --preset tiny --processes 2 --steps 4

The formula (AdamW with fp32 master weights; activations, the frozen components and buffers aside):
    DDP:  4 (weights) + 4 (gradients) + 8 (AdamW's two moments) = 16 bytes per parameter on every GPU, + 4 for an EMA
    FSDP: the same 16 (or 20) bytes divided by the number of GPUs a shard group spans, + the bf16 weights of the
          block being computed (2 bytes per parameter of one block), gathered in turn
The measurement launches the processes itself (the same environment torchrun sets), polls each one's resident
memory while it trains and takes each one's peak over the whole run from the kernel (wait4): the whole process,
Python and torch included, and for the whole run the final save. glibc keeps large freed blocks resident once it has
raised its mmap threshold, which hides what FSDP frees (the whole model each rank builds before sharding); the
processes run with MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB so that resident memory follows live memory
(--default_malloc measures with glibc's default instead).
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    sys.path.insert(0, REPO)

from model.model_sd3light import count_parameters, preset_config  # noqa: E402

GB = 1e9
TABLE_PRESETS = ("base", "sd3-medium", "sd3.5-large")
GPUS = (1, 8, 64)


def state_bytes(preset, gpus, sharded, ema=False):
    """Bytes per GPU of weights + gradients + AdamW (+ EMA) for `preset` on `gpus` GPUs."""
    config = preset_config(preset)
    per_param = 16 + (4 if ema else 0)
    total = count_parameters(config) * per_param
    if not sharded:
        return total
    block = count_parameters(config) / config.num_layers  # about one block's share (embedders aside)
    return total / gpus + 2 * block


def table():
    lines = ["| preset | parameters | DDP, any number of GPUs | FSDP 1 GPU | FSDP 8 GPUs | FSDP 64 GPUs |",
             "|---|---|---|---|---|---|"]
    for preset in TABLE_PRESETS:
        params = count_parameters(preset_config(preset))
        cells = [f"{state_bytes(preset, n, True) / GB:.1f} GB" for n in GPUS]
        lines.append(f"| {preset} | {params / 1e9:.2f} B | {state_bytes(preset, 1, False) / GB:.1f} GB | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident(pid):
    """A live process's resident memory in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def logged_steps(folder, preset):
    path = os.path.join(folder, "out", f"pretrain_{preset}_metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def peak_per_process(train_argv, preset, steps, processes, malloc_env, folder):
    """Run pretraining (`train_argv`: its arguments, `steps` of preset `preset`) on `processes` processes, each with
    the environment `malloc_env` added, writing into `folder` -> (each process's peak resident memory while it
    trained, polled every 20 ms until the last step was logged; each one's peak over the whole run, from the kernel,
    the final save and sample grid included; seconds)."""
    port, procs = str(free_port()), []
    command = [sys.executable, os.path.join(REPO, "trainer", "train_pretrain.py"), *train_argv, "--out_dir",
               os.path.join(folder, "out"), "--save_dir", os.path.join(folder, "ckpt")]
    t0 = time.perf_counter()
    for rank in range(processes):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(processes),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", **malloc_env}
        procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
    training = [0] * len(procs)
    while logged_steps(folder, preset) < steps and all(proc.poll() is None for proc in procs):
        training = [max(peak, resident(proc.pid)) for peak, proc in zip(training, procs)]
        time.sleep(0.02)
    whole = []
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            message = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            raise SystemExit(f"a training process failed ({proc.returncode}):\n{message}")
        whole.append(usage.ru_maxrss * 1024)  # kilobytes on Linux
    return training, whole, time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table_only", action="store_true")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--num_samples", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work_dir", default="/tmp/minisd3_bench_sharding")
    parser.add_argument("--default_malloc", action="store_true", help="leave glibc's mmap threshold dynamic")
    args = parser.parse_args()
    print("Training state per GPU (weights + gradients + AdamW, fp32; FSDP adds one block's bf16 weights):")
    print(table())
    if args.table_only:
        return
    params = count_parameters(preset_config(args.preset))
    print(f"\nMeasured: pretraining preset {args.preset} ({params / 1e6:.1f}M parameters), {args.processes} processes, "
          f"{args.steps} steps of batch {args.batch_size} at {args.resolution}px, then the final save "
          f"({'glibc default malloc' if args.default_malloc else 'MALLOC_MMAP_THRESHOLD_=131072'})")
    for fsdp in (0, 1):
        folder = os.path.join(args.work_dir, f"fsdp{fsdp}")
        shutil.rmtree(folder, ignore_errors=True)
        train_argv = ["--preset", args.preset, "--resolution", str(args.resolution), "--num_samples",
                      str(args.num_samples), "--batch_size", str(args.batch_size), "--max_steps", str(args.steps),
                      "--sample_interval", "0", "--sample_steps", "2", "--save_interval", "1000", "--fsdp", str(fsdp)]
        malloc_env = {} if args.default_malloc else {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        training, whole, seconds = peak_per_process(train_argv, args.preset, args.steps, args.processes, malloc_env,
                                                     folder)
        expected = params * 20 / (args.processes if fsdp else 1)

        def gb(values):
            return ", ".join(f"{v / GB:.2f}" for v in values) + " GB"

        print(f"  {'FSDP' if fsdp else 'DDP '}: peak per process while training {gb(training)}; over the whole run "
              f"{gb(whole)} (state by the formula, with EMA: {expected / GB:.2f} GB; {seconds:.0f} s)")


if __name__ == "__main__":
    main()
