"""The feature cache: exact round trips, reuse, stale and killed builds, ranks, errors, DataLoader workers."""
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from dataset.cache import (
    CacheError, CacheLayout, FeatureCache, Processes, build_cache, cache_size_bytes, describe_changes,
)
from model.file_io import tensors_equal

from tests.scripts import ENV, REPO

FINGERPRINT = {"vae": "tiny-vae", "captions": "sha-of-captions", "resolution": 32}
NUM_SAMPLES = 23  # not a multiple of SHARD_SIZE: the last shard holds 3 samples
SHARD_SIZE = 5
ENCODE_BATCH = 3  # does not divide SHARD_SIZE either, so a shard's last chunk is short
SHARDS = [f"shard_{k:05d}.safetensors" for k in range(5)]


def fake_sample(i, salt=0):
    """Deterministic features of sample i: shapes vary by index (aspect-ratio buckets), a bf16 tensor, and a key
    (with a dot in its name) that only even samples have."""
    generator = torch.Generator().manual_seed(1000 * salt + i)
    sample = {"latents": torch.randn(4, 2 + i % 3, 2 + (i * 7) % 4, generator=generator),
              "tokens": torch.randn(3, 8, generator=generator).to(torch.bfloat16)}
    if i % 2 == 0:
        sample["pooled.ids"] = torch.randint(0, 1000, (5,), generator=generator)
    return sample


class Encoder:
    """A fake `encode` that records every call."""

    def __init__(self, salt=0):
        self.salt = salt
        self.calls = []

    def __call__(self, indices):
        self.calls.append(list(indices))
        return [fake_sample(i, self.salt) for i in indices]

    @property
    def indices(self):
        return sorted(i for call in self.calls for i in call)


def build(folder, encode, fingerprint=FINGERPRINT, num_samples=NUM_SAMPLES, **kwargs):
    """-> (cache, log lines) of a quiet build with the test's sizes."""
    lines = []
    kwargs = {"shard_size": SHARD_SIZE, "encode_batch": ENCODE_BATCH, "progress": False, **kwargs}
    processes = Processes(**{k: kwargs.pop(k) for k in ("rank", "world_size", "barrier") if k in kwargs})
    cache = build_cache(folder, fingerprint, num_samples, encode, processes, CacheLayout(**kwargs), lines.append)
    return cache, lines


def assert_cache_holds(cache, salt=0, num_samples=NUM_SAMPLES):
    """Every sample reads back exactly (keys, dtype, shape, values) as the fake encoder made it."""
    assert len(cache) == num_samples
    for i in range(num_samples):
        found, expected = cache[i], fake_sample(i, salt)
        assert set(found) == set(expected), i
        for key, tensor in expected.items():
            assert tensors_equal(tensor, found[key]), (i, key)


def shard_files(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith("shard_"))


def test_build_then_read(tmp_path):
    folder = tmp_path / "cache"
    encoder = Encoder()
    cache, lines = build(folder, encoder)
    assert encoder.indices == list(range(NUM_SAMPLES))
    for call in encoder.calls:  # chunks of at most ENCODE_BATCH, never across a shard boundary
        assert 1 <= len(call) <= ENCODE_BATCH and call[0] // SHARD_SIZE == call[-1] // SHARD_SIZE
    assert sorted(os.listdir(folder)) == ["index.json"] + SHARDS
    index = json.loads((folder / "index.json").read_text())
    assert index["fingerprint"] == FINGERPRINT and index["num_samples"] == NUM_SAMPLES and index["format"] == 1
    assert index["shard_size"] == SHARD_SIZE
    assert [(s["file"], s["first"], s["count"]) for s in index["shards"]] == \
        [(name, 5 * k, 5 if k < 4 else 3) for k, name in enumerate(SHARDS)]
    assert all(s["bytes"] == os.path.getsize(folder / s["file"]) for s in index["shards"])
    assert cache_size_bytes(folder) == sum(s["bytes"] for s in index["shards"])
    assert lines[0] == f"cache {folder}: encoding 23 samples into 5 shards" and "wrote 23 samples in 5" in lines[1]

    assert isinstance(cache, FeatureCache) and cache.folder == str(folder) and cache.fingerprint == FINGERPRINT
    assert_cache_holds(cache)
    reader = FeatureCache(folder)
    assert reader._handles == {}  # opened on first read, by the process that reads
    reader[0]
    handle = reader._handles[0][0]
    reader[4]
    assert set(reader._handles) == {0} and reader._handles[0][0] is handle  # kept open
    assert_cache_holds(reader)
    assert tensors_equal(cache[-1]["latents"], fake_sample(22)["latents"])
    for out_of_range in (NUM_SAMPLES, -NUM_SAMPLES - 1):
        with pytest.raises(IndexError):
            cache[out_of_range]


