"""An on-disk cache of per-sample features (VAE latents, text embeddings): computed once, read back memory-mapped.

The module knows nothing about models: build_cache is given a fingerprint (a JSON-able dict naming everything the
features depend on) and an `encode` function, and stores exactly the tensors `encode` returns. A cache folder:

    cache/index.json                  the commit: fingerprint, sample count, shard size, each shard's size
    cache/shard_00000.safetensors     samples [0, shard_size): tensors "<sample>.<key>", e.g. "17.latents"
    cache/shard_00001.safetensors     samples [shard_size, 2 * shard_size), ...
    cache/building.json               only while a build is under way: the fingerprint being built

Every file is written through a temp file, fsync and rename, so a shard that exists is complete, and each shard is
read back and compared with what was meant to be written. index.json is written last and only after every shard
exists: an index always describes a whole cache. A cache whose fingerprint changed loses its index before any
shard is touched. A build killed at any moment resumes: shards that hold exactly their samples and carry the
fingerprint's hash are kept, only the others are encoded. Shard k is built by rank k % world_size.
"""
import json
import math
import operator
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm

from model.errors import UserError
from model.file_io import atomic_write_text, json_digest, write_safetensors

FORMAT = 1
INDEX = "index.json"
BUILDING = "building.json"
SHARD_PATTERN = re.compile(r"shard_\d{5,}\.safetensors")
# Temp files of our own writes only (model.file_io names them '.tmp-<name>.<random>'): other files are never touched.
TEMP_PATTERN = re.compile(r"\.tmp-(shard_\d{5,}\.safetensors|index\.json|building\.json)\..*")


class CacheError(UserError):
    """A cache that cannot be built or read (wrong features from `encode`, a missing shard): the message is one
    line."""


def shard_name(k):
    return f"shard_{k:05d}.safetensors"


def describe_changes(old, new):
    """The top-level keys of two fingerprints that were added, removed or changed, sorted."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ["fingerprint"]
    return sorted(k for k in set(old) | set(new) if k not in old or k not in new or old[k] != new[k])


def cache_size_bytes(folder):
    """Bytes in the shard files of `folder` (0 if there is none)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return 0
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
               if SHARD_PATTERN.fullmatch(name))


@dataclass(frozen=True)
class CacheLayout:
    """How a cache is written: samples a shard, samples an encode call takes at most (all from one shard), and
    whether rank 0 shows a progress bar."""
    shard_size: int = 256
    encode_batch: int = 16
    progress: bool = True


@dataclass(frozen=True)
class Processes:
    """The processes that build a cache together: this one's rank, how many they are, and the barrier they wait at
    (e.g. torch.distributed.barrier; needed when they are more than one, and the folder must then be on a
    filesystem they all share)."""
    rank: int = 0
    world_size: int = 1
    barrier: object = None


def build_cache(folder, fingerprint, num_samples, encode, processes=Processes(), layout=CacheLayout(), log=print):
    """Make `folder` hold encode([i])[0] for every i in range(num_samples), reusing what is already there; every
    process calls it with the same arguments and its own rank. -> a FeatureCache of the folder.

    encode(indices) -> one dict {key: tensor} per index, in order; it is called on at most layout.encode_batch
    indices at a time, all from one shard. Only rank 0 logs and shows progress.
    """
    folder, rank, world_size, barrier = os.fspath(folder), processes.rank, processes.world_size, processes.barrier
    shard_size, encode_batch = layout.shard_size, layout.encode_batch
    fingerprint = _normalized(fingerprint)
    for name, value, least in (("num_samples", num_samples, 1), ("shard_size", shard_size, 1),
                               ("encode_batch", encode_batch, 1), ("world_size", world_size, 1)):
        if not isinstance(value, int) or value < least:
            raise CacheError(f"build_cache needs an integer {name} >= {least}, got {value!r}")
    if not 0 <= rank < world_size:
        raise CacheError(f"rank {rank} is not in range for world_size {world_size}")
    if world_size > 1 and barrier is None:
        raise CacheError(f"build_cache with world_size {world_size} needs a barrier (e.g. torch.distributed.barrier)")
    wait = barrier or (lambda: None)
    say = log if rank == 0 else (lambda *_: None)

    if rank == 0:
        _prepare(folder, fingerprint, num_samples, shard_size, say)
    wait()
    # The plan comes from building.json, which rank 0 wrote before the barrier; no building.json means rank 0
    # found the cache complete.
    plan = _read_json(os.path.join(folder, BUILDING))
    if plan is not None:
        if plan.get("fingerprint") != fingerprint or plan.get("num_samples") != num_samples:
            raise CacheError(f"rank {rank} was given another fingerprint or sample count than rank 0 for the cache "
                             f"{folder}: every rank must describe the same features")
        _build_shards(folder, fingerprint, num_samples, plan["shard_size"], encode, processes, layout)
    wait()
    if rank == 0 and plan is not None:
        _commit(folder, fingerprint, num_samples, plan["shard_size"])
        say(f"cache {folder}: wrote {num_samples} samples in {math.ceil(num_samples / plan['shard_size'])} shards "
            f"({cache_size_bytes(folder) / 1e6:.1f} MB)")
    wait()
    return FeatureCache(folder)


