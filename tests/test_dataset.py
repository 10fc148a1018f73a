"""The built-in shapes data (deterministic, captions true to the pixels, held-out pairs kept out of training) and
user image folders / manifests (every kind of bad file skipped and reported in one line)."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from dataset.image_folder import DatasetError, ImageCaptionDataset, build_dataset, load_image
from dataset.shapes import (
    BACKGROUNDS,
    COLORS,
    GRAMMAR_WORDS,
    HELD_OUT_PAIRS,
    NUMBER_WORDS,
    POSITION_CELLS,
    POSITIONS,
    SHAPES,
    ShapesDataset,
    all_captions,
    where_phrase,
)

from tests.conftest import exif_jpeg, save_image_png as save_png

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pairs_of(metadata):
    return {(o["color"], o["shape"]) for o in metadata["objects"]}


# ----------------------------------------------------------------------------------------------------------------
# Built-in shapes


def test_constants():
    assert len(COLORS) == 8 and len(SHAPES) == 5 and len(POSITIONS) == 9
    assert ("purple", "triangle") in HELD_OUT_PAIRS and len(HELD_OUT_PAIRS) == 3
    assert all(c in COLORS and s in SHAPES for c, s in HELD_OUT_PAIRS)
    assert POSITION_CELLS["top left"] == (0, 0) and POSITION_CELLS["center"] == (1, 1)
    assert POSITION_CELLS["bottom right"] == (2, 2)
    # Backgrounds are grey, objects are saturated: no object colour can pass for a background.
    assert all(max(rgb) - min(rgb) == 0 for rgb in BACKGROUNDS.values())
    assert all(max(rgb) - min(rgb) >= 100 for rgb in COLORS.values())


def test_deterministic_and_seeded():
    a, b = ShapesDataset("train", 50, 32, seed=0), ShapesDataset("train", 50, 32, seed=0)
    for i in (0, 1, 7, 49):
        image_a, caption_a, meta_a = a.sample(i)
        image_b, caption_b, meta_b = b.sample(i)
        assert image_a.tobytes() == image_b.tobytes()
        assert (caption_a, meta_a) == (caption_b, meta_b)
    other = ShapesDataset("train", 50, 32, seed=1)
    assert [a.describe(i)[0] for i in range(20)] != [other.describe(i)[0] for i in range(20)]
    heldout = ShapesDataset("heldout", 50, 32, seed=0)
    assert [a.describe(i)[0] for i in range(20)] != [heldout.describe(i)[0] for i in range(20)]
    # The layout does not depend on the resolution, only the pixels (and bboxes) do.
    big = ShapesDataset("train", 50, 64, seed=0)
    assert [a.describe(i)[0] for i in range(20)] == [big.describe(i)[0] for i in range(20)]


def test_held_out_pairs_split():
    train = ShapesDataset("train", 2000)
    kinds = []
    for i in range(len(train)):
        _, metadata = train.describe(i)
        assert not pairs_of(metadata) & HELD_OUT_PAIRS, i
        kinds.append(metadata["kind"])
    # the 40 / 30 / 30 mix
    for kind, share in (("single", 0.4), ("relation", 0.3), ("count", 0.3)):
        assert abs(kinds.count(kind) / len(kinds) - share) < 0.05, kind
    heldout = ShapesDataset("heldout", 500)
    for i in range(len(heldout)):
        assert pairs_of(heldout.describe(i)[1]) & HELD_OUT_PAIRS, i


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_captions_match_metadata(split):
    dataset = ShapesDataset(split, 400, 32, seed=3)
    for i in range(len(dataset)):
        caption, m = dataset.describe(i)
        objects = m["objects"]
        assert all(word in GRAMMAR_WORDS for word in caption.split()), caption
        for o in objects:
            assert o["color"] in caption and o["shape"] in caption, caption
            assert POSITION_CELLS[o["position"]] == (o["row"], o["col"])
        cells = [(o["row"], o["col"]) for o in objects]
        assert len(set(cells)) == len(cells), "objects share a cell"
        if m["kind"] == "single":
            o = objects[0]
            assert len(objects) == 1 and m["count"] is None and m["relation"] is None
            assert caption == f"a {o['size']} {o['color']} {o['shape']} {where_phrase(o['position'])}"
        elif m["kind"] == "count":
            assert 2 <= m["count"] <= 4 and len(objects) == m["count"] and m["relation"] is None
            assert caption.split()[0] == NUMBER_WORDS[m["count"]] and caption.endswith("s")
            assert len({(o["color"], o["shape"], o["size"]) for o in objects}) == 1
        else:
            first, second = objects
            assert m["relation"] in caption and m["count"] is None
            assert caption.index(first["color"] + " " + first["shape"]) < caption.index(m["relation"])
            holds = {"to the left of": first["col"] < second["col"], "to the right of": first["col"] > second["col"],
                     "above": first["row"] < second["row"], "below": first["row"] > second["row"]}
            assert holds[m["relation"]], caption
            assert (first["color"], first["shape"]) != (second["color"], second["shape"])


def test_grammar_words():
    assert GRAMMAR_WORDS == tuple(sorted(set(GRAMMAR_WORDS)))
    assert all(w == w.lower() for w in GRAMMAR_WORDS)
    for word in ("two", "three", "four", "stars", "diamonds", "above", "below", "center", "an", "purple"):
        assert word in GRAMMAR_WORDS
    assert set(GRAMMAR_WORDS) == {w for c in all_captions() for w in c.split()}


@pytest.mark.parametrize("resolution", [32, 64])
def test_tensors(resolution):
    dataset = ShapesDataset("train", 10, resolution)
    for i in range(len(dataset)):
        item = dataset[i]
        image = item["image"]
        assert image.shape == (3, resolution, resolution) and image.dtype == torch.float32
        assert image.min() >= -1 and image.max() <= 1
        assert isinstance(item["caption"], str) and item["caption"]
    with pytest.raises(IndexError):
        dataset[10]


@pytest.mark.parametrize("resolution", [16, 32, 48, 64, 100, 128])
def test_pixels_match_metadata(resolution):
    """Large single objects: the bbox centre has the object's colour, the far corner the background colour."""
    dataset = ShapesDataset("train", 600, resolution, seed=1)
    checked = set()
    for i in range(len(dataset)):
        caption, m = dataset.describe(i)
        o = m["objects"][0]
        if m["kind"] != "single" or o["size"] != "large":
            continue
        image, _, _ = dataset.sample(i)
        assert image.size == (resolution, resolution) and image.mode == "RGB"
        pixels = np.asarray(image).astype(int)
        x0, y0, x1, y1 = o["bbox"]
        assert 0 <= x0 < x1 <= resolution and 0 <= y0 < y1 <= resolution
        assert 0.6 * resolution / 3 <= x1 - x0 <= resolution / 3 + 1  # large: most of the cell
        centre = pixels[(y0 + y1) // 2, (x0 + x1) // 2]
        assert np.abs(centre - COLORS[o["color"]]).max() <= 12, (caption, centre)
        corner = (0, 0) if (o["row"], o["col"]) == (2, 2) else (resolution - 1, resolution - 1)
        assert np.abs(pixels[corner] - BACKGROUNDS[m["background"]]).max() <= 2, caption
        checked.add(o["shape"])
    assert checked == set(SHAPES)


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        ShapesDataset("validation")
    with pytest.raises(ValueError, match="resolution"):
        ShapesDataset("train", resolution=8)


def test_cli_export(tmp_path):
    out = tmp_path / "export"
    run = subprocess.run([sys.executable, "dataset/shapes.py", "--out", str(out), "--split", "heldout", "--n", "3",
                          "--resolution", "48"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "wrote 3 heldout samples" in run.stdout
    dataset = ShapesDataset("heldout", 3, 48)
    for i in range(3):
        image, caption, metadata = dataset.sample(i)
        stem = out / f"{i:06d}"
        with Image.open(f"{stem}.png") as saved:
            assert saved.tobytes() == image.tobytes()
        assert (stem.with_suffix(".txt")).read_text().strip() == caption
        saved_meta = json.loads((stem.with_suffix(".json")).read_text())
        assert saved_meta["caption"] == caption and saved_meta["objects"] == metadata["objects"]


# ----------------------------------------------------------------------------------------------------------------
# User data


def noise_png_bytes(size=64, seed=0):
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def messy_folder(tmp_path):
    root = tmp_path / "data"
    save_png(root / "good.png", Image.new("RGB", (30, 20), (10, 200, 30)))
    (root / "good.txt").write_text("  a green\nrectangle \n")
    exif_jpeg(root / "photo.JPG")
    (root / "photo.txt").write_text("a photo")
    (root / "corrupt.png").write_bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes())
    data = noise_png_bytes()
    (root / "truncated.png").write_bytes(data[: len(data) // 2])
    (root / "empty.png").write_bytes(b"")
    rgba = Image.new("RGBA", (16, 16), (0, 0, 0, 0))  # fully transparent black...
    rgba.paste((200, 0, 0, 255), (0, 0, 8, 16))  # ...with an opaque red left half
    save_png(root / "rgba.png", rgba)
    palette = Image.new("P", (16, 16), 0)
    palette.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)  # index 0 black (transparent), index 1 blue
    palette.paste(1, (8, 0, 16, 16))
    save_png(root / "palette.png", palette, transparency=0)
    save_png(root / "gray16.png", Image.fromarray(np.full((16, 16), 32768, dtype=np.uint16)))
    save_png(root / "uncaptioned.png", Image.new("RGB", (16, 16), (50, 50, 50)))
    save_png(root / "sub" / "deeper" / "nested.webp", Image.new("RGB", (16, 16), (0, 0, 200)), format="WEBP")
    (root / "sub" / "deeper" / "nested.txt").write_text("nested")
    (root / "notes.md").write_text("not an image")
    return root


def test_image_folder(messy_folder):
    lines = []
    dataset = ImageCaptionDataset(str(messy_folder), 16, log=lines.append)
    kept = {os.path.relpath(p, messy_folder): c for p, c in dataset.items}
    assert kept == {"good.png": "a green rectangle", "photo.JPG": "a photo", "rgba.png": "", "palette.png": "",
                    "gray16.png": "", "uncaptioned.png": "", os.path.join("sub", "deeper", "nested.webp"): "nested"}
    assert len(dataset) == 7 and dataset.uncaptioned == 4
    skipped = {reason: sorted(os.path.basename(p) for p in paths) for reason, paths in dataset.skipped.items()}
    assert skipped == {"zero-byte": ["empty.png"], "truncated": ["truncated.png"], "unreadable": ["corrupt.png"]}
    assert len(lines) == 1 and "\n" not in lines[0] and lines[0] == dataset.summary
    for name in ("empty.png", "truncated.png", "corrupt.png", "7 images", "3 skipped", "4 without caption"):
        assert name in lines[0]
    for item in (dataset[i] for i in range(len(dataset))):
        assert item["image"].shape == (3, 16, 16) and item["image"].dtype == torch.float32
        assert -1 <= item["image"].min() and item["image"].max() <= 1


def test_load_image_modes(messy_folder):
    def pixels(name):
        return np.asarray(load_image(str(messy_folder / name), 16)).astype(int)

    # EXIF orientation 6: the red left half ends up on top once rotated for display.
    photo = pixels("photo.JPG")
    assert photo[2, 8, 0] > 200 and photo[2, 8, 2] < 60, photo[2, 8]
    assert photo[13, 8, 2] > 200 and photo[13, 8, 0] < 60, photo[13, 8]
    rgba = pixels("rgba.png")
    assert np.abs(rgba[8, 2] - (200, 0, 0)).max() <= 3 and (rgba[8, 13] == 255).all()  # transparent -> white
    palette = pixels("palette.png")
    assert (palette[8, 2] == 255).all() and np.abs(palette[8, 13] - (0, 0, 255)).max() <= 3
    gray = pixels("gray16.png")  # 32768 / 65535 is mid-grey, not white
    assert np.abs(gray - 128).max() <= 1
    good = load_image(str(messy_folder / "good.png"), 24)  # 30x20 upscaled, then centre-cropped
    assert good.size == (24, 24) and good.mode == "RGB"


def test_manifest(tmp_path, monkeypatch):
    images = tmp_path / "images"
    save_png(images / "a.png", Image.new("RGB", (20, 20), (255, 0, 0)))
    save_png(images / "b.png", Image.new("RGB", (20, 20), (0, 255, 0)))
    manifest = tmp_path / "train.jsonl"
    lines = [{"image": "images/a.png", "caption": "red"}, {"image": str(images / "b.png"), "caption": None},
             {"image": "images/gone.png", "caption": "missing file"}]
    manifest.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    monkeypatch.chdir(images)  # relative paths resolve against the manifest's folder, not the working directory
    logged = []
    dataset = build_dataset(str(manifest), 16, log=logged.append)
    assert isinstance(dataset, ImageCaptionDataset) and len(dataset) == 2
    assert [c for _, c in dataset.items] == ["red", ""] and dataset.uncaptioned == 1
    assert dataset.skipped == {"missing": [str(images / "gone.png")]} and "gone.png" in logged[0]
    assert dataset[0]["image"][0].mean() > 0.99  # red channel of a red image

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n" + json.dumps(lines[1]) + "\n{not json\n")
    with pytest.raises(DatasetError, match="line 3") as error:
        build_dataset(str(bad), 16)
    assert "\n" not in str(error.value)
    bad.write_text(json.dumps({"caption": "no image key"}) + "\n")
    with pytest.raises(DatasetError, match="line 1"):
        build_dataset(str(bad), 16)


def test_dataset_errors(tmp_path):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "caption.txt").write_text("a caption without an image")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "zero.png").write_bytes(b"")
    other = tmp_path / "data.csv"
    other.write_text("image,caption\n")
    cases = [(empty, "no images found"), (tmp_path / "nope", "does not exist"), (broken, "no usable images"),
             (other, "neither a folder nor a .jsonl")]
    for path, message in cases:
        with pytest.raises(DatasetError, match=message) as error:
            build_dataset(str(path), 16, log=lambda line: None)
        assert "\n" not in str(error.value), str(error.value)
    with pytest.raises(DatasetError) as error:
        build_dataset(str(empty), 16)
    assert ".png" in str(error.value) and "recursive" in str(error.value) and str(empty) in str(error.value)


def test_build_builtin():
    logged = []
    dataset = build_dataset("builtin", 32, split="heldout", log=logged.append, num_samples=100, seed=2)
    assert isinstance(dataset, ShapesDataset) and len(dataset) == 100
    assert (dataset.split, dataset.resolution, dataset.seed) == ("heldout", 32, 2) and len(logged) == 1
    assert len(build_dataset("builtin", 32, log=lambda line: None)) == 20000


def test_progress_bar_for_many_files(tmp_path, capsys):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (9, 9, 9)).save(buffer, "PNG")
    for i in range(201):
        (tmp_path / f"{i:03d}.png").write_bytes(buffer.getvalue())
    dataset = ImageCaptionDataset(str(tmp_path), 8)
    captured = capsys.readouterr()
    assert len(dataset) == 201 and "checking" in captured.err  # tqdm writes to stderr
    assert captured.out.strip() == dataset.summary  # the default log is print


def test_builtin_in_a_new_colour_draws_and_names_only_that_colour():
    """--data builtin:white (the LoRA demo): every object white, every caption says so; the scorer reads it."""
    from eval.shape_scorer import COLOR_NAMES, find_objects

    dataset = build_dataset("builtin:white", 32, num_samples=40, log=lambda msg: None)
    assert len(dataset) == 40
    for i in range(len(dataset)):
        image, caption, metadata = dataset.sample(i)
        assert all(o["color"] == "white" for o in metadata["objects"]) and "white" in caption.split()
        found = find_objects(np.asarray(image), COLOR_NAMES + ("white",))
        assert sorted((o["row"], o["col"], o["color"], o["shape"]) for o in found) == sorted(
            (o["row"], o["col"], "white", o["shape"]) for o in metadata["objects"]), caption
    prompts = dataset.sample_prompts()
    assert sum("white" in p for p in prompts) == 8 and "" in prompts
    # plain builtin is still the usual palette
    assert build_dataset("builtin", 32, num_samples=4, log=lambda msg: None).describe(0) == \
        ShapesDataset("train", 4, 32).describe(0)
    with pytest.raises(DatasetError, match="--data builtin:mauve: unknown colour mauve"):
        build_dataset("builtin:mauve", 32, log=lambda msg: None)


def test_files_of_other_types_are_counted_in_the_summary_not_passed_over_in_silence(tmp_path):
    """An animated .gif with its caption, a stray caption and a notes file: none of them trains, and the summary line
    says so, by kind."""
    save_png(tmp_path / "kept.png", Image.new("RGB", (16, 16), (200, 0, 0)))
    (tmp_path / "kept.txt").write_text("a red square")
    frames = [Image.new("RGB", (16, 16), color) for color in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "moving.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    (tmp_path / "moving.txt").write_text("a blinking square")
    (tmp_path / "notes.md").write_text("not an image")
    lines = []
    dataset = ImageCaptionDataset(str(tmp_path), 16, log=lines.append)
    assert len(dataset) == 1 and dataset.ignored == {".gif": 1, ".md": 1, ".txt without an image": 1}
    assert lines == [dataset.summary] and "1 images, 0 skipped, not read: 1 .gif, 1 .md, 1 .txt without an image " \
        "(images must be .png, .jpg, .jpeg, .webp), 0 without caption" in lines[0]
    only_gif = tmp_path / "only_gif"
    only_gif.mkdir()
    frames[0].save(only_gif / "moving.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    with pytest.raises(DatasetError, match=r"no images found in .*only_gif \(found 1 \.gif\)"):
        ImageCaptionDataset(str(only_gif), 16)
