"""Aspect-ratio buckets: the sizes, which bucket an image goes to, the per-epoch micro-batch plan (nothing dropped,
one bucket per micro-batch), and user image folders coming out at their bucket's size."""
import math
import os
from collections import Counter

import numpy as np
import pytest
from PIL import Image, ImageOps

from dataset.image_folder import (
    MAX_AREA_FACTOR, DatasetError, ImageCaptionDataset, bucket_layout, bucket_sizes, build_dataset, load_image,
    nearest_bucket, read_image, to_rgb,
)
from dataset.shapes import ShapesDataset
from tests.conftest import exif_jpeg, save_image_png as save_png
from trainer.mechanics.position import BucketBatches

# ----------------------------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize("resolution, multiple", [(1024, 16), (512, 16), (256, 16), (64, 4), (32, 4)])
def test_bucket_sizes(resolution, multiple):
    sizes = bucket_sizes(resolution, multiple)
    assert len(sizes) == 7 and (resolution, resolution) in sizes and sizes[3] == (resolution, resolution)
    for w, h in sizes:
        assert w % multiple == 0 and h % multiple == 0, (w, h)
        assert 0.9 * resolution ** 2 <= w * h <= MAX_AREA_FACTOR * resolution ** 2, (w, h)
        assert 1 / 2 <= w / h <= 2, (w, h)
    assert set(sizes) == {(h, w) for w, h in sizes}  # tall and wide mirror each other
    ratios = [w / h for w, h in sizes]
    assert ratios == sorted(set(ratios))  # sorted by aspect ratio, no duplicates
    if resolution >= 256:  # fine enough a grid that the ratios land near the evenly spread targets
        targets = [2 ** (k / 3) for k in range(-3, 4)]
        assert all(abs(math.log(r / t)) < 0.06 for r, t in zip(ratios, targets)), ratios


def test_bucket_sizes_edge_cases():
    assert bucket_sizes(512, 16, count=1) == [(512, 512)]
    assert bucket_sizes(512, 16, max_ratio=1.0) == [(512, 512)]
    assert bucket_sizes(16, 16) == [(16, 16)]  # one latent patch: every ratio rounds to the square
    wide = bucket_sizes(512, 16, max_ratio=4.0, count=9)
    assert len(wide) == 9 and wide[0][1] / wide[0][0] == pytest.approx(4, rel=0.05)
    for kwargs, message in [(dict(resolution=500, multiple=16), "multiple of 16"),
                            (dict(resolution=512, multiple=16, count=6), "odd"),
                            (dict(resolution=512, multiple=16, count=0), "odd"),
                            (dict(resolution=512, multiple=16, max_ratio=0.5), ">= 1"),
                            (dict(resolution=512, multiple=0), "multiple")]:
        with pytest.raises(ValueError, match=message) as error:
            bucket_sizes(**kwargs)
        assert "\n" not in str(error.value)


def test_nearest_bucket():
    sizes = bucket_sizes(512, 16)
    square = sizes.index((512, 512))
    assert nearest_bucket(300, 600, sizes) == 0 and nearest_bucket(3000, 1000, sizes) == len(sizes) - 1
    assert nearest_bucket(700, 700, sizes) == square and nearest_bucket(530, 512, sizes) == square
    w, h = sizes[nearest_bucket(3000, 4000, sizes)]  # a portrait phone photo: tall, but not the tallest
    assert h > w and 0 < nearest_bucket(3000, 4000, sizes) < square
    assert sizes[nearest_bucket(1600, 1200, sizes)] == (576, 464)  # in log space 4:3 is nearer 1.24 than 1.6


# ----------------------------------------------------------------------------------------------------------------
# Micro-batch plan


def mixed_buckets():
    """22 samples in 4 buckets of 10, 7, 1 and 4, interleaved as a folder scan would find them."""
    bucket_of = [0] * 10 + [1] * 7 + [2] + [3] * 4
    return [bucket_of[i] for i in np.random.default_rng(0).permutation(len(bucket_of))]


