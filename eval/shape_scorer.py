"""Find the objects in an image of the built-in world: their colour, shape, size and grid cell.

The built-in data puts at most one object in each cell of a 3x3 grid, centred, on a grey background, in one of
8 palette colours, so an exact reading needs no learnt detector:

1. Colour. Each pixel is explained as a blend of one palette colour with the background,
   pixel = bg + alpha * (colour - bg). The colour with the smallest residual wins, and alpha is how much of the
   pixel it covers, so anti-aliased edges count in part.
2. Presence. A cell holds an object if its dominant colour covers at least half the area of the smallest object
   the renderer draws (a small star).
3. Shape and size. The cell's coverage map of that colour is compared (L1) with the renderer's own outlines for
   every shape and size, each shifted by up to one pixel. The closest template wins. When even the closest is
   far off (normalised distance above REJECT_DISTANCE), the shape is None: a blob is no shape.

Ground-truth images are read exactly (tests/test_geneval.py). Generated images are read as well as they
resemble the renderer's objects, which is the question the scores ask.
"""
import numpy as np
from PIL import Image, ImageDraw

from dataset.shapes import ALL_COLORS, BACKGROUNDS, COLORS, POSITIONS, SHAPES, SIZES, SUPERSAMPLE, draw_object

COLOR_NAMES = tuple(COLORS)
BACKGROUND = np.array(BACKGROUNDS["gray"], dtype=np.float32)
# L1 distance between a cell's coverage and the best template, over the template's area. Ground truth: 0.
# Single objects from the default run: 0.03-0.38 when right, mostly 0.27-0.33 when wrong.
REJECT_DISTANCE = 0.4
SHIFTS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]


def colour_coverage(image, colors=COLOR_NAMES):
    """uint8 [H, W, 3] -> (index in `colors` of each pixel's colour [H, W], the part of the pixel it covers [H, W])."""
    pixel = image.astype(np.float32)[..., None, :] - BACKGROUND  # [H, W, 1, 3]
    direction = np.array([ALL_COLORS[c] for c in colors], dtype=np.float32) - BACKGROUND  # [K, 3]
    alpha = np.clip((pixel * direction).sum(-1) / (direction * direction).sum(-1), 0, 1)  # [H, W, K]
    residual = ((pixel - alpha[..., None] * direction) ** 2).sum(-1)
    best = residual.argmin(-1)
    return best, np.take_along_axis(alpha, best[..., None], -1)[..., 0]


def cell_slices(resolution, cell):
    edges = [round(k * resolution / 3) for k in range(4)]
    row, col = divmod(cell, 3)
    return slice(edges[row], edges[row + 1]), slice(edges[col], edges[col + 1])


_TEMPLATES = {}


def templates(resolution):
    """-> ({(cell, shape, size): the cell's coverage [9 shifts, h, w] in [0, 1]}, the least coverage an object
    must have), drawn exactly as the renderer draws objects; made once per resolution."""
    if resolution not in _TEMPLATES:
        table, big = {}, resolution * SUPERSAMPLE
        for cell in range(9):
            rows, cols = cell_slices(resolution, cell)
            for shape in SHAPES:
                for size in SIZES:
                    canvas = Image.new("L", (big, big), 0)
                    draw_object(ImageDraw.Draw(canvas), {"shape": shape, "size": size, "row": cell // 3,
                                                         "col": cell % 3}, resolution, fill=255)
                    small = canvas.resize((resolution, resolution), Image.Resampling.BOX)
                    template = (np.asarray(small, dtype=np.float32) / 255)[rows, cols]
                    table[(cell, shape, size)] = np.stack([np.roll(template, shift, (0, 1)) for shift in SHIFTS])
        min_coverage = 0.5 * min(t[0].sum() for t in table.values())
        _TEMPLATES[resolution] = table, min_coverage
    return _TEMPLATES[resolution]


def find_objects(image, colors=COLOR_NAMES):
    """uint8 [H, W, 3] (square) -> [{"color", "shape" (None if unrecognised), "size", "row", "col", "position",
    "distance"}], one per occupied cell, row-major. `colors`: the palette to read (e.g. with a colour taught by
    a LoRA added)."""
    resolution = image.shape[0]
    table, min_coverage = templates(resolution)
    colour, alpha = colour_coverage(image, colors)
    found = []
    for cell in range(9):
        rows, cols = cell_slices(resolution, cell)
        cell_colour, cell_alpha = colour[rows, cols], alpha[rows, cols]
        per_colour = np.bincount(cell_colour.ravel(), weights=cell_alpha.ravel(), minlength=len(colors))
        k = int(per_colour.argmax())
        if per_colour[k] < min_coverage:
            continue
        coverage = np.where(cell_colour == k, cell_alpha, 0)
        best, best_distance = None, np.inf
        for shape in SHAPES:
            for size in SIZES:
                shifted = table[(cell, shape, size)]
                distance = np.abs(shifted - coverage).sum((1, 2)).min() / shifted[0].sum()
                if distance < best_distance:
                    best, best_distance = (shape, size), distance
        shape, size = best if best_distance <= REJECT_DISTANCE else (None, best[1])
        found.append({"color": colors[k], "shape": shape, "size": size, "row": cell // 3, "col": cell % 3,
                      "position": POSITIONS[cell], "distance": round(float(best_distance), 4)})
    return found