class FeatureCache(torch.utils.data.Dataset):
    """The samples of a committed cache: cache[i] -> {key: tensor}, read from memory-mapped shards.

    Shard handles are opened on first use by the process that reads, and are not pickled, so each DataLoader
    worker opens its own.
    """

    def __init__(self, folder):
        self.folder = os.fspath(folder)
        path = os.path.join(self.folder, INDEX)
        if not os.path.exists(path):
            raise CacheError(f"no feature cache at {self.folder} (no {INDEX}): build it with build_cache")
        index = _read_json(path)
        if not _is_index(index):
            raise CacheError(f"{path} is not a readable feature cache index (format {FORMAT}): build the cache again")
        self.fingerprint = index["fingerprint"]
        self.num_samples = index["num_samples"]
        self.shard_size = index["shard_size"]
        self.shards = index["shards"]
        self._handles = {}
        self._pid = os.getpid()

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        i = operator.index(i)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} is out of range for the cache {self.folder} of {self.num_samples} samples")
        handle, keys = self._shard(i // self.shard_size)
        return {key: handle.get_tensor(f"{i}.{key}") for key in keys[i]}

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}}

    def close(self):
        self._handles = {}

    def _shard(self, k):
        """-> (open handle, {sample: [keys]}) of shard k, opened once per process."""
        if self._pid != os.getpid():  # a forked worker inherited the parent's handles: open its own
            self._handles, self._pid = {}, os.getpid()
        if k not in self._handles:
            entry = self.shards[k]
            path = os.path.join(self.folder, entry["file"])
            if not os.path.exists(path):
                raise CacheError(f"cache shard {path} is missing: run build_cache again to rebuild it")
            if os.path.getsize(path) != entry["bytes"]:
                raise CacheError(f"cache shard {path} has {os.path.getsize(path)} bytes but {INDEX} says "
                                 f"{entry['bytes']}: it was altered; run build_cache again to rebuild it")
            try:
                handle = safe_open(path, framework="pt")
                keys = {}
                for name in handle.keys():
                    sample, key = name.split(".", 1)
                    keys.setdefault(int(sample), []).append(key)
            except Exception as e:  # a foreign or damaged file of the right size
                raise CacheError(f"cannot read cache shard {path}: {str(e).splitlines()[0][:200]}") from None
            self._handles[k] = handle, keys
        return self._handles[k]


