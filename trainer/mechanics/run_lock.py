"""One run at a time in a run's folders: a second run started into the --out_dir or --save_dir of one still
running is refused in one line naming it, before it writes anything (two runs there overwrite each other's saves
and interleave their metrics).

Rank 0 holds a POSIX lock (fcntl.lockf) on a file in each folder while its process lives. The kernel releases it
when the process ends in any way, SIGKILL included, so a killed run never leaves a folder locked; the lock is a
record lock, which NFS and other shared filesystems hold across machines. Where the system has no fcntl (native
Windows), runs are not locked.
"""
import os

import torch
import torch.distributed as dist

from model.errors import UserError

LOCK_NAME = ".minisd3_run.lock"  # in each folder; its text: the holder's pid and host


class RunFolders:
    """The lock files rank 0 holds open (and locked) for the run: released when this object is collected or its
    process ends."""

    def __init__(self, files):
        self.files = files


def lock_file(folder):
    """Lock `folder`'s lock file (created with the folder if need be) -> the open file, or an error line naming the
    run that holds it."""
    import fcntl

    os.makedirs(folder, exist_ok=True)
    handle = open(os.path.join(folder, LOCK_NAME), "a+", encoding="utf-8")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "pid unknown"
        handle.close()
        return f"another run ({holder}) is writing into {folder}: wait for it to end or stop it, or give this run " \
            "another --out_dir and --save_dir"
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename if hasattr(os, 'uname') else 'this host'}")
    handle.flush()
    return handle


def hold_run_folders(folders, info):
    """Rank 0 locks each of `folders` (the run's --out_dir and --save_dir) for as long as its process runs; a folder
    another live run holds stops every process with one line -> RunFolders, which the stage keeps."""
    files, error = [], None
    try:
        import fcntl  # noqa: F401  (POSIX only)
    except ImportError:
        return RunFolders(files)
    if info.is_main:
        for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
            held = lock_file(folder)
            if isinstance(held, str):
                error = held
                break
            files.append(held)
    if info.world_size > 1:  # every process learns rank 0's outcome
        failed = torch.tensor([error is not None], dtype=torch.float64, device=info.device)
        dist.broadcast(failed, 0)
        if failed.item() and error is None:
            error = "rank 0 found the run's folders in use by another run (its error is above)"
    if error is not None:
        for handle in files:
            handle.close()
        raise UserError(error)
    return RunFolders(files)
