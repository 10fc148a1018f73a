"""Built-in data: captioned images of coloured shapes, drawn procedurally and deterministically (no download).

Three kinds of sample, each captioned from a small grammar:
    single    "a small red circle at the top left", "a large blue star in the center"
    relation  "a blue square to the left of a yellow triangle" (also "to the right of", "above", "below")
    count     "three green stars" (2-4 identical objects in distinct cells)
Objects sit centred in the cells of a 3x3 grid. A few (colour, shape) pairs are held out of training entirely, so
the "heldout" split measures compositional generalisation. Sample i is a pure function of (seed, split, i,
resolution), and its metadata says exactly what was drawn where, so generated images can be scored exactly.

Export samples to look at them:
    python dataset/shapes.py --out /tmp/shapes --split heldout --n 64 --resolution 64 --grid /tmp/grid.png
"""
import argparse
import json
import math
import os
import random
from collections import Counter

import numpy as np
import torch
from PIL import Image, ImageDraw

# ----------------------------------------------------------------------------------------------------------------
# Vocabulary of the world

# Saturated colours spread round the hue circle (red 0, orange ~33, yellow ~52, green ~128, cyan ~186, blue ~228,
# purple ~276, pink ~330 degrees) so every pair is told apart by hue alone.
COLORS = {
    "red": (220, 30, 30),
    "orange": (255, 140, 0),
    "yellow": (250, 220, 20),
    "green": (30, 170, 50),
    "cyan": (0, 200, 220),
    "blue": (30, 70, 230),
    "purple": (140, 50, 200),
    "pink": (255, 105, 180),
}
# Colours the default data never draws: `--data builtin:white` is the built-in world in white only, for the LoRA
# demo (teaching the pretrained model a word it never saw). White is far from every palette colour and the grey.
NEW_COLORS = {
    "white": (235, 235, 235),
}
ALL_COLORS = {**COLORS, **NEW_COLORS}
SHAPES = ("circle", "square", "triangle", "star", "diamond")
SIZES = ("small", "large")
# 3x3 grid cells, row-major, named as they appear in captions.
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
POSITION_CELLS = {name: divmod(k, 3) for k, name in enumerate(POSITIONS)}  # name -> (row, col)
# A neutral background (zero saturation), so no object colour is ever confused with it. Just one: captions do
# not name the background, and with four greys the tiny model spent its whole CPU budget learning to guess the
# background from noise before it drew objects (BENCHMARKS.md). Add entries here for a harder dataset.
BACKGROUNDS = {
    "gray": (96, 96, 96),
}
# Never drawn in the train split, always present in the heldout split. Each colour and each shape still appears
# in training with other partners, so the pairs are novel combinations of known words.
HELD_OUT_PAIRS = frozenset({("purple", "triangle"), ("orange", "circle"), ("cyan", "star")})

KINDS = ("single", "relation", "count")
KIND_WEIGHTS = (0.4, 0.3, 0.3)
# relation phrase -> predicate on the (row, col) cells of the first and second object
RELATIONS = {
    "to the left of": lambda a, b: a[1] < b[1],
    "to the right of": lambda a, b: a[1] > b[1],
    "above": lambda a, b: a[0] < b[0],
    "below": lambda a, b: a[0] > b[0],
}
NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}
SPLITS = ("train", "heldout")
# Bump when what a sample looks like or says changes: caches of the built-in data are keyed by it.
SHAPES_VERSION = 1
SUPERSAMPLE = 4  # draw at 4x and box-filter down: exact area-coverage anti-aliasing, no ringing

# ----------------------------------------------------------------------------------------------------------------
# Captions


def where_phrase(position):
    if position == "center":
        return "in the center"
    if position in ("left", "right"):
        return f"on the {position}"
    return f"at the {position}"


def article(word):
    return "an" if word[0] in "aeiou" else "a"  # "an orange star"