def test_views_of_one_batch_tensor_and_the_progress_bar(tmp_path, capsys):
    """A real encoder returns rows of one batch tensor (views sharing memory), maybe needing grad: each sample is
    stored on its own. Rank 0 shows a progress bar of the samples it encodes."""
    def encode(indices):
        batch = torch.stack([torch.full((2, 3), float(i)) for i in indices]).requires_grad_()
        return [{"latents": batch[j] * 1, "first_row": batch[j, 0]} for j in range(len(indices))]

    cache = build_cache(tmp_path, {"v": 1}, 7, encode, layout=CacheLayout(shard_size=4, encode_batch=4),
                        log=lambda *_: None)
    assert "caching features" in capsys.readouterr().err
    for i in range(7):
        assert tensors_equal(cache[i]["latents"], torch.full((2, 3), float(i)))
        assert tensors_equal(cache[i]["first_row"], torch.full((3,), float(i)))


def test_reuse_encodes_nothing(tmp_path):
    build(tmp_path, Encoder(), fingerprint={**FINGERPRINT, "sizes": (1, 2)})
    # A kill between the index's commit and building.json's removal leaves both: the index wins.
    (tmp_path / "building.json").write_text(json.dumps({"fingerprint": {"other": 1}}))
    encoder = Encoder()
    # A tuple reads back from JSON as a list: the same fingerprint, not a change.
    cache, lines = build(tmp_path, encoder, fingerprint={**FINGERPRINT, "sizes": [1, 2]})
    assert encoder.calls == []
    assert lines == [f"cache {tmp_path}: reusing 23 samples in 5 shards ({cache_size_bytes(tmp_path) / 1e6:.1f} MB)"]
    assert sorted(os.listdir(tmp_path)) == ["index.json"] + SHARDS
    assert_cache_holds(cache)


def test_describe_changes():
    old = {"vae": "a", "captions": "x", "resolution": 32, "gone": 1}
    new = {"vae": "a", "captions": "y", "resolution": [32, 32], "added": 2}
    assert describe_changes(old, new) == ["added", "captions", "gone", "resolution"]
    assert describe_changes(old, dict(old)) == []


def test_stale_cache_is_rebuilt(tmp_path):
    build(tmp_path, Encoder())
    fingerprint = {**FINGERPRINT, "captions": "new-captions"}

    def failing(indices):
        raise RuntimeError("encoder crashed")

    # The stale index goes before anything else: a failed rebuild leaves no index vouching for old shards.
    with pytest.raises(RuntimeError, match="encoder crashed"):
        build(tmp_path, failing, fingerprint=fingerprint)
    assert not (tmp_path / "index.json").exists() and shard_files(tmp_path) == []
    with pytest.raises(CacheError, match="no feature cache"):
        FeatureCache(tmp_path)

    build(tmp_path, Encoder())  # the old features again, so the next build sees a stale index
    encoder = Encoder(salt=1)
    cache, lines = build(tmp_path, encoder, fingerprint=fingerprint)
    assert encoder.indices == list(range(NUM_SAMPLES))
    stale = [line for line in lines if " is stale" in line]
    assert stale == [f"cache {tmp_path} is stale (changed: captions): rebuilding"]
    assert cache.fingerprint == fingerprint
    assert_cache_holds(cache, salt=1)

    encoder = Encoder(salt=1)
    cache, lines = build(tmp_path, encoder, fingerprint=fingerprint, num_samples=12)
    assert lines[0] == f"cache {tmp_path} is stale (changed: num_samples): rebuilding"
    assert encoder.indices == list(range(12)) and shard_files(tmp_path) == SHARDS[:3]
    assert_cache_holds(cache, salt=1, num_samples=12)


