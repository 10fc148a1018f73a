"""Running the project's real scripts from tests: one thread per process, from the repo root."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(args, torchrun=0, check=True):
    """Run a script (`args[0]`) with plain python, or under torchrun with `torchrun` processes; -> the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun)] if torchrun \
        else [sys.executable]
    result = subprocess.run(cmd + args, cwd=REPO, capture_output=True, text=True, env=ENV, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result