def single_caption(color, shape, size, position):
    return f"a {size} {color} {shape} {where_phrase(position)}"


def relation_caption(first, relation, second):
    """first/second are (color, shape) pairs."""
    return f"{article(first[0])} {first[0]} {first[1]} {relation} {article(second[0])} {second[0]} {second[1]}"


def count_caption(count, color, shape):
    return f"{NUMBER_WORDS[count]} {color} {shape}s"


def all_captions():
    """Every caption the grammar can form (7,240): a superset of those sampled (held-out and same-pair included)."""
    pairs = [(c, s) for c in COLORS for s in SHAPES]
    for color, shape in pairs:
        for size in SIZES:
            for position in POSITIONS:
                yield single_caption(color, shape, size, position)
        for count in NUMBER_WORDS:
            yield count_caption(count, color, shape)
    for first in pairs:
        for relation in RELATIONS:
            for second in pairs:
                yield relation_caption(first, relation, second)


# The built-in tokenizer's vocabulary: every word a caption can contain (plurals and number words included).
GRAMMAR_WORDS = tuple(sorted({word for caption in all_captions() for word in caption.split()}))
MAX_CAPTION_WORDS = max(len(caption.split()) for caption in all_captions())

# ----------------------------------------------------------------------------------------------------------------
# Layout: what goes where (no pixels yet)


def _random_object(rng, colors, size=None):
    return {"color": rng.choice(colors), "shape": rng.choice(SHAPES), "size": size or rng.choice(SIZES)}


def _place(obj, cell):
    row, col = divmod(cell, 3)
    return {**obj, "position": POSITIONS[cell], "row": row, "col": col}


def _random_layout(rng, kind, colors):
    """One draw of (objects, count, relation) for a sample of this kind, in the given colours."""
    if kind == "single":
        return [_place(_random_object(rng, colors), rng.randrange(9))], None, None
    if kind == "relation":
        relation = rng.choice(list(RELATIONS))
        holds = RELATIONS[relation]
        cells = [(a, b) for a in range(9) for b in range(9) if holds(divmod(a, 3), divmod(b, 3))]
        a, b = rng.choice(cells)
        return [_place(_random_object(rng, colors), a), _place(_random_object(rng, colors), b)], None, relation
    count = rng.choice(list(NUMBER_WORDS))
    obj = _random_object(rng, colors)
    return [_place(obj, cell) for cell in sorted(rng.sample(range(9), count))], count, None


