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
import json
import os
import re
import shutil

import torch
from safetensors import safe_open

from model.errors import UserError
from model.file_io import atomic_path, atomic_write_text, file_entry, sha256_of, tensors_equal, write_safetensors


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


def first_difference(expected, found, where="state"):
    """The path of the first place where two nested dicts/lists/tensors differ, or None."""
    if isinstance(expected, torch.Tensor):
        return None if tensors_equal(expected, found) else where
    if isinstance(expected, dict):
        if not isinstance(found, dict) or set(expected) != set(found):
            return f"{where} (keys)"
        return next((d for k in expected if (d := first_difference(expected[k], found[k], f"{where}[{k!r}]"))), None)
    if isinstance(expected, (list, tuple)):
        if not isinstance(found, (list, tuple)) or len(expected) != len(found):
            return f"{where} (length)"
        return next((d for i, (e, f) in enumerate(zip(expected, found))
                     if (d := first_difference(e, f, f"{where}[{i}]"))), None)
    return None if expected == found else where


def write_torch(path, state):
    """torch.save, read back with weights_only=True (memory-mapped) and compare everything; -> the manifest entry."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    bad = first_difference(state, torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    if bad is not None:
        raise RuntimeError(f"{path} read back with a different {bad}")
    return file_entry(path)


def save_checkpoint(stem, step, record, parts, written=None, float_dtype=None):
    """Write `parts` ({suffix: state}: tensors for a '.safetensors' suffix, any weights-only state for '.pt') as
    this step's files, verify them, then commit the manifest (`record` + the files' sizes and hashes, and the
    entries of files already `written` and verified by others: a sharded run's shard folder) and delete older
    files. `float_dtype`: the dtype of every floating-point tensor in the '.safetensors' part (the weights).
    -> total bytes written."""
    files = dict(written or {})
    for suffix, payload in parts.items():
        path = step_file(stem, step, suffix)
        if suffix.endswith(".safetensors"):
            declared = float_dtype if suffix == ".safetensors" else None
            entry = write_safetensors(path, payload, metadata={"step": str(step)}, float_dtype=declared)
        else:
            entry = write_torch(path, payload)
        files[os.path.basename(path)] = entry
    atomic_write_text(manifest_path(stem), json.dumps({**record, "step": step, "files": files}, indent=2) + "\n")
    remove_leftovers(stem)
    return sum(entry["bytes"] for entry in files.values())


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
