"""Checkpoints that cannot lie: verified, atomic, committed by a manifest.

A save is a set of files under one stem, e.g. out/pretrain_tiny:

    out/pretrain_tiny.json                                the manifest: a record, plus every file's size and sha256
    out/pretrain_tiny.step00000200.safetensors            the files, named by step
    out/pretrain_tiny.step00000200.components.safetensors

Saving writes the new step's files beside the old ones (each through a temp file, fsync and rename), reads
each one back and checks it against what was meant to be written, and only then replaces the manifest, in one
atomic rename: that is the commit. The previous step's files are deleted after it. A process killed at any
moment therefore leaves the last committed save whole, and the next start deletes what the dead one left
behind. Loading checks sizes and hashes against the manifest first, so a truncated or edited file is a
one-line error instead of a crash deep in torch, and reads torch files with `weights_only=True` only.
"""
import errno
import json
import os
import re
import shutil

import torch
from safetensors import safe_open

from model.errors import UserError
from model.file_io import (
    atomic_path, atomic_write_text, drop_pages, file_entry, inner_tensors, mapped_ranges, sha256_of, tensors_equal,
    write_safetensors,
)


class CheckpointError(UserError):
    """A checkpoint that is missing, of the wrong kind, truncated or altered: the message is one line."""


def manifest_path(stem):
    return stem + ".json"


def stem_of(path):
    """The stem a user's path means: it may name the manifest (x.json), one of its files (x.step00000200.pt)
    or the stem itself."""
    return re.sub(r"(\.step\d+\..+|\.json)$", "", path)


def step_file(stem, step, suffix):
    return f"{stem}.step{step:08d}{suffix}"


def first_difference(expected, found, where="state", mapped=()):
    """The path of the first place where two nested dicts/lists/tensors differ, or None. `mapped`: the address
    ranges `found` is memory-mapped from (file_io.mapped_ranges), whose pages under each tensor are let go once
    it is compared (file_io.drop_pages)."""
    if isinstance(expected, torch.Tensor):
        same = tensors_equal(expected, found)
        if mapped and isinstance(found, torch.Tensor):
            drop_pages(found, mapped)
        return None if same else where
    if isinstance(expected, dict):
        if not isinstance(found, dict) or set(expected) != set(found):
            return f"{where} (keys)"
        return next((d for k in expected if (d := first_difference(expected[k], found[k], f"{where}[{k!r}]", mapped))),
                    None)
    if isinstance(expected, (list, tuple)):
        if not isinstance(found, (list, tuple)) or len(expected) != len(found):
            return f"{where} (length)"
        return next((d for i, (e, f) in enumerate(zip(expected, found))
                     if (d := first_difference(e, f, f"{where}[{i}]", mapped))), None)
    return None if expected == found else where


def write_torch(path, state):
    """torch.save (a tensor at a time, from where each lies), read back with weights_only=True, memory-mapped, and
    compare everything, each tensor's pages let go once compared: the check never holds a second copy of the
    state. -> the manifest entry."""
    with atomic_path(path) as tmp:
        try:
            torch.save(state, tmp)
        except RuntimeError as e:
            if "inline_container" not in str(e) and "PytorchStreamWriter" not in str(e):
                raise  # not the writer's: named as it is
            # torch's file writer reports a write that fell short ("unexpected pos ..."), without the reason
            raise RuntimeError(f"the file was not written whole ({' '.join(str(e).split())[:120]})") from None
    back = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    bad = first_difference(state, back, mapped=mapped_ranges(path))
    if bad is not None:
        raise RuntimeError(f"{path} read back with a different {bad}")
    return file_entry(path)


def save_checkpoint(stem, step, record, parts, written=None, float_dtype=None, cast=False):
    """Write `parts` ({suffix: state}: tensors for a '.safetensors' suffix, any weights-only state for '.pt') as
    this step's files, verify them, then commit the manifest (`record` + the files' sizes and hashes, and the
    entries of files already `written` and verified by others: a sharded run's shard folder) and delete older
    files. `float_dtype`: the dtype of every floating-point tensor in the '.safetensors' part (the weights), which
    with `cast` they are cast to as they are written. A save that fails is a one-line SaveError naming the
    folder, what happened and the last committed checkpoint (`save_failed`). -> total bytes written."""
    files = dict(written or {})
    needed = sum(state_bytes(payload, float_dtype if cast and suffix == ".safetensors" else None)
                 for suffix, payload in parts.items())
    folder = os.path.dirname(os.path.abspath(stem))
    if os.path.isdir(folder) and shutil.disk_usage(folder).free < needed:  # the old files go only after the commit
        raise SaveError(save_failed(stem, OSError(errno.ENOSPC, "not enough free space"), needed))
    try:
        for suffix, payload in parts.items():
            path = step_file(stem, step, suffix)
            if suffix.endswith(".safetensors"):
                declared = float_dtype if suffix == ".safetensors" else None
                entry = write_safetensors(path, payload, {"step": str(step)}, declared, cast and bool(declared))
            else:
                entry = write_torch(path, payload)
            files[os.path.basename(path)] = entry
        atomic_write_text(manifest_path(stem), json.dumps({**record, "step": step, "files": files}, indent=2) + "\n")
    except (OSError, RuntimeError, ValueError) as e:  # a dead worker, a write cut short, a mismatch, the disk
        raise SaveError(save_failed(stem, e, needed)) from None
    remove_leftovers(stem)
    return sum(entry["bytes"] for entry in files.values())