def object_geometry(obj, resolution):
    """Outline of one object in output pixels: ("ellipse", [(x0, y0), (x1, y1)]) or ("polygon", points)."""
    cell = resolution / 3
    cx, cy = (obj["col"] + 0.5) * cell, (obj["row"] + 0.5) * cell
    # Half-side: large spans 80% of the cell, small 45% (a bit over half, to stay legible at 32px).
    h = (0.4 if obj["size"] == "large" else 0.225) * cell
    shape = obj["shape"]
    if shape == "circle":
        return "ellipse", [(cx - h, cy - h), (cx + h, cy + h)]
    if shape == "square":
        points = [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    elif shape == "triangle":  # pointing up, filling the box
        points = [(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    elif shape == "diamond":  # the square turned 45 degrees
        points = [(cx, cy - h), (cx + h, cy), (cx, cy + h), (cx - h, cy)]
    elif shape == "star":  # 5 points, fat inner radius so it still reads as a star when a few pixels wide
        dy = h * (1 - math.cos(math.pi / 5)) / 2  # the tips reach up to h but down only h*cos(36deg): re-centre
        points = []
        for k in range(10):
            r = h if k % 2 == 0 else 0.5 * h
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + r * math.cos(angle), cy + dy + r * math.sin(angle)))
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return "polygon", points


def draw_object(draw, obj, resolution, fill):
    """Draw one object's outline on a PIL ImageDraw of a canvas SUPERSAMPLE times the output resolution."""
    kind, points = object_geometry(obj, resolution)
    points = [(x * SUPERSAMPLE, y * SUPERSAMPLE) for x, y in points]
    (draw.ellipse if kind == "ellipse" else draw.polygon)(points, fill=fill)


def _bbox(points, resolution):
    """Smallest whole-pixel box [x0, y0, x1, y1] (x1, y1 exclusive) that contains the outline."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return [max(0, math.floor(min(xs))), max(0, math.floor(min(ys))),
            min(resolution, math.ceil(max(xs))), min(resolution, math.ceil(max(ys)))]


def image_to_tensor(image):
    """PIL RGB -> float32 tensor [3, H, W] in [-1, 1]."""
    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div(127.5).sub(1.0)


# Fixed prompts for the sample grids of runs on the default data: single objects, relations and counts. Purple
# triangles, orange circles and cyan stars are held-out pairs: they never appear in training. The last prompt is
# unconditional.
SAMPLE_PROMPTS = [
    "a large red circle in the center", "a small blue square at the top left", "a large yellow star at the bottom",
    "a small green diamond on the right", "a large purple triangle in the center", "a large orange circle on the left",
    "a blue square to the left of a yellow triangle", "a red star above a green circle",
    "a pink diamond below an orange square", "a cyan star to the right of a purple circle",
    "two green stars", "three red circles", "four blue squares", "two purple triangles", "three pink diamonds",
    "",
]

# ----------------------------------------------------------------------------------------------------------------
# The dataset


class ShapesDataset(torch.utils.data.Dataset):
    """Deterministic captioned shapes. Items are {"image": [3, H, W] in [-1, 1], "caption": str}."""

    def __init__(self, split="train", num_samples=20000, resolution=32, seed=0, colors=None):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if resolution < 16:
            raise ValueError(f"resolution must be at least 16 (3x3 grid of recognisable shapes), got {resolution}")
        self.colors = tuple(colors or COLORS)  # the default data draws every palette colour
        unknown = [c for c in self.colors if c not in ALL_COLORS]
        if unknown:
            raise ValueError(f"unknown colour {', '.join(unknown)}; the built-in colours are {', '.join(ALL_COLORS)}")
        if split == "heldout" and not any((c, s) in HELD_OUT_PAIRS for c in self.colors for s in SHAPES):
            raise ValueError(f"no held-out pair has the colours {', '.join(self.colors)}")
        self.split, self.num_samples, self.resolution, self.seed = split, int(num_samples), int(resolution), seed

    def __len__(self):
        return self.num_samples

    def describe(self, i):
        """(caption, metadata) of sample i without drawing it: cheap, for scoring and statistics."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        # A string seed is hashed with SHA-512, so the stream is the same on every machine and Python version.
        rng = random.Random(f"{self.seed}-{self.split}-{i}")
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        background = rng.choice(list(BACKGROUNDS))
        want_held_out = self.split == "heldout"
        while True:  # rejection sampling keeps each split an exact conditional of the same distribution
            objects, count, relation = _random_layout(rng, kind, self.colors)
            pairs = [(o["color"], o["shape"]) for o in objects]
            if kind == "relation" and pairs[0] == pairs[1]:
                continue  # "a red star to the left of a red star" would not say which star is which
            if any(p in HELD_OUT_PAIRS for p in pairs) == want_held_out:
                break
        o = objects[0]
        if kind == "single":
            caption = single_caption(o["color"], o["shape"], o["size"], o["position"])
        elif kind == "relation":
            caption = relation_caption(pairs[0], relation, pairs[1])
        else:
            caption = count_caption(count, o["color"], o["shape"])
        for obj in objects:
            obj["bbox"] = _bbox(object_geometry(obj, self.resolution)[1], self.resolution)
        metadata = {"kind": kind, "background": background, "objects": objects, "count": count, "relation": relation}
        return caption, metadata

    def render(self, metadata):
        """Draw the objects of a metadata dict at 4x and box-filter down to resolution x resolution."""
        size = self.resolution * SUPERSAMPLE
        canvas = Image.new("RGB", (size, size), BACKGROUNDS[metadata["background"]])
        draw = ImageDraw.Draw(canvas)
        for obj in metadata["objects"]:
            draw_object(draw, obj, self.resolution, ALL_COLORS[obj["color"]])
        return canvas.resize((self.resolution, self.resolution), Image.Resampling.BOX)

    def sample(self, i):
        """(PIL RGB image, caption, metadata) of sample i."""
        caption, metadata = self.describe(i)
        return self.render(metadata), caption, metadata

    def __getitem__(self, i):
        image, caption, _ = self.sample(i)
        return {"image": image_to_tensor(image), "caption": caption}

    def sample_prompts(self):
        """Fixed prompts for the sample grids of a run on this data. In other colours than the default's (the
        LoRA demo): every shape and some counts in the first of them, then default prompts to show what else
        the model still draws."""
        if set(self.colors) == set(COLORS):
            return list(SAMPLE_PROMPTS)
        color = self.colors[0]
        where = ["center", "top left", "bottom", "right", "center"]
        own = [single_caption(color, shape, size, position)
               for shape, size, position in zip(SHAPES, ("large", "small", "large", "small", "large"), where)]
        own += [count_caption(2, color, "star"), count_caption(3, color, "circle"),
                relation_caption((color, "square"), "to the left of", ("yellow", "triangle"))]
        return own + SAMPLE_PROMPTS[:6] + SAMPLE_PROMPTS[10:11] + SAMPLE_PROMPTS[-1:]


# ----------------------------------------------------------------------------------------------------------------
# Export to files for a look (and for tools that want a folder)


def make_grid(images, columns, gap=2, fill=(255, 255, 255)):
    """Tile equal-sized PIL images row by row with a gap between them."""
    w, h = images[0].size
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * (w + gap) - gap, rows * (h + gap) - gap), fill)
    for k, image in enumerate(images):
        grid.paste(image, ((k % columns) * (w + gap), (k // columns) * (h + gap)))
    return grid


def main():
    parser = argparse.ArgumentParser(description="Write built-in shapes samples as NNNNNN.png/.txt/.json files.")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--split", default="train", choices=SPLITS)
    parser.add_argument("--n", type=int, default=64, help="number of samples (indices 0..n-1)")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--colors", default=None, help="only these colours, comma separated (e.g. white, which "
                        "the default data never shows)")
    parser.add_argument("--grid", default=None, help="also write all samples tiled into this one PNG")
    args = parser.parse_args()

    dataset = ShapesDataset(args.split, args.n, args.resolution, args.seed,
                            colors=args.colors.split(",") if args.colors else None)
    os.makedirs(args.out, exist_ok=True)
    kinds, held_out, images = Counter(), 0, []
    for i in range(len(dataset)):
        image, caption, metadata = dataset.sample(i)
        stem = os.path.join(args.out, f"{i:06d}")
        image.save(stem + ".png")
        with open(stem + ".txt", "w", encoding="utf-8") as f:
            f.write(caption + "\n")
        with open(stem + ".json", "w", encoding="utf-8") as f:
            json.dump({"caption": caption, **metadata}, f, indent=1)
        kinds[metadata["kind"]] += 1
        held_out += any((o["color"], o["shape"]) in HELD_OUT_PAIRS for o in metadata["objects"])
        if args.grid:
            images.append(image)
    mix = ", ".join(f"{kinds[k]} {k}" for k in KINDS)
    print(f"wrote {len(dataset)} {args.split} samples at {args.resolution}px to {args.out} ({mix}; "
          f"{held_out} with a held-out pair)")
    if args.grid and images:
        make_grid(images, columns=math.ceil(math.sqrt(len(images)))).save(args.grid)
        print(f"wrote grid {args.grid}")


if __name__ == "__main__":
    main()