KILLED_BUILD = """
import os, signal, sys
from dataset.cache import CacheLayout, build_cache
from tests.test_cache import ENCODE_BATCH, FINGERPRINT, NUM_SAMPLES, SHARD_SIZE, fake_sample

def encode(indices):
    if indices[0] >= 13:  # shards 0 and 1 are written, shard 2 is half encoded
        os.kill(os.getpid(), signal.SIGKILL)
    return [fake_sample(i) for i in indices]

build_cache(sys.argv[1], FINGERPRINT, NUM_SAMPLES, encode,
            layout=CacheLayout(shard_size=SHARD_SIZE, encode_batch=ENCODE_BATCH, progress=False))
"""


def test_killed_build_resumes(tmp_path):
    killed = tmp_path / "killed"
    result = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(killed)], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert sorted(os.listdir(killed)) == ["building.json"] + SHARDS[:2]
    (killed / ".tmp-shard_00002.safetensors.x1y2z3").write_bytes(b"half a shard")  # a write cut short
    (killed / SHARDS[3]).write_bytes(b"not a safetensors file")  # damaged: must be redone, not trusted
    (killed / ".tmp-notes.txt.abc").write_bytes(b"")  # not a temp file of the cache's: left alone
    other = tmp_path / "other"
    shutil.copytree(killed, other)

    encoder = Encoder()
    cache, lines = build(killed, encoder)
    assert encoder.indices == list(range(10, NUM_SAMPLES))
    assert f"cache {killed}: resuming: kept 2 of 5 shards, encoding 13 samples" in lines
    assert sorted(os.listdir(killed)) == [".tmp-notes.txt.abc", "index.json"] + SHARDS
    assert_cache_holds(cache)
    clean, _ = build(tmp_path / "clean", Encoder())
    assert json.loads((killed / "index.json").read_text())["shards"] == \
        json.loads((tmp_path / "clean" / "index.json").read_text())["shards"]
    for i in range(NUM_SAMPLES):
        resumed, expected = cache[i], clean[i]
        assert set(resumed) == set(expected) and all(tensors_equal(expected[k], resumed[k]) for k in expected)

    # An interrupted build of other features is wiped, not resumed.
    encoder = Encoder(salt=2)
    cache, lines = build(other, encoder, fingerprint={**FINGERPRINT, "captions": "other"})
    assert encoder.indices == list(range(NUM_SAMPLES))
    assert lines[0] == f"cache {other}: an interrupted build of other features is there (changed: captions): " \
                       "starting over"
    assert_cache_holds(cache, salt=2)


def test_shards_of_another_fingerprint_are_not_kept(tmp_path):
    """Shards carry their fingerprint's hash: one left without any index or building.json is not trusted."""
    build(tmp_path, Encoder())
    os.remove(tmp_path / "index.json")
    encoder = Encoder(salt=3)
    cache, lines = build(tmp_path, encoder, fingerprint={**FINGERPRINT, "vae": "other"})
    assert encoder.indices == list(range(NUM_SAMPLES))
    assert_cache_holds(cache, salt=3)
    os.remove(tmp_path / "index.json")
    encoder = Encoder(salt=3)
    cache, lines = build(tmp_path, encoder, fingerprint={**FINGERPRINT, "vae": "other"})
    assert encoder.calls == [] and "kept 5 of 5 shards" in lines[0]


def run_ranks(folder, world_size=2):
    """build_cache on `world_size` threads, one per rank -> ([encoder], [log lines], [cache]) by rank."""
    barrier = threading.Barrier(world_size, timeout=60)
    encoders, logs = [Encoder() for _ in range(world_size)], [[] for _ in range(world_size)]
    caches, errors = [None] * world_size, []

    def rank_main(rank):
        try:
            caches[rank] = build_cache(folder, FINGERPRINT, NUM_SAMPLES, encoders[rank],
                                       Processes(rank, world_size, barrier.wait),
                                       CacheLayout(SHARD_SIZE, ENCODE_BATCH), logs[rank].append)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return encoders, logs, caches