class SaveError(UserError, RuntimeError):
    """A save that failed: the message is one line, naming what happened and what to resume from. (A RuntimeError
    too, as the failures it reports were before they were put in one line.)"""


# What the disk is to blame for: it is full, over quota, read-only or not writable
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def save_failed(stem, error, needed):
    """The line for a save under `stem` that failed with `error`, needing about `needed` bytes: the folder, what
    happened, the space there, and the last committed checkpoint (intact: a save commits only once verified); "make
    room" where the disk is to blame, else the error's own words (a worker that died, a write cut short, a file
    that read back otherwise)."""
    folder = os.path.dirname(os.path.abspath(stem))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    last = "nothing was committed under this name yet"
    try:
        with open(manifest_path(stem), encoding="utf-8") as f:
            last = f"the last committed one, step {json.load(f)['step']} ({manifest_path(stem)}), is intact"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    space = f"this save needs about {needed / 1e6:.0f} MB there ({free / 1e6:.0f} MB free)"
    what = error.strerror if isinstance(error, OSError) and error.strerror else " ".join(str(error).split())[:500]
    what = what or type(error).__name__
    disk = isinstance(error, OSError) and error.errno in DISK_ERRORS
    # torch's writer says only that a write fell short: where the disk has no room now, that was why
    if disk or os.path.isdir(folder) and free < needed:
        return (f"cannot save into {folder}: {what if disk else f'not enough free space ({what})'}; {space}; "
                f"{last}: make room (or pass another --save_dir / --out_dir) and continue with --from_resume 1")
    then = ": continue from it with --from_resume 1" if last.endswith("is intact") else ""
    return f"cannot save into {folder}: {what}; {space}; {last}{then}"


def state_bytes(state, float_dtype=None):
    """The bytes of every tensor in a nested state (a tensor subclass by its inner tensors; floating-point ones as
    `float_dtype` if given: what a file that casts them holds)."""
    if isinstance(state, torch.Tensor):
        inner = inner_tensors(state)
        if inner is not None:
            return sum(state_bytes(part) for part in inner if isinstance(part, torch.Tensor))
        dtype = float_dtype if float_dtype is not None and state.is_floating_point() else state.dtype
        return state.numel() * dtype.itemsize
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return sum(state_bytes(value, float_dtype) for value in values)


def read_manifest(stem, kind, share=(0, 1)):
    """-> the committed record of `stem`, its files checked (sizes, and sha256); one-line errors otherwise.
    `share` = (rank, processes): processes that read one checkpoint together each hash a share of its files."""
    path = manifest_path(stem)
    if not os.path.exists(path):
        raise CheckpointError(f"no {kind} checkpoint at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable manifest ({e})") from None
    if not isinstance(record, dict) or "files" not in record:
        raise CheckpointError(f"{path} is not a MiniSD3 checkpoint manifest (no file list); it may come from an "
                              "older version: retrain, or point at the right file")
    if record.get("kind") != kind:
        raise CheckpointError(f"{path} is a {record.get('kind', 'unknown')} checkpoint, not a {kind} checkpoint")
    directory = os.path.dirname(path)
    for i, (name, entry) in enumerate(sorted(record["files"].items())):
        file = os.path.join(directory, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}, named by {path}, is missing")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            raise CheckpointError(f"{file} has {size} bytes but its manifest says {entry['bytes']}: it was "
                                  "truncated or replaced")
        if i % share[1] == share[0] and sha256_of(file) != entry["sha256"]:
            raise CheckpointError(f"{file} does not match the sha256 in {path}: it was altered or corrupted")
    return record


def checkpoint_file(stem, record, suffix):
    return step_file(stem, record["step"], suffix)


def load_torch(path):
    """A resume file, weights_only: a file holding pickled objects is refused (one line). Memory-mapped: its
    tensors are read as they are used (copied into the run's own), never the whole file at once."""
    try:
        allow_optimizer_states(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except UserError:
        raise
    except Exception as e:  # a pickled object, or a foreign file
        raise CheckpointError(f"cannot read {path}: {str(e).splitlines()[0][:200]}") from None


def allow_optimizer_states(path):
    """A resume file of --optimizer adamw8bit holds torchao's 8-bit optimizer states, a tensor class that torchao
    lists as safe for weights_only loads once imported: imported here when the file needs it (and only then, it
    takes seconds), before any optimizer of the run exists."""
    if any(name.startswith("torchao.optim.") for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)):
        from model.precision import import_torchao

        import_torchao(f"{path} (8-bit optimizer state)")


def load_safetensors(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def remove_leftovers(stem):
    """Delete the files under `stem` that its manifest does not name: temp files of interrupted writes
    ('.tmp-<name>...') and step files (or shard folders) of older or uncommitted saves. Other files are never
    touched."""
    directory, base = os.path.split(stem)
    directory = directory or "."
    if not os.path.isdir(directory):
        return []
    keep = set()
    if os.path.exists(manifest_path(stem)):
        try:
            with open(manifest_path(stem), encoding="utf-8") as f:
                keep = {name.split("/")[0] for name in json.load(f).get("files", {})}  # a shard's folder
        except (OSError, ValueError, AttributeError):
            return []  # an unreadable manifest: leave everything for the user to look at
    ours = re.compile(re.escape(base) + r"\.step\d+\..+")
    removed = []
    for name in os.listdir(directory):
        if name.startswith(f".tmp-{base}") or (ours.fullmatch(name) and name not in keep):
            path = os.path.join(directory, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            removed.append(name)
    return removed
