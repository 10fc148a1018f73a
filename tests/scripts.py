"""Running the project's real scripts from tests: one thread per process, from the repo root; or a stage script's
main() in the test's own process, with its data replaced or watched and its log collected."""
import functools
import json
import os
import subprocess
import sys
import tempfile

import dataset.training_data
from model.errors import run_main
from trainer.mechanics.metrics import MetricsLog

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# faulthandler: a script that dies of a signal (a crash in native code) prints every thread's Python stack; the C
# library's fatal messages ("double free or corruption") go to stderr, not to a terminal the test has not got
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "LIBC_FATAL_STDERR_": "1"}
# the first lines of a native crash, which the stacks faulthandler prints after them push out of an output's tail
CRASH_MARKS = ("Fatal Python error", "double free", "corruption", "free(): ", "malloc(): ", "Segmentation fault")


def command(args, torchrun=0, torchrun_args=()):
    """The command line of a script (`args[0]`): plain python, or torchrun with `torchrun` processes per node
    (--standalone unless `torchrun_args` say where the nodes meet: a free port of its own, so that runs of several
    test workers do not meet at torchrun's default one)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", *(torchrun_args or ["--standalone"]),
                "--nproc_per_node", str(torchrun)] if torchrun else [sys.executable]
    return launcher + list(args)


def run(args, torchrun=0, check=True):
    """Run a script to its end; -> the result (an AssertionError with its output if it failed and `check`)."""
    result = subprocess.run(command(args, torchrun), cwd=REPO, capture_output=True, text=True, env=ENV, timeout=600)
    if check and result.returncode != 0:
        crash = [line for line in result.stderr.splitlines() if any(mark in line for mark in CRASH_MARKS)]
        raise AssertionError(f"{args[0]} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}" + "".join(f"\ncrash: {line}" for line in crash[:20]))
    return result


def run_many(stage, runs, torchrun=2, captured=False):
    """Run stage module `stage`'s main() (e.g. "trainer.train_pretrain") once per argument list of `runs`, one
    after the other in the same `torchrun` processes (tests/stage_runs.py): one launch, not one a run. `captured`:
    torch.compile with its eager backend (Dynamo's capture, eager kernels)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "runs.json")
        with open(path, "w") as f:
            json.dump([list(argv) for argv in runs], f)
        return run(["tests/stage_runs.py", stage, path] + (["--captured"] if captured else []), torchrun=torchrun)


def run_outputs(stdout):
    """What each run of a run_many launch printed, in its order (a copy prints nothing): from the first line that
    starts it (every process prints "stage_runs: <stage> <arguments>" as it starts a run; the other processes'
    lines of the same run are left out) to the first that starts the next. A process's last lines of a run may
    fall after another process's start of the next, so an assertion can only miss them, never find another run's;
    what a run prints before its first step falls in its own part (no process starts the next run before every
    process has trained this one). Two runs of the same arguments one after the other read as one."""
    parts, current = [], None
    for line in stdout.splitlines(keepends=True):
        if line.startswith("stage_runs: "):
            if line != current:
                current = line
                parts.append("")
        elif parts:
            parts[-1] += line
    return parts


def run_here(module, argv, capsys, threads=None):
    """Run script `module`'s main(argv) in this process, where a test needs no process of its own (no signal,
    kill, torchrun or exit code to see): what `run` returns, from what it printed, without the seconds of imports
    a fresh process pays. An exception fails the test, as a failed run does. `threads=1`: on one thread, as the
    processes `run` starts compute, where the run must match theirs bit for bit."""
    import torch

    capsys.readouterr()  # what was printed before is not the script's
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        module.main(list(argv))
    finally:
        torch.set_num_threads(before)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, 0, out, err)


def run_script_here(module, argv, capsys):
    """Script `module`'s command line `argv` run in this process as its `__main__` runs it (model.errors.run_main:
    a UserError one line on stderr, exit code 2; argparse's errors exit 2 too) -> what `run` returns: the exit code
    and what it printed. For the one-line errors of bad input, without a process start each. What only a process
    of its own would show is not seen here: a warning (pytest collects them), a write to the file descriptor
    itself, a warning printed at import; every script keeps one such test in a process of its own."""
    capsys.readouterr()  # what was printed before is not the script's
    try:
        run_main(functools.partial(module.main, list(argv)))
        code = 0
    except SystemExit as e:  # as the interpreter exits: None is 0, a message is printed and is 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def run_in_process(module, argv, monkeypatch, build_dataset=None):
    """Run a stage script's main() here -> (what it returned, the messages it logged). `build_dataset`, if given,
    replaces the builder of its datasets (dataset/image_folder.build_dataset's arguments)."""
    messages = []
    monkeypatch.setattr(MetricsLog, "log", lambda metrics, msg: messages.append(msg))
    if build_dataset is not None:
        monkeypatch.setattr(dataset.training_data, "build_dataset", build_dataset)
    return module.main(list(argv)), messages
