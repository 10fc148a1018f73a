"""Running the project's real scripts from tests: one thread per process, from the repo root; or a stage script's
main() in the test's own process, with its data replaced or watched and its log collected."""
import json
import os
import subprocess
import sys
import tempfile

import dataset.training_data
from trainer.mechanics.metrics import MetricsLog

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# faulthandler: a script that dies of a signal (a crash in native code) prints every thread's Python stack
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


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
        raise AssertionError(f"{args[0]} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
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


def run_in_process(module, argv, monkeypatch, build_dataset=None):
    """Run a stage script's main() here -> (what it returned, the messages it logged). `build_dataset`, if given,
    replaces the builder of its datasets (dataset/image_folder.build_dataset's arguments)."""
    messages = []
    monkeypatch.setattr(MetricsLog, "log", lambda metrics, msg: messages.append(msg))
    if build_dataset is not None:
        monkeypatch.setattr(dataset.training_data, "build_dataset", build_dataset)
    return module.main(list(argv)), messages
