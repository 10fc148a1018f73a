"""The tensors of a sharded run's resume checkpoint, written with torch.distributed.checkpoint (DCP): each process
writes its own shards, so no process ever holds the whole optimizer state.

    checkpoints/pretrain_base_resume.json                           the manifest, written last by rank 0
    checkpoints/pretrain_base_resume.step00000200.pt                step, data position, random streams, settings
    checkpoints/pretrain_base_resume.step00000200.dcp/__0_0.distcp  rank 0's shards (weights, AdamW, EMA)
    checkpoints/pretrain_base_resume.step00000200.dcp/__1_0.distcp  rank 1's shards ...
    checkpoints/pretrain_base_resume.step00000200.dcp/.metadata     where every shard lies

Only tensors go to DCP; everything else (numbers, settings, the optimizer's hyperparameters) stays in the .pt,
which is read with weights_only=True. DCP's .metadata is a pickle: it is read with an unpickler that builds
DCP's own metadata classes and nothing else. The commit is model/checkpoint.py's: the shard files are written,
read back, compared and hashed on every rank, and only then does rank 0 write the manifest naming them all.
Loading reshards: the shards are read into the layout the run has now (other process counts, FSDP or not).
"""
import math
import os
import pickle
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageMeta
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from model.checkpoint import DISK_ERRORS, CheckpointError, SaveError, save_failed, state_bytes, stem_of
from model.file_io import file_entry, tensors_equal
from trainer.mechanics.state import chunk_of, fresh_like, leaves, map_leaves

MARK = "__dcp__"  # {MARK: name} stands in the resume file for a tensor kept in the shards
VERIFY_BYTES = 1 << 28  # read back at most this many bytes (256 MiB) per process at a time


def tensor_name(path):
    return "/".join(str(key) for key in path)


def split_tensors(tree):
    """-> (the tree with each tensor replaced by {MARK: its name}, {name: tensor})."""
    tensors = {tensor_name(path): tensor for path, tensor in leaves(tree).items()}
    return map_leaves(tree, lambda path, tensor: {MARK: tensor_name(path)}), tensors


