"""Several runs of a stage script in the same processes, for tests: its main() once per argument list of a JSON
file, one after the other, each with a process group of its own (main sets it up, run_main tears it down) that
meets at a store of its own: process groups made again at torchrun's store find the keys of the earlier ones under
the same names (a hybrid-sharded run after others hung). A test that needs several runs of two processes
launches torchrun once for all, not once a run: a launch costs two processes' start-up (imports, the built-in
text encoder, kernels compiled), some 10 s of CPU each.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/stage_runs.py trainer.train_pretrain runs.json

An argument list `--copy SOURCE TARGET` copies run folder SOURCE to TARGET (rank 0, the others waiting until it is
there): a run after it resumes the copy, in the same launch as the run that wrote SOURCE.

With --captured, torch.compile runs with its "eager" backend (tests/conftest.compiled_as_captured): Dynamo
captures each graph as inductor would get it, and its kernels are eager ones, not compiled afresh by every rank.
"""
import functools
import importlib
import json
import os
import shutil
import socket
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.errors import run_main  # noqa: E402


def meet_at_a_new_store(agent, number):
    """Point env:// at a store of run `number`'s own: rank 0 picks a free port and tells the others through
    torchrun's store `agent`; rank 0's init_process_group then serves the store there."""
    if os.environ["RANK"] == "0":
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(f"stage_runs/{number}/port", str(s.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent.get(f"stage_runs/{number}/port").decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def copy_folder(agent, number, source, target):
    """Run folder `source` copied to `target` by rank 0 (or the only process); the other ranks wait for it."""
    if agent is None or os.environ["RANK"] == "0":
        shutil.copytree(source, target)
        if agent is not None:
            agent.set(f"stage_runs/{number}/copied", "1")
    else:
        agent.get(f"stage_runs/{number}/copied")  # (waits until rank 0 has set it)


if __name__ == "__main__":
    if "--captured" in sys.argv:
        import torch

        sys.argv.remove("--captured")
        torch.compile = functools.partial(torch.compile, backend="eager")
    stage = importlib.import_module(sys.argv[1])
    with open(sys.argv[2]) as f:
        runs = json.load(f)
    agent = None
    if "RANK" in os.environ:  # torchrun's store, where the ranks agree on each run's own
        import torch.distributed as dist

        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(minutes=5))
    for number, argv in enumerate(runs):
        if argv[0] == "--copy":
            copy_folder(agent, number, *argv[1:])
            continue
        print(f"stage_runs: {sys.argv[1]} {' '.join(argv)}", flush=True)
        if agent is not None:
            meet_at_a_new_store(agent, number)
        run_main(functools.partial(stage.main, argv))