@pytest.mark.parametrize("batch_size", [1, 3, 4, 16])
def test_every_sample_every_epoch(batch_size):
    bucket_of = mixed_buckets()
    plan = BucketBatches(bucket_of, batch_size, seed=5)
    sizes = Counter(bucket_of)
    expected = sum(math.ceil(n / batch_size) for n in sizes.values())
    assert plan.len_micro_batches() == expected
    for epoch in range(3):
        batches = plan.micro_batches(epoch)
        assert len(batches) == expected
        seen = Counter()
        for batch in batches:
            assert len(batch) == batch_size and len({bucket_of[i] for i in batch}) == 1, batch
            seen.update(batch)
        assert set(seen) == set(range(len(bucket_of)))  # the lone sample of bucket 2 included
        for bucket, n in sizes.items():
            repeats = sum(seen[i] - 1 for i in seen if bucket_of[i] == bucket)  # only the padding repeats
            assert repeats == math.ceil(n / batch_size) * batch_size - n and repeats < batch_size, bucket
        if batch_size == 1:
            assert all(count == 1 for count in seen.values())


def test_lone_image_fills_its_micro_batch():
    plan = BucketBatches([0, 0, 0, 0, 0, 1], 4, seed=0)
    batches = plan.micro_batches(0)
    assert len(batches) == 3 and [5, 5, 5, 5] in batches


def test_plan_is_deterministic_per_seed_and_epoch():
    bucket_of = mixed_buckets()
    plan = BucketBatches(bucket_of, 3, seed=1)
    assert plan.micro_batches(4) == BucketBatches(bucket_of, 3, seed=1).micro_batches(4)
    assert plan.micro_batches(0) != plan.micro_batches(1)
    assert plan.micro_batches(0) != BucketBatches(bucket_of, 3, seed=2).micro_batches(0)
    # shuffled inside buckets too, not only the order of the micro-batches
    assert {tuple(b) for b in plan.micro_batches(0)} != {tuple(b) for b in plan.micro_batches(1)}
    with pytest.raises(ValueError, match="batch size"):
        BucketBatches(bucket_of, 0, seed=0)
    with pytest.raises(ValueError, match="empty"):
        BucketBatches([], 2, seed=0)


# ----------------------------------------------------------------------------------------------------------------
# Images at their bucket's size


def old_load_image(path, resolution):
    """load_image as it was before buckets, to check the square path still gives the very same pixels."""
    with Image.open(path) as img:
        img.draft(None, (2 * resolution, 2 * resolution))
        img = ImageOps.exif_transpose(img)
        img = to_rgb(img)
    w, h = img.size
    side = min(w, h)
    box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
    return img.resize((resolution, resolution), Image.Resampling.LANCZOS, box=box)


@pytest.fixture
def shaped_folder(tmp_path):
    """Images of several shapes: square, wide, tall, nearly square, a big JPEG, and a phone photo stored wide but
    displayed tall (EXIF orientation 6)."""
    root = tmp_path / "shapes"
    rng = np.random.default_rng(0)
    for name, (w, h) in {"square": (30, 30), "wide": (64, 32), "tall": (21, 40), "almost": (33, 30)}.items():
        save_png(root / f"{name}.png", Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    big = Image.fromarray(np.repeat(np.repeat(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8), 10, 0), 10, 1))
    big.save(root / "big.jpg", quality=90)  # 300x200: the draft decodes it at a reduced scale
    exif_jpeg(root / "photo.jpg")  # stored 40x20, left half red
    (root / "broken.png").write_bytes(b"not a png")
    return root


def test_square_path_unchanged(shaped_folder):
    for name in ("wide.png", "tall.png", "almost.png", "big.jpg", "photo.jpg"):
        path = str(shaped_folder / name)
        for resolution in (16, 24):
            old = old_load_image(path, resolution).tobytes()
            assert load_image(path, resolution).tobytes() == old, name
            assert load_image(path, resolution, size=(resolution, resolution)).tobytes() == old, name


