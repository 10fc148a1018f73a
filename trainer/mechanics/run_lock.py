"""One run at a time under a run's name: a second run started while one runs, with the same name (stage and preset,
or --lora_name) into the same --out_dir or --save_dir, is refused in one line naming the first, before it writes
there: the stages take the lock after their set-up, just before their outputs (two such runs overwrite each
other's saves and interleave their metrics). Runs of other names share the folders freely.

Rank 0 holds a POSIX lock (fcntl.lockf) on `<name>.lock` in each folder while its process lives, and removes the
file when it lets go. The kernel releases the lock when the process ends in any way, SIGKILL included, so a
killed run never leaves its folders locked (a file it leaves behind locks nothing); it is a record lock, which
NFS and other shared filesystems hold across machines. Where the system has no fcntl (native Windows), runs are
not locked; nor where a filesystem takes no locks (NFSv3 without lockd, some FUSE mounts), which a warning says.
The lock belongs to the process: within one process (a stage's main() called twice, as tests do) a second run of
the name is not stopped.
"""
import errno
import os
import sys
import weakref

from model.errors import UserError
from trainer.mechanics.distributed import any_process


class RunFolders:
    """The lock files rank 0 holds open and locked for the run: closed and removed when this object is collected
    (the stage keeps it to its end) or the interpreter exits."""

    def __init__(self, files):
        self.files = files
        weakref.finalize(self, let_go, files)


def let_go(files):
    for handle in files:
        try:
            os.remove(handle.name)  # before the close: whoever locks it next makes a new file (lock_file's check)
        except OSError:
            pass
        handle.close()


def lock_file(path, name, fcntl):
    """Lock the file `path` of run `name` (made, with its folder, if need be) with the `fcntl` module -> the open
    file; an error line naming the run that holds it, or saying why the folder cannot take it; or None where its
    filesystem takes no locks (said on stderr: the run goes on unlocked)."""
    folder = os.path.dirname(path)
    while True:
        try:
            os.makedirs(folder, exist_ok=True)
            handle = open(path, "a+", encoding="utf-8")
        except OSError as e:
            return f"cannot write into {folder}: {e.strerror or e}; pass a --out_dir and --save_dir this user can write"
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):  # another process holds it
                handle.seek(0)
                holder = handle.read().strip() or "pid unknown"
                handle.close()
                return f"another run ({holder}) is writing {name} into {folder}: wait for it to end or stop it, " \
                    "or give this run another --out_dir and --save_dir"
            handle.close()
            print(f"warning: {folder} takes no file locks ({e.strerror}): a second run of {name} started there "
                  "would not be stopped", file=sys.stderr)
            return None
        try:
            current = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:  # not a file its last holder removed as this one opened it
            break
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}")
    handle.flush()
    return handle


def hold_run_folders(folders, name, info):
    """Rank 0 locks run `name` in each of `folders` (the run's --out_dir and --save_dir) for as long as its process
    runs; where another live run holds it, every process stops with one line -> RunFolders, which the stage keeps."""
    files, error = [], None
    try:
        import fcntl  # POSIX only
    except ImportError:
        return RunFolders(files)
    if info.is_main:
        for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
            held = lock_file(os.path.join(folder, f"{name}.lock"), name, fcntl)
            if isinstance(held, str):
                error = held
                break
            files += [held] if held is not None else []
    if any_process(error is not None, info) and error is None:  # every process learns rank 0's outcome
        error = "rank 0 found the run's folders in use by another run (its error is above)"
    if error is not None:
        let_go(files)
        raise UserError(error)
    return RunFolders(files)
