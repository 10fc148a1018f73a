"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one."""
import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temp path next to `path`; on success fsync it and os.replace it over `path`.

    The temp file lives in the same directory so os.replace is a rename on one filesystem, and its name
    starts with '.tmp-' so a crashed writer's leftovers are easy to recognise and never mistaken for the file.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=directory)
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes files private (0600): give it a normal file's permissions
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    # Make the rename itself durable (a power cut after os.replace must not bring the old name back).
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_text(path, text):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