def test_cover_and_crop(tmp_path):
    stripes = np.zeros((40, 120, 3), dtype=np.uint8)  # red | green | blue, the green middle 60 wide
    stripes[:, :30, 0] = stripes[:, 30:90, 1] = stripes[:, 90:, 2] = 255
    Image.fromarray(stripes).save(tmp_path / "stripes.png")
    out = np.asarray(load_image(tmp_path / "stripes.png", 99, size=(30, 20))).astype(int)  # 3:2 of 3:1: the middle
    assert out.shape == (20, 30, 3)
    assert (out[:, 2:-2, 1] > 240).all() and (out[:, 2:-2, [0, 2]] < 15).all()


def test_draft_and_size_follow_exif_rotation(tmp_path):
    path = tmp_path / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 400x200, displayed 200x400
    Image.new("RGB", (400, 200), (90, 90, 90)).save(path, quality=90, exif=exif)
    displayed, full_size = read_image(path, (16, 32))
    assert full_size == (200, 400)
    # The draft asked for >= 2x the tall target in display terms, so a 1/4 scale decode (not 1/2) suffices.
    assert displayed.size == (50, 100)
    assert load_image(path, 32, size=(16, 32)).size == (16, 32)


def test_dataset_with_buckets(shaped_folder):
    sizes = bucket_sizes(32, 4)
    lines = []
    dataset = ImageCaptionDataset(str(shaped_folder), 32, log=lines.append, buckets=sizes)
    assert dataset.bucket_sizes == sizes and len(dataset.bucket_of) == len(dataset) == 6
    bucket_by_name = {os.path.basename(p): sizes[b] for (p, _), b in zip(dataset.items, dataset.bucket_of)}
    assert bucket_by_name["square.png"] == bucket_by_name["almost.png"] == (32, 32)
    assert bucket_by_name["wide.png"] == sizes[-1] and bucket_by_name["tall.png"] == sizes[0]
    w, h = bucket_by_name["photo.jpg"]
    assert h > w and bucket_by_name["photo.jpg"] == sizes[0]  # stored wide, displayed tall: the tall bucket
    assert bucket_by_name["big.jpg"] == (40, 24)  # 3:2 lies nearer 5:3 than 9:7
    for i, (path, _) in enumerate(dataset.items):
        w, h = dataset.bucket_sizes[dataset.bucket_of[i]]
        assert dataset[i]["image"].shape == (3, h, w), path
    photo = dataset[[os.path.basename(p) for p, _ in dataset.items].index("photo.jpg")]["image"]
    assert photo[0, :3].mean() > 0.8 and photo[2, :3].mean() < -0.6  # the red half is on top once turned

    assert len(lines) == 1 and lines[0] == dataset.summary and "1 skipped" in lines[0]
    counts = Counter(dataset.bucket_of)
    listed = ", ".join(f"{w}x{h}: {counts[i]}" for i, (w, h) in enumerate(sizes) if counts[i])
    assert lines[0].endswith(f"without caption, buckets {listed}") and "32x32: 2" in listed

    plain = ImageCaptionDataset(str(shaped_folder), 32, log=lambda line: None)
    assert plain.bucket_of == [0] * 6 and plain.bucket_sizes == [(32, 32)] and ", buckets" not in plain.summary
    assert plain.summary == dataset.summary.partition(", buckets")[0]
    assert all(plain[i]["image"].shape == (3, 32, 32) for i in range(len(plain)))
    assert bucket_layout(dataset, 32) == (dataset.bucket_of, sizes)
    assert bucket_layout(plain, 32) == ([0] * 6, [(32, 32)])


def test_build_dataset_buckets(shaped_folder):
    sizes = bucket_sizes(32, 4)
    dataset = build_dataset(str(shaped_folder), 32, log=lambda line: None, buckets=sizes)
    assert dataset.bucket_sizes == sizes and len(set(dataset.bucket_of)) > 1
    with pytest.raises(DatasetError, match="builtin.*square") as error:
        build_dataset("builtin", 32, log=lambda line: None, buckets=sizes)
    assert "\n" not in str(error.value)
    shapes = ShapesDataset("train", 5, 32)
    assert bucket_layout(shapes, 32) == ([0] * 5, [(32, 32)])
