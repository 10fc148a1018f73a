"""The two-process FSDP save / SIGKILL / resume cycle, many times, with glibc's heap checks and faulthandler on:
does anything abort in native code ("double free or corruption", a segmentation fault)?

    python bench/bench_fsdp_stress.py --cycles 30
    python bench/bench_fsdp_stress.py --cycles 30 --work /tmp/stress   # keep every cycle's logs there

A cycle: the tiny model under `torchrun --nproc_per_node 2 ... --fsdp 1`, saving every step, SIGKILLed (torchrun and
its ranks) at a random moment after its first committed save, most often inside a save; the last committed
checkpoint is read back whole (its manifest's sizes and hashes); then the run is resumed to its end under torchrun
again, saving every step. With glibc's debug malloc (libc_malloc_debug.so preloaded, MALLOC_CHECK_=3) each free is
checked and a corrupted heap aborts the process, and PYTHONFAULTHANDLER=1 prints every thread's Python stack when
a process dies of a signal. A cycle fails where the
resumed run does not exit 0 or either run's output shows a native crash; each failure's output is printed.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from model.checkpoint import CheckpointError, read_manifest  # noqa: E402

# glibc 2.34 and later check the heap only with its debug malloc preloaded; PYTHONMALLOC=malloc sends Python's own
# small objects through glibc too
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "LD_PRELOAD": "libc_malloc_debug.so.0", "MALLOC_CHECK_": "3",
       "GLIBC_TUNABLES": "glibc.malloc.check=3", "PYTHONMALLOC": "malloc", "PYTHONFAULTHANDLER": "1"}
STEPS = 8
STEM = "pretrain_tiny_resume"
# what glibc, Python's faulthandler and torchrun print of a native crash
CRASHES = ("double free", "corrupted", "free(): ", "malloc(): ", "Fatal Python error", "Segmentation fault",
           "Aborted", "exitcode  : -")


def command(folder, resume):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "trainer/train_pretrain.py", "--fsdp", "1", "--num_samples", "32", "--batch_size", "2", "--max_steps",
            str(STEPS), "--save_interval", "1", "--sample_interval", "0", "--sample_steps", "1", "--warmup_steps", "0",
            "--from_resume", str(int(resume)), "--out_dir", os.path.join(folder, "out"),
            "--save_dir", os.path.join(folder, "ckpt")]


def committed_step(folder):
    """The step of the last commit, its files read back whole (sizes and hashes), or 0."""
    try:
        return read_manifest(os.path.join(folder, "ckpt", STEM), "resume")["step"]
    except CheckpointError:
        return 0


def manifest(folder):
    """The committed manifest as it reads, unchecked: cheap enough to poll while the run trains ({} if none)."""
    try:
        with open(os.path.join(folder, "ckpt", STEM + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def inside_a_save(folder):
    """Whether a save was under way: files of the resume checkpoint that its manifest does not name."""
    ckpt = os.path.join(folder, "ckpt")
    named = {name.split("/")[0] for name in manifest(folder).get("files", {})}
    return os.path.isdir(ckpt) and any(n.startswith(".tmp-") or (n.startswith(STEM + ".step") and n not in named)
                                       for n in os.listdir(ckpt))


def killed_run(folder, log_path, rng):
    """Start the run, SIGKILL all of it a random 0-3 s after its first commit -> (committed step before, after,
    whether a save was under way)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(folder, False), cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 300
        while not manifest(folder) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 3.0))
        before = manifest(folder).get("step", 0)
        kill_all(proc)
    return before, committed_step(folder), inside_a_save(folder)


def family(pid):
    """pid and every process below it."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid] + [p for child in f.read().split() for p in family(int(child))]
    except OSError:  # gone meanwhile
        return [pid]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def kill_all(proc):
    """SIGKILL to every process group of the run: torchrun starts each rank in a group of its own, and a rank
    whose torchrun died trains on; then wait until every process of it has ended."""
    everyone, groups = family(proc.pid), set()
    for pid in everyone:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.time() + 60
    while any(alive(pid) for pid in everyone) and time.time() < deadline:
        time.sleep(0.05)


def cycle(number, folder, rng):
    """-> (a row of the report, the failure's text or None)."""
    os.makedirs(folder)
    before, after, saving = killed_run(folder, os.path.join(folder, "killed.log"), rng)
    started = time.time()
    resumed = subprocess.run(command(folder, True), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    output = resumed.stdout + resumed.stderr
    with open(os.path.join(folder, "resumed.log"), "w") as f:
        f.write(output)
    with open(os.path.join(folder, "killed.log")) as f:
        killed = f.read()
    crashes = [word for word in CRASHES if word in killed + output]
    end = committed_step(folder)
    row = (f"| {number} | {before} -> {after} | {'yes' if saving else 'no'} | {resumed.returncode} | {end} | "
           f"{time.time() - started:.0f} | "
           f"{', '.join(crashes) or '-'} |")
    failed = resumed.returncode != 0 or crashes or end != STEPS or after < before
    return row, (f"cycle {number}: killed run\n{killed[-4000:]}\nresumed run\n{output[-8000:]}" if failed else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0, help="of the kill moments")
    parser.add_argument("--work", default=None, help="folder for the cycles' runs and logs (default: a temporary "
                        "one, removed)")
    args = parser.parse_args()
    rng, failures = random.Random(args.seed), []
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work or temporary
        print("| cycle | committed step at the kill -> after | inside a save | resume exit | resumed to step | "
              "resume s | native crash |\n|---|---|---|---|---|---|---|", flush=True)
        for number in range(1, args.cycles + 1):
            row, failure = cycle(number, os.path.join(work, f"cycle{number:03d}"), rng)
            print(row, flush=True)
            if failure:
                failures.append(failure)
    print(f"\n{args.cycles} cycles, {len(failures)} failed (glibc's debug malloc, MALLOC_CHECK_=3, "
          "PYTHONMALLOC=malloc, PYTHONFAULTHANDLER=1)")
    for failure in failures:
        print("\n" + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