def join_tensors(tree, tensors):
    """The inverse of split_tensors: each {MARK: name} replaced by tensors[name]."""
    if isinstance(tree, dict):
        if set(tree) == {MARK}:
            return tensors[tree[MARK]]
        return {k: join_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(join_tensors(v, tensors) for v in tree)
    return tree


def marked_names(tree):
    if isinstance(tree, dict):
        return {tree[MARK]} if set(tree) == {MARK} else set().union(*map(marked_names, tree.values()))
    if isinstance(tree, (list, tuple)):
        return set().union(*map(marked_names, tree))
    return set()


# ----------------------------------------------------------------------------------------------------------------
# Writing


def write_shards(folder, tensors, info):
    """Every rank writes its shards of `tensors` into `folder` (rank 0 also DCP's metadata), reads them back and
    compares, and hashes its own files. -> on rank 0, the manifest entries of every file, named relative to the
    folder's parent ({} on the others). A failure on any rank raises on every rank, before anything is committed."""
    entries, error, disk = {}, None, None
    try:
        os.makedirs(folder, exist_ok=True)
        dcp.save(tensors, storage_writer=FileSystemWriter(folder))
        verify_shards(folder, tensors, info.world_size)
        own = [n for n in os.listdir(folder) if n.startswith(f"__{info.rank}_") or (info.is_main and n == ".metadata")]
        entries = {name: file_entry(os.path.join(folder, name)) for name in own}
    except (OSError, RuntimeError, ValueError, CheckpointException) as e:
        error = f"rank {info.rank}: {one_line(e)}"
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        if isinstance(cause, OSError) and cause.errno in DISK_ERRORS:  # the disk's fault
            disk = (cause.errno, cause.strerror or str(cause))
    reports = [(entries, error, disk)]
    if info.world_size > 1:
        reports = [None] * info.world_size
        dist.all_gather_object(reports, (entries, error, disk))
    disks = [disk for _, _, disk in reports if disk]
    errors = [error for _, error, _ in reports if error]
    if disks or errors:
        needed = state_bytes(tensors) * info.world_size  # each rank counts its own shards
        cause = OSError(*disks[0]) if disks else RuntimeError(f"writing the shards of {folder} failed: "
                                                              f"{'; '.join(errors)}")
        raise SaveError(save_failed(stem_of(folder), cause, needed))
    if not info.is_main:
        return {}
    entries = {name: entry for own, _, _ in reports for name, entry in own.items()}
    for name in set(os.listdir(folder)) - set(entries):  # a file no rank claimed (DCP named it otherwise): hash it
        entries[name] = file_entry(os.path.join(folder, name))
    base = os.path.basename(folder)
    return {f"{base}/{name}": entry for name, entry in sorted(entries.items())}


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def verify_shards(folder, tensors, world):
    """Read the shards back into fresh tensors, at most VERIFY_BYTES per process at a time, and compare with what
    was meant to be written (this process's part of each tensor). The chunks are the same on every rank, and a
    rank that finds a difference reads on to the end, so that every rank makes the same collective calls."""
    chunk, size, bad = [], 0, None
    names = sorted(tensors)
    for i, name in enumerate(names):
        chunk.append(name)
        size += tensors[name].numel() * tensors[name].element_size() // world
        if size >= VERIFY_BYTES or i == len(names) - 1:
            back = {n: fresh_like(tensors[n]) for n in chunk}
            dcp.load(back, storage_reader=SafeReader(folder))
            bad = bad or next((n for n in chunk if not tensors_equal(local(tensors[n]), local(back[n]))), None)
            chunk, size = [], 0
    if bad is not None:
        raise RuntimeError(f"{folder} read back with a different {bad}")


# ----------------------------------------------------------------------------------------------------------------
# Reading


def read_shards(folder, saved, current, where):
    """The saved tree (tensors marked) with its tensors read from `folder` straight into `current`'s tensors (the
    run's own state dicts, in the run's layout: DCP reshards). Strict: the shards must hold exactly the tensors
    the run has, else a one-line error naming the ones that differ."""
    wanted = {tensor_name(path): tensor for path, tensor in leaves(current).items()}
    stored = marked_names(saved)
    missing, unexpected = sorted(set(wanted) - stored), sorted(stored - set(wanted))
    if missing or unexpected:
        parts = [f"{label}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)})"
                 for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise CheckpointError(f"{where} does not fit this run; " + "; ".join(parts))
    try:
        targets = read_targets(wanted, SafeReader(folder).read_metadata().state_dict_metadata)
        with warnings.catch_warnings():  # one process reading every shard is meant: DCP warns of it
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=SafeReader(folder), no_dist=not dist.is_initialized())
    except (CheckpointException, OSError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"cannot read the shards in {folder}: {one_line(e)}") from None
    for name, target in targets.items():
        if target is not wanted[name]:  # read as fp32: requantised into the run's 8-bit state
            local(wanted[name]).copy_(local(target))
    return join_tensors(saved, wanted)


def read_targets(wanted, stored):
    """-> {name: what DCP reads into}: the run's own tensor, or, for a tensor subclass (torchao's 8-bit optimizer
    state) that DCP would have to cut off its 256-value blocks (another number of processes, a shard of rows that
    does not end on a block), an fp32 tensor of its layout, whose values the state then requantises. `stored`:
    the shards' metadata, {name: its chunks}."""
    targets = {}
    for name, tensor in wanted.items():
        targets[name] = tensor
        if is_traceable_wrapper_subclass(local(tensor)) and not cut_on_blocks(tensor, stored[name].chunks):
            values = torch.empty(local(tensor).shape, dtype=torch.float32, device=local(tensor).device)
            targets[name] = DTensor.from_local(values, tensor.device_mesh, tensor.placements, run_check=False,
                                               shape=tensor.shape, stride=tensor.stride()) \
                if isinstance(tensor, DTensor) else values
    return targets


def cut_on_blocks(tensor, chunks, block=256):
    """Whether every piece DCP reads into this process's part of `tensor` from the saved `chunks` (row ranges)
    begins and ends on a block of `block` values, in the part and in the chunk alike."""
    (start, *_), (rows, *rest) = chunk_of(tensor)
    row, end = math.prod(rest), start + rows
    for chunk in chunks:
        first, last = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
        low, high = max(start, first), min(end, last)
        if low < high and any(x * row % block for x in (low - start, high - start, low - first, high - first)):
            return False
    return True



def one_line(error):
    """A DCP failure (it wraps each rank's exception) or any other error, as one short line."""
    if isinstance(error, CheckpointException):
        error = next(iter(error.failures.values()))[0]
    return " ".join(str(error).split())[:300] or type(error).__name__


class MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes (and torch sizes, dtypes and layouts, and paths): a .metadata file that
    asks for anything else is refused instead of run."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if module in self.MODULES:
            found = getattr(sys.modules.get(module), name, None)
            if found is not None and getattr(found, "__module__", None) == module:  # defined there, not imported
                return found
        elif (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the shard metadata asks for {module}.{name}, which is not checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading .metadata with MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
