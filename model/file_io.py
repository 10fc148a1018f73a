"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one. And verified
safetensors writes (read back and compared), for checkpoints and LoRA files; the feature cache compares its
shards with the same tensors_equal."""
import contextlib
import hashlib
import json
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file


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


def json_digest(obj):
    """The sha256 of a JSON-able object (keys sorted): a stable name for what it describes."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def sha256_of(path, chunk=1 << 22):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entry(path):
    """A written file as a manifest names it: its size and sha256."""
    return {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}


def tensors_equal(a, b):
    """Same dtype, shape and values (NaNs in the same places count as equal). A tensor subclass made of inner
    tensors (torchao's 8-bit optimizer state: codes and scales) compares by its inner tensors."""
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if hasattr(a, "__tensor_flatten__") and not isinstance(a, torch.nn.Parameter):
        names, context = a.__tensor_flatten__()
        return type(b) is type(a) and b.__tensor_flatten__() == (names, context) and \
            all(tensors_equal(getattr(a, name), getattr(b, name)) for name in names)
    if a.is_floating_point():
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
    return torch.equal(a, b)


def write_safetensors(path, tensors, metadata=None, float_dtype=None):
    """Write, read back (memory-mapped) and compare every tensor; -> the manifest entry. `float_dtype`: the dtype
    the file declares, which every floating-point tensor must have (no silent fp32/bf16 mix)."""
    if not tensors:
        raise RuntimeError(f"refusing to write an empty state dict to {path}")
    mixed = sorted(k for k, v in tensors.items() if float_dtype and v.is_floating_point() and v.dtype != float_dtype)
    if mixed:
        raise RuntimeError(f"refusing to write {path}: {mixed[0]} is {tensors[mixed[0]].dtype}, not the declared "
                           f"{float_dtype} ({len(mixed)} such tensors)")
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    with safe_open(path, framework="pt") as f:
        if set(f.keys()) != set(tensors):
            raise RuntimeError(f"{path} read back with other keys than were written")
        bad = next((k for k in tensors if not tensors_equal(tensors[k], f.get_tensor(k))), None)
    if bad is not None:
        raise RuntimeError(f"{path} read back with a different {bad}")
    return file_entry(path)