def _normalized(fingerprint):
    """The fingerprint as it reads back from JSON (tuples become lists), so it compares equal to a stored one."""
    if not isinstance(fingerprint, dict):
        raise CacheError(f"the cache fingerprint must be a dict, got {type(fingerprint).__name__}")
    try:
        return json.loads(json.dumps(fingerprint, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CacheError(f"the cache fingerprint must be JSON-able: {e}") from None


def _read_json(path):
    """-> the dict in `path`, or None if it is missing or is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _is_index(value):
    """Whether `value` (from _read_json) looks like an index this version wrote."""
    return (value is not None and value.get("format") == FORMAT and isinstance(value.get("fingerprint"), dict)
            and isinstance(value.get("num_samples"), int) and isinstance(value.get("shard_size"), int)
            and isinstance(value.get("shards"), list)
            and all(isinstance(entry, dict) and {"file", "first", "bytes"} <= set(entry)
                    and isinstance(entry.get("count"), int) for entry in value["shards"])
            and sum(entry["count"] for entry in value["shards"]) == value["num_samples"])


def _remove(path):
    if os.path.exists(path):
        os.remove(path)


def _shard_files(folder):
    return sorted(name for name in os.listdir(folder) if SHARD_PATTERN.fullmatch(name))


def _wipe_shards(folder):
    for name in _shard_files(folder):
        os.remove(os.path.join(folder, name))


def _shard_range(k, num_samples, shard_size):
    first = k * shard_size
    return first, min(shard_size, num_samples - first)


def _shard_holds(path, first, count, digest):
    """Whether `path` is a readable shard of this fingerprint holding exactly samples [first, first + count)."""
    try:
        with safe_open(path, framework="pt") as f:
            if (f.metadata() or {}).get("fingerprint_sha256") != digest:
                return False
            samples = {int(name.split(".", 1)[0]) for name in f.keys()}
    except Exception:  # damaged, foreign, or keys that are not '<sample>.<key>': rebuild it
        return False
    return samples == set(range(first, first + count))


def _prepare(folder, fingerprint, num_samples, shard_size, say):
    """Rank 0, before any shard is built: reuse a complete cache (no building.json left), or write building.json
    and leave only the shards that are valid for this fingerprint."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if TEMP_PATTERN.fullmatch(name):
            os.remove(os.path.join(folder, name))
    index_path, building_path = os.path.join(folder, INDEX), os.path.join(folder, BUILDING)
    index = _read_json(index_path)
    building = _read_json(building_path)
    if _is_index(index):
        if _reuse(folder, index, fingerprint, num_samples, say):
            return
    elif os.path.exists(index_path):
        say(f"cache {folder}: {INDEX} is unreadable or of another format: rebuilding")
        _remove(index_path)
        _remove(building_path)
        _wipe_shards(folder)
    elif building is not None and (building.get("fingerprint") != fingerprint
                                   or building.get("num_samples") != num_samples):
        changes = describe_changes(building.get("fingerprint"), fingerprint)
        changes += ["num_samples"] if building.get("num_samples") != num_samples else []
        say(f"cache {folder}: an interrupted build of other features is there (changed: {', '.join(changes)}): "
            "starting over")
        _remove(building_path)
        _wipe_shards(folder)

    atomic_write_text(building_path, json.dumps({"fingerprint": fingerprint, "num_samples": num_samples,
                                                 "shard_size": shard_size, "format": FORMAT}, indent=2) + "\n")
    _keep_valid_shards(folder, fingerprint, num_samples, shard_size, say)


def _reuse(folder, index, fingerprint, num_samples, say):
    """A committed index: -> True if the cache it vouches for is complete and of these features; else it is
    removed (with the shards it can no longer vouch for) for a rebuild."""
    index_path, building_path = os.path.join(folder, INDEX), os.path.join(folder, BUILDING)
    changes = describe_changes(index["fingerprint"], fingerprint)
    changes += ["num_samples"] if index["num_samples"] != num_samples else []
    if changes:
        say(f"cache {folder} is stale (changed: {', '.join(changes)}): rebuilding")
        # The index goes first: a kill during the rebuild must never leave an index vouching for old shards.
        _remove(index_path)
        _remove(building_path)
        _wipe_shards(folder)
        return False
    altered = [entry["file"] for entry in index["shards"]
               if not os.path.exists(os.path.join(folder, entry["file"]))
               or os.path.getsize(os.path.join(folder, entry["file"])) != entry["bytes"]]
    if not altered:
        _remove(building_path)  # a kill between the index's commit and this file's removal
        say(f"cache {folder}: reusing {num_samples} samples in {len(index['shards'])} shards "
            f"({cache_size_bytes(folder) / 1e6:.1f} MB)")
        return True
    listed = ", ".join(altered[:5]) + (f" and {len(altered) - 5} more" if len(altered) > 5 else "")
    say(f"cache {folder}: {len(altered)} shards are missing or altered ({listed}): rebuilding them")
    _remove(index_path)
    for name in altered:
        if SHARD_PATTERN.fullmatch(name):  # never delete a file of another name an edited index points at
            _remove(os.path.join(folder, name))
    return False


def _keep_valid_shards(folder, fingerprint, num_samples, shard_size, say):
    """Keep the shards that hold this fingerprint's samples at their place; remove the rest."""
    num_shards = math.ceil(num_samples / shard_size)
    digest, kept = json_digest(fingerprint), 0
    for name in _shard_files(folder):
        k = int(name[len("shard_"):-len(".safetensors")])
        path = os.path.join(folder, name)
        if k < num_shards and name == shard_name(k) and _shard_holds(path, *_shard_range(k, num_samples, shard_size),
                                                                     digest):
            kept += 1
        else:
            os.remove(path)
    to_encode = num_samples - sum(_shard_range(k, num_samples, shard_size)[1] for k in range(num_shards)
                                  if os.path.exists(os.path.join(folder, shard_name(k))))
    if kept:
        say(f"cache {folder}: resuming: kept {kept} of {num_shards} shards, encoding {to_encode} samples")
    else:
        say(f"cache {folder}: encoding {num_samples} samples into {num_shards} shards")


def _build_shards(folder, fingerprint, num_samples, shard_size, encode, processes, layout):
    """Encode and write this rank's missing shards."""
    rank, world_size, encode_batch = processes.rank, processes.world_size, layout.encode_batch
    progress, num_shards = layout.progress and rank == 0, math.ceil(num_samples / shard_size)
    mine = [k for k in range(rank, num_shards, world_size) if not os.path.exists(os.path.join(folder, shard_name(k)))]
    total = sum(_shard_range(k, num_samples, shard_size)[1] for k in mine)
    metadata = {"fingerprint_sha256": json_digest(fingerprint), "format": str(FORMAT)}
    with tqdm(total=total, desc="caching features", unit="sample", disable=not progress, dynamic_ncols=True) as bar:
        for k in mine:
            first, count = _shard_range(k, num_samples, shard_size)
            tensors = {}
            for start in range(first, first + count, encode_batch):
                indices = list(range(start, min(start + encode_batch, first + count)))
                tensors.update(_encoded(encode, indices))
                bar.update(len(indices))
            _write_shard(os.path.join(folder, shard_name(k)), tensors,
                         {**metadata, "first": str(first), "count": str(count)})


def _encoded(encode, indices):
    """-> {'<sample>.<key>': tensor} of encode(indices), checked; tensors copied to the CPU with their own memory
    (views into one batch tensor cannot be saved apart)."""
    samples = encode(list(indices))
    if not isinstance(samples, (list, tuple)) or len(samples) != len(indices):
        got = f"{len(samples)} items" if isinstance(samples, (list, tuple)) else f"a {type(samples).__name__}"
        raise CacheError(f"encode was given {len(indices)} indices (from {indices[0]}) and returned {got}: it must "
                         "return one dict of tensors per index, in order")
    tensors = {}
    for i, sample in zip(indices, samples):
        if not isinstance(sample, dict) or not sample:
            raise CacheError(f"encode returned {sample!r:.80} for sample {i}: it must be a non-empty dict of tensors")
        for key, value in sample.items():
            if not isinstance(key, str) or not key:
                raise CacheError(f"encode returned the key {key!r} for sample {i}: keys must be non-empty strings")
            if not isinstance(value, torch.Tensor):
                raise CacheError(f"encode returned a {type(value).__name__} for '{key}' of sample {i}: values must "
                                 "be tensors")
            tensors[f"{i}.{key}"] = value.detach().to("cpu").clone(memory_format=torch.contiguous_format)
    return tensors


def _write_shard(path, tensors, metadata):
    """Write atomically, read back and compared (model/file_io.py); a shard that reads back wrong is removed."""
    try:
        write_safetensors(path, tensors, metadata=metadata)
    except RuntimeError:
        _remove(path)
        raise CacheError(f"cache shard {path} read back different from what was written: is the disk failing?") \
            from None


def _commit(folder, fingerprint, num_samples, shard_size):
    """Rank 0, once every rank has built its shards: write index.json, then drop building.json."""
    shards = []
    for k in range(math.ceil(num_samples / shard_size)):
        path = os.path.join(folder, shard_name(k))
        if not os.path.exists(path):
            raise CacheError(f"cache shard {path} was not written: if ranks run on several machines, the cache "
                             "folder must be on a filesystem they all share")
        first, count = _shard_range(k, num_samples, shard_size)
        shards.append({"file": shard_name(k), "first": first, "count": count, "bytes": os.path.getsize(path)})
    index = {"fingerprint": fingerprint, "num_samples": num_samples, "shard_size": shard_size, "shards": shards,
             "format": FORMAT}
    atomic_write_text(os.path.join(folder, INDEX), json.dumps(index, indent=2) + "\n")
    _remove(os.path.join(folder, BUILDING))
