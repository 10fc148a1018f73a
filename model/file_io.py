"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one. And verified
safetensors writes (read back and compared), for checkpoints and LoRA files; the feature cache compares its
shards with the same tensors_equal. Writes and read-backs go a tensor at a time: a save holds what it saves plus
about one tensor, never a second copy of the whole state."""
import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import tempfile

import torch
from safetensors import safe_open

# safetensors' names of the dtypes it stores (its format: 8 bytes of header length, a JSON header, the raw data)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}
MADV_DONTNEED = 4  # Linux


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


def inner_tensors(tensor):
    """The tensors a tensor subclass is made of (torchao's 8-bit optimizer state: codes, scales, code map; a
    DTensor: its local part), or None for a plain tensor or parameter."""
    if not hasattr(tensor, "__tensor_flatten__") or isinstance(tensor, torch.nn.Parameter):
        return None
    return [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]


def tensors_equal(a, b):
    """Same dtype, shape and values (NaNs in the same places count as equal). A tensor subclass made of inner
    tensors (torchao's 8-bit optimizer state: codes and scales) compares by its inner tensors."""
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if hasattr(a, "__tensor_flatten__") and not isinstance(a, torch.nn.Parameter):
        names, context = a.__tensor_flatten__()
        return type(b) is type(a) and b.__tensor_flatten__() == (names, context) and \
            all(tensors_equal(getattr(a, name), getattr(b, name)) for name in names)
    b = b.to(a.device)  # a state on the GPU against its read-back copy: one tensor at a time
    if torch.equal(a, b):  # no copies; only where NaNs make them differ are they masked
        return True
    if a.is_floating_point():
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
    return torch.equal(a, b)


def write_safetensors(path, tensors, metadata=None, float_dtype=None, cast=False):
    """Write a tensor at a time, read back a tensor at a time and compare bytes; -> the manifest entry.
    `float_dtype`: the dtype the file declares, which every floating-point tensor must have (no silent fp32/bf16
    mix), or, with `cast`, which each is cast to as it is written (one cast copy at a time)."""
    if not tensors:
        raise RuntimeError(f"refusing to write an empty state dict to {path}")
    mixed = sorted(k for k, v in tensors.items() if float_dtype and not cast and v.is_floating_point() and
                   v.dtype != float_dtype)
    if mixed:
        raise RuntimeError(f"refusing to write {path}: {mixed[0]} is {tensors[mixed[0]].dtype}, not the declared "
                           f"{float_dtype} ({len(mixed)} such tensors)")
    cast_to = float_dtype if cast else None
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(safetensors_header(tensors, metadata, cast_to))
            for tensor in tensors.values():
                write_bytes(f, stored(tensor, cast_to))
    bad = read_back_difference(path, tensors, metadata, cast_to)
    if bad is not None:
        raise RuntimeError(f"{path} read back with a different {bad}")
    return file_entry(path)


def stored(tensor, float_dtype=None):
    """What a file holds of `tensor`: on the CPU, contiguous, a floating-point one cast to `float_dtype` if given."""
    if float_dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(float_dtype)
    return tensor.detach().contiguous().cpu()


def raw_bytes(tensor):
    """A contiguous CPU tensor's bytes, as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def write_bytes(f, tensor):
    f.write(memoryview(raw_bytes(tensor).numpy()))


def safetensors_header(tensors, metadata, float_dtype=None):
    """The safetensors header of `tensors` (each floating-point one as `float_dtype` if given), with its length in
    front: what comes before the data."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        dtype = float_dtype if float_dtype is not None and tensor.is_floating_point() else tensor.dtype
        size = tensor.numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts on 8 bytes, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def read_back_difference(path, tensors, metadata, float_dtype=None):
    """The first name whose dtype, shape or bytes in the file at `path` differ from what `tensors` meant (read a
    tensor at a time, through the page cache, not mapped into this process), or None. The names and metadata are
    also read by safetensors itself: the file is one its readers open."""
    with safe_open(path, framework="pt") as f:
        if set(f.keys()) != set(tensors) or (f.metadata() or {}) != (metadata or {}):
            return "set of names or metadata"
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header, start = json.loads(f.read(length)), 8 + length
        for name, tensor in tensors.items():
            expected, entry = stored(tensor, float_dtype), header[name]
            if entry["dtype"] != SAFETENSORS_DTYPES[expected.dtype] or entry["shape"] != list(expected.shape):
                return name
            begin, end = entry["data_offsets"]
            back = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(start + begin)
            if f.readinto(memoryview(back.numpy())) != end - begin or not torch.equal(back, raw_bytes(expected)):
                return name
    return None


def mapped_ranges(prefix):
    """The address ranges where this process maps files whose path starts with `prefix` (Linux: /proc/self/maps;
    elsewhere none): the only memory drop_pages touches."""
    ranges, prefix = [], os.path.abspath(prefix)
    with contextlib.suppress(OSError):
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip().startswith(prefix):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    return ranges


def drop_pages(tensor, ranges):
    """Hand the pages of a memory-mapped file under `tensor` (a read-back copy, compared and done with; or a resume
    file's, copied into the run's own) back to the kernel: they would count as this process's memory until the
    whole file is unmapped. Only whole pages inside the tensor's storage and inside `ranges` (mapped_ranges: the
    file's mappings, never other memory); the tensor still reads the same, from the file (the pages are clean)."""
    if not ranges or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return
    inner = inner_tensors(tensor)  # 8-bit state, DTensor
    if inner is not None:
        for part in inner:
            drop_pages(part, ranges)
        return
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (storage.data_ptr() + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and any(low <= start and end <= high for low, high in ranges):
        release_pages(start, end - start)


def release_pages(start, length):
    """madvise(MADV_DONTNEED) through the C library: where there is none to call (Windows has no madvise, nor
    CDLL(None)), the pages stay mapped until the file is unmapped, which costs memory, not correctness."""
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_DONTNEED)
    except (OSError, AttributeError, TypeError):
        pass