def test_ranks_split_the_shards(tmp_path):
    encoders, logs, caches = run_ranks(tmp_path)
    for rank, encoder in enumerate(encoders):
        assert encoder.indices == [i for i in range(NUM_SAMPLES) if (i // SHARD_SIZE) % 2 == rank]
    assert logs[1] == [] and len(logs[0]) == 2
    for cache in caches:
        assert_cache_holds(cache)
    encoders, logs, caches = run_ranks(tmp_path)
    assert [encoder.calls for encoder in encoders] == [[], []] and "reusing" in logs[0][0]
    assert_cache_holds(caches[1])
    with pytest.raises(CacheError, match="needs a barrier"):
        build(tmp_path, Encoder(), rank=1, world_size=2)


@pytest.mark.parametrize("encode, message", [
    (lambda indices: [fake_sample(i) for i in indices[1:]], "returned 2 items"),
    (lambda indices: {i: fake_sample(i) for i in indices}, "returned a dict"),
    (lambda indices: [{} for _ in indices], "non-empty dict"),
    (lambda indices: [{"latents": [1.0]} for _ in indices], "a list for 'latents'"),
    (lambda indices: [{"": torch.zeros(1)} for _ in indices], "non-empty strings"),
])
def test_bad_features_are_one_line_errors(tmp_path, encode, message):
    with pytest.raises(CacheError, match=message) as error:
        build(tmp_path, encode)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "index.json").exists()


def test_bad_arguments(tmp_path):
    with pytest.raises(CacheError, match="num_samples >= 1"):
        build(tmp_path, Encoder(), num_samples=0)
    with pytest.raises(CacheError, match="JSON-able"):
        build(tmp_path, Encoder(), fingerprint={"resolution": float("nan")})
    with pytest.raises(CacheError, match="JSON-able"):
        build(tmp_path, Encoder(), fingerprint={"vae": object()})
    with pytest.raises(CacheError, match="must be a dict"):
        build(tmp_path, Encoder(), fingerprint="tiny")


def test_missing_or_altered_shards(tmp_path):
    cache, _ = build(tmp_path, Encoder())
    cache[0]
    os.remove(tmp_path / SHARDS[1])
    with (tmp_path / SHARDS[3]).open("ab") as f:
        f.write(b"\0")
    reader = FeatureCache(tmp_path)
    for i in (0, 4, 10, 22):  # the other shards still read
        assert tensors_equal(reader[i]["latents"], fake_sample(i)["latents"])
    with pytest.raises(CacheError, match=f"{SHARDS[1]} is missing: run build_cache again") as error:
        reader[7]
    assert "\n" not in str(error.value)
    with pytest.raises(CacheError, match=f"{SHARDS[3]} has .* bytes but index.json says"):
        reader[15]

    encoder = Encoder()
    cache, lines = build(tmp_path, encoder)
    assert encoder.indices == list(range(5, 10)) + list(range(15, 20))
    assert lines[0] == f"cache {tmp_path}: 2 shards are missing or altered ({SHARDS[1]}, {SHARDS[3]}): rebuilding them"
    assert lines[1] == f"cache {tmp_path}: resuming: kept 3 of 5 shards, encoding 10 samples"
    assert_cache_holds(cache)


class WorkerProbe(torch.utils.data.Dataset):
    """A cache's sample, plus whether the handles that read it were opened by the process that read it."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self):
        return len(self.cache)

    def __getitem__(self, i):
        return self.cache[i], self.cache._pid == os.getpid()


def test_dataloader_workers(tmp_path):
    cache, _ = build(tmp_path, Encoder(), num_samples=8)
    cache[0]  # handles open in this process: they must not be used by workers
    copy = pickle.loads(pickle.dumps(cache))
    assert copy._handles == {} and tensors_equal(copy[7]["tokens"], fake_sample(7)["tokens"])
    loader = torch.utils.data.DataLoader(WorkerProbe(cache), batch_size=None, num_workers=2)
    samples = list(loader)
    assert len(samples) == 8
    for i, (sample, own_handles) in enumerate(samples):
        assert own_handles and set(sample) == set(fake_sample(i))
        assert all(tensors_equal(tensor, sample[key]) for key, tensor in fake_sample(i).items())
