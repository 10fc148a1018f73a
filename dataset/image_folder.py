"""User data: a folder of images with same-name .txt captions, or a .jsonl manifest. Plus build_dataset().

Every file is decoded once when the dataset is built, so a broken file is reported up front (one summary line)
instead of crashing a training run hours in. Images come out as RGB: EXIF orientation applied, transparency
composited on white, 16-bit scaled to 8-bit, resized to cover the output size and centre-cropped to it. The output is
a resolution x resolution square, or with aspect-ratio buckets the bucket size nearest the image's shape.

Aspect-ratio buckets: user images keep (about) their shape instead of all being centre-cropped to squares. A few
bucket sizes (width, height) share about the same area, so a batch costs about the same memory in any bucket. Each
image goes to the bucket whose aspect ratio is nearest its own, and every micro-batch is drawn from one bucket, so
its images stack into one tensor (BucketBatches in trainer/mechanics/position.py plans them).
"""
import copy
import json
import math
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, JpegImagePlugin
from tqdm import tqdm

from dataset.shapes import ShapesDataset, image_to_tensor
from model.errors import UserError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")  # matched case-insensitively
SKIP_REASONS = ("missing", "zero-byte", "truncated", "unreadable")  # the order they are listed in the summary
PROGRESS_MIN_FILES = 200  # show a progress bar while checking more files than this
MAX_NAMES_LISTED = 5  # per skip reason in the summary line
CHECK_THREADS = 8  # Pillow releases the GIL while decoding, so threads overlap file reads and decodes
TURNING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that turn the picture by 90 degrees for display

MASK_SUFFIX = ".mask"  # NAME.mask.png beside NAME.png: white = train, black = ignore, grey = weight
REPEATS_FOLDER = re.compile(r"(\d+)_(.+)")  # kohya's convention: a folder 3_name is seen 3 times an epoch

MAX_AREA_FACTOR = 1.1  # a bucket may exceed resolution^2 by this much: sides are rounded to a multiple, not floored

LOOKED_FOR = f"looked recursively for {', '.join(IMAGE_EXTENSIONS)} files (any letter case)"
HOW_TO = "pass a folder of images with same-name .txt captions, a .jsonl manifest, or 'builtin'"


class DatasetError(UserError):
    """A problem with the user's data. The message is one line: what was looked for and what to do."""


# ----------------------------------------------------------------------------------------------------------------
# Loading one image


def to_rgb(img):
    """Any PIL mode -> RGB, with transparency composited on white and 16-bit values scaled (not clipped) to 8-bit."""
    if img.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N"):
        # Pillow's own I;16 -> L conversion clips at 255, which turns any 16-bit image nearly white.
        array = np.asarray(img, dtype=np.float64) / 257.0  # 0..65535 -> 0..255
        img = Image.fromarray(np.clip(np.rint(array), 0, 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")  # also resolves palette and colour-key transparency into an alpha channel
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def read_image(path, target):
    """-> (the decoded RGB image as displayed, its full size (width, height) as displayed). A JPEG may be decoded
    at a reduced scale that stays >= 2x the target size (width, height), so only the second is the true size."""
    with Image.open(path) as img:
        full_size = img.size  # from the header: the draft below can make the decoded JPEG smaller
        draft_w, draft_h = target
        # The draft sizes the stored pixels, which may display turned. Asked of JPEGs only: draft() affects no
        # other format, and a JPEG has its EXIF before the pixels (read early elsewhere, a late tag could be missed).
        if draft_w != draft_h and isinstance(img, JpegImagePlugin.JpegImageFile):
            if img.getexif().get(ExifTags.Base.Orientation, 1) in TURNING_ORIENTATIONS:
                draft_w, draft_h = draft_h, draft_w
        # JPEG only (a no-op elsewhere): decode at a 1/2, 1/4 or 1/8 scale that stays >= 2x the target, which
        # makes big photos several times faster to read and loses nothing after the LANCZOS resize.
        img.draft(None, (2 * draft_w, 2 * draft_h))
        displayed = ImageOps.exif_transpose(img)  # phone photos store rotation as a tag, not in the pixels
        if img.getexif().get(ExifTags.Base.Orientation, 1) in TURNING_ORIENTATIONS:
            full_size = full_size[::-1]
        return to_rgb(displayed), full_size


def cover_and_crop(img, size):
    """Resize to cover size (width, height) and centre-crop to exactly it, in one LANCZOS pass: the resize reads
    only the largest centred box of the target's aspect ratio."""
    w, h = img.size
    target_w, target_h = size
    if w * target_h > h * target_w:  # wider than the target: the box spans the full height
        box_w, box_h = h * target_w / target_h, h
    else:
        box_w, box_h = w, w * target_h / target_w
    box = ((w - box_w) / 2, (h - box_h) / 2, (w + box_w) / 2, (h + box_h) / 2)
    return img.resize(size, Image.Resampling.LANCZOS, box=box)


def load_image(path, resolution, size=None):
    """Open an image file as a PIL RGB image of size (width, height), by default resolution x resolution, resized
    to cover it and centre-cropped."""
    size = tuple(size) if size is not None else (resolution, resolution)
    return cover_and_crop(read_image(path, size)[0], size)


def check_image(path, resolution):
    """(reason, None) when this file cannot be used (reason is one of SKIP_REASONS), else (None, its size as
    displayed: (width, height) after the EXIF orientation)."""
    if not os.path.isfile(path):
        return "missing", None
    if os.path.getsize(path) == 0:
        return "zero-byte", None
    try:
        # A full decode: truncation only shows when the pixel data is read.
        _, size = read_image(path, (resolution, resolution))
    except Exception as e:  # any decoder failure makes the file unusable; which one only matters for the report
        return ("truncated" if "truncated" in str(e) else "unreadable"), None
    return None, size


# ----------------------------------------------------------------------------------------------------------------
# Finding images and captions


def clean_caption(text):
    return " ".join(text.split())  # one line, single spaces: a caption file may end in a newline or wrap lines


@dataclass(frozen=True)
class CaptionOptions:
    """How captions are read: `per_line` (a .txt holds one caption per line, as kohya and OneTrainer read them;
    else its lines are joined into one), and a `prefix` / `suffix` put on every caption (a trigger word)."""
    prefix: str = ""
    suffix: str = ""
    per_line: bool = False

    def read(self, text):
        """The raw text of a caption file (or a manifest's caption: a string, a list, or None) -> its captions,
        prefixed and suffixed: at least one, "" when there is none."""
        if isinstance(text, list):
            raw = [clean_caption(t) for t in text]
        elif self.per_line:
            raw = [clean_caption(line) for line in (text or "").splitlines()]
        else:
            raw = [clean_caption(text or "")]
        return [clean_caption(self.prefix + c + self.suffix) for c in [c for c in raw if c] or [""]]


def is_mask_file(path):
    return os.path.splitext(os.path.splitext(path)[0])[1].lower() == MASK_SUFFIX


def mask_beside(path):
    """NAME.mask.<any image extension> beside NAME.<ext>, or None."""
    stem = os.path.splitext(path)[0] + MASK_SUFFIX
    for ext in IMAGE_EXTENSIONS:
        for candidate in (stem + ext, stem + ext.upper()):
            if os.path.isfile(candidate):
                return candidate
    return None


def top_folder(root, path):
    """The folder right under `root` that holds `path`, or None for a file in `root` itself."""
    parts = os.path.relpath(path, root).split(os.sep)
    return parts[0] if len(parts) > 1 else None


def folder_repeats(root, paths):
    """kohya's repeats: an image under a top folder named N_name is seen N times an epoch. -> (repeats per path,
    the top folders seen once for want of a prefix: beside N_ folders every other one, else those whose name
    starts with a digit but is no N_ prefix). A 0_ folder is an error."""
    tops = [top_folder(root, path) for path in paths]
    counts = {}
    for top in set(tops) - {None}:
        match = REPEATS_FOLDER.fullmatch(top)
        if match and int(match.group(1)) == 0:
            raise DatasetError(f"folder {os.path.join(root, top)}: a 0_ prefix would never show its images; "
                               "rename it 1_... (or more) or move it out of the data")
        counts[top] = int(match.group(1)) if match else None
    prefixed = any(counts.values())
    odd = sorted(top for top, n in counts.items() if n is None and (prefixed or top[:1].isdigit()))
    return [counts.get(top) or 1 for top in tops], odd


def find_images(root):
    """-> ((image path, caption text) for every image under root, sorted, the text being the same-name .txt's or
    "" (NAME.mask.png files are masks, not images); {kind: count} of the files passed over: other file types by
    extension, captions without an image)."""
    paths, others = [], []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, .ipynb_checkpoints, ... hold no data
        # Dot-files are skipped too: macOS "._name.png" resource forks look like images but are not.
        for name in (f for f in files if not f.startswith(".")):
            if name.lower().endswith(IMAGE_EXTENSIONS):
                (others if is_mask_file(name) else paths).append(os.path.join(folder, name))
            else:
                others.append(os.path.join(folder, name))
    items = []
    for path in sorted(paths):
        caption_path = os.path.splitext(path)[0] + ".txt"
        caption = ""
        if os.path.isfile(caption_path):
            with open(caption_path, encoding="utf-8-sig", errors="replace") as f:
                caption = f.read()
        items.append((path, caption))
    captions = {os.path.splitext(path)[0] + ".txt" for path in paths}
    ignored = Counter(".txt without an image" if path.lower().endswith(".txt") else
                      os.path.splitext(path)[1].lower() or "file without extension"
                      for path in others if path not in captions and not is_mask_file(path))
    return items, dict(sorted(ignored.items()))


def read_prompt_file(path):
    """One prompt per non-empty line."""
    if not os.path.isfile(path):
        raise DatasetError(f"prompt file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def describe_ignored(ignored):
    """{kind: count} -> "2 .gif, 1 .txt without an image"."""
    return ", ".join(f"{count} {kind}" for kind, count in ignored.items())


def read_image_list(path):
    """(image path, caption text or list, repeats, mask path or None) for each line {"image": ..., "caption": ...,
    optionally "repeats": N, "mask": ...}; paths are relative to the file."""
    root = os.path.dirname(os.path.abspath(path))
    items = []
    with open(path, encoding="utf-8-sig") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {line_number} is not valid JSON ({e.msg}): expected "
                                   '{"image": "relative/or/absolute.png", "caption": "..."} on every line') from None
            caption = entry.get("caption") if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or not isinstance(entry.get("image"), str) or not (
                    isinstance(caption, (str, type(None))) or
                    (isinstance(caption, list) and caption and all(isinstance(c, str) for c in caption))):
                raise DatasetError(f"{path} line {line_number} is not an object with a string \"image\" and an "
                                   f"optional string (or list of strings) \"caption\": {line.strip()[:80]}")
            repeats, mask = entry.get("repeats", 1), entry.get("mask")
            if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
                raise DatasetError(f"{path} line {line_number}: \"repeats\" must be a whole number >= 1, got "
                                   f"{repeats!r}")
            if mask is not None and not isinstance(mask, str):
                raise DatasetError(f"{path} line {line_number}: \"mask\" must be the path of an image")
            # os.path.join keeps an absolute path as it is
            items.append((os.path.join(root, os.path.expanduser(entry["image"])), caption or "", repeats,
                          os.path.join(root, os.path.expanduser(mask)) if mask else None))
    return items


# ----------------------------------------------------------------------------------------------------------------
# Aspect-ratio buckets: their sizes, the one each image goes to, each sample's


def _nearest_size(ideal_w, ideal_h, multiple, max_area, max_ratio):
    """The (w, h), both multiples of `multiple`, with area <= max_area and w / h <= max_ratio, nearest (ideal_w,
    ideal_h) in log space."""
    def near(ideal):  # a window of whole multiples round the ideal side, never below one multiple
        low = max(1, math.floor(ideal / multiple) - 1)
        return range(low, math.ceil(ideal / multiple) + 2)

    candidates = [(1, 1)]  # multiple x multiple always fits, since resolution is a multiple of it
    candidates += [(w, h) for w in near(ideal_w) for h in near(ideal_h)
                   if w * h * multiple ** 2 <= max_area and w <= h * max_ratio]
    # Distance in log space weighs aspect-ratio error and area error alike: log w + log h is the log area.
    w, h = min(candidates, key=lambda c: (math.log(c[0] * multiple / ideal_w) ** 2
                                          + math.log(c[1] * multiple / ideal_h) ** 2))
    return w * multiple, h * multiple


def bucket_sizes(resolution, multiple, max_ratio=2.0, count=7):
    """(width, height) pairs with area about resolution^2 (at most MAX_AREA_FACTOR times it), both sides multiples
    of `multiple` (the latent downscale times the patch size), aspect ratios spread evenly in log space from
    1/max_ratio to max_ratio. The middle one is the square (resolution, resolution). Tall and wide sizes mirror
    each other. Deduplicated (a coarse multiple can round neighbours to the same size), sorted by aspect ratio."""
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"bucket multiple must be a positive integer, got {multiple!r}")
    if not isinstance(resolution, int) or resolution < multiple or resolution % multiple:
        raise ValueError(f"resolution {resolution!r} must be a positive multiple of {multiple} (the latent "
                         "downscale times the patch size)")
    if not isinstance(count, int) or count < 1 or count % 2 == 0:
        raise ValueError(f"bucket count must be odd and >= 1 (symmetric round the square), got {count!r}")
    if not max_ratio >= 1:
        raise ValueError(f"max aspect ratio must be >= 1 (longer side / shorter side), got {max_ratio!r}")
    max_area = resolution ** 2 * MAX_AREA_FACTOR
    sizes = {(resolution, resolution)}
    for k in range(1, count // 2 + 1):
        ratio = max_ratio ** (k / (count // 2))  # width / height, > 1
        # Only the wide sizes are searched; the tall ones are their transposes, so the set is exactly symmetric.
        w, h = _nearest_size(resolution * math.sqrt(ratio), resolution / math.sqrt(ratio), multiple, max_area,
                              max_ratio)
        sizes |= {(w, h), (h, w)}
    return sorted(sizes, key=lambda size: size[0] / size[1])


def nearest_bucket(width, height, sizes):
    """Index in `sizes` of the size whose aspect ratio is nearest width / height in log space (the first on a
    tie): in log space a 2:1 image is as far from 1:1 as a 1:2 one."""
    log_ratio = math.log(width / height)
    return min(range(len(sizes)), key=lambda i: abs(math.log(sizes[i][0] / sizes[i][1]) - log_ratio))


def bucket_layout(dataset, resolution):
    """-> (bucket of each sample, bucket sizes): the image size every sample comes at. Squares of the resolution
    for unbucketed data; the parts of a concatenation (LoRA's prior data) share buckets of the same size."""
    sizes, bucket_of = [], []
    for part in dataset.datasets if isinstance(dataset, torch.utils.data.ConcatDataset) else [dataset]:
        part_sizes = [tuple(size) for size in (getattr(part, "bucket_sizes", None) or [(resolution, resolution)])]
        for size in part_sizes:
            if size not in sizes:
                sizes.append(size)
        part_of = getattr(part, "bucket_of", None) or [0] * len(part)
        bucket_of += [sizes.index(part_sizes[b]) for b in part_of]
    return bucket_of, sizes


# ----------------------------------------------------------------------------------------------------------------
# The dataset


class ImageCaptionDataset(torch.utils.data.Dataset):
    """User images with captions. Items are {"image": [3, H, W] in [-1, 1], "caption": str ("" = unconditional)},
    and "mask" [1, H, W] in [0, 1] when any image has one (NAME.mask.png; 1 where an image has none).

    buckets: None for resolution x resolution squares, or a list of (width, height) sizes (bucket_sizes):
    each image then comes out at the size whose aspect ratio is nearest its own. captions: CaptionOptions (a
    prefix, a suffix, one caption per line).

    After construction: items (kept (path, first caption) pairs), captions (per item, all its captions), repeats
    (per item, how often an epoch shows it: its N_ folder or its manifest line), masks (per item, a mask path or
    None), skipped (reason -> paths), uncaptioned (count of kept images with an empty caption), ignored ({kind:
    count} of the folder's files that are not images or captions, e.g. ".gif"), summary (the line that was
    logged), bucket_sizes (the sizes; without buckets the one square) and bucket_of (per item, the index of its
    size; without buckets all 0).
    """

    def __init__(self, path, resolution, log=print, buckets=None, captions=None):
        path = os.fspath(path)
        self.path, self.resolution = path, int(resolution)
        self.bucketed = buckets is not None
        self.bucket_sizes = [(int(w), int(h)) for w, h in buckets] if self.bucketed else [(self.resolution,) * 2]
        if not self.bucket_sizes or min(min(size) for size in self.bucket_sizes) < 1:
            raise ValueError(f"buckets must be a non-empty list of positive (width, height) sizes, got {buckets!r}")
        candidates, self.odd_folders = self._candidates(path), []
        paths = [p for p, *_ in candidates]
        if os.path.isdir(path):  # (image, caption text) -> with repeats from the N_ folders and masks beside
            repeats, self.odd_folders = folder_repeats(path, paths)
            candidates = [(p, text, n, mask_beside(p)) for (p, text), n in zip(candidates, repeats)]
        options = captions or CaptionOptions()
        with ThreadPoolExecutor(max_workers=min(CHECK_THREADS, len(paths))) as pool:
            checks = pool.map(check_image, paths, [self.resolution] * len(paths))  # keeps the input order
            checks = list(tqdm(checks, total=len(paths), desc=f"checking {path}", unit="img",
                               disable=len(paths) <= PROGRESS_MIN_FILES))
            mask_sizes = list(pool.map(mask_size, [mask for *_, mask in candidates]))
        self.items, self.captions, self.repeats, self.masks, self.skipped, self.bucket_of = [], [], [], [], {}, []
        self.uncaptioned = 0  # a trigger word alone is still no caption
        for (image, text, repeats, mask), (reason, size), found in zip(candidates, checks, mask_sizes):
            if reason is not None:
                self.skipped.setdefault(reason, []).append(image)
                continue
            if found is not None and tuple(found) != tuple(size):
                raise DatasetError(f"mask {mask} is {found[0]}x{found[1]} but its image is {size[0]}x{size[1]}: a "
                                   "mask must have its image's size")
            self.captions.append(options.read(text))
            self.uncaptioned += CaptionOptions().read(text) == [""]
            self.items.append((image, self.captions[-1][0]))
            self.repeats.append(repeats)
            self.masks.append(mask)
            self.bucket_of.append(nearest_bucket(*size, self.bucket_sizes) if self.bucketed else 0)
        self.has_masks = any(self.masks)
        self.summary = self._summary()
        if not self.items:
            raise DatasetError(f"no usable images: {self.summary}")
        log(self.summary)
        if self.odd_folders:
            names = self.odd_folders
            log(f"warning: {len(names)} folder(s) have no N_ repeat prefix ({', '.join(names[:MAX_NAMES_LISTED])}): "
                "their images are seen once an epoch (name a folder 3_name to see it 3 times)")

    def _candidates(self, path):
        """(image path, caption text, repeats, mask) from a folder (repeats and masks added after) or a manifest."""
        if not os.path.exists(path):
            raise DatasetError(f"dataset path {path} does not exist: {HOW_TO}")
        if os.path.isdir(path):
            self.root = path
            candidates, self.ignored = find_images(path)
            if not candidates:
                found = f" (found {describe_ignored(self.ignored)})" if self.ignored else ""
                raise DatasetError(f"no images found in {path}{found}: {LOOKED_FOR}; {HOW_TO}")
            return candidates
        if path.lower().endswith(".jsonl"):
            self.root = os.path.dirname(os.path.abspath(path))
            candidates, self.ignored = read_image_list(path), {}
            if not candidates:
                raise DatasetError(f"manifest {path} lists no images: expected one line per image like "
                                   '{"image": "a.png", "caption": "..."}')
            return candidates
        raise DatasetError(f"dataset path {path} is neither a folder nor a .jsonl manifest: {HOW_TO}")

    def _summary(self):
        parts = []
        for reason in SKIP_REASONS:
            paths = self.skipped.get(reason, [])
            if paths:
                names = [os.path.relpath(p, self.root) for p in paths[:MAX_NAMES_LISTED]]
                more = f", +{len(paths) - MAX_NAMES_LISTED} more" if len(paths) > MAX_NAMES_LISTED else ""
                parts.append(f"{len(paths)} {reason}: {', '.join(names)}{more}")
        n_skipped = sum(len(p) for p in self.skipped.values())
        skipped = f"{n_skipped} skipped" + (f" ({'; '.join(parts)})" if parts else "")
        ignored = ""
        if self.ignored:
            ignored = f", not read: {describe_ignored(self.ignored)} (images must be {', '.join(IMAGE_EXTENSIONS)})"
        summary = (f"dataset {self.path}: {len(self.items)} images, {skipped}{ignored}, {self.uncaptioned} without "
                   "caption")
        if sum(self.repeats) != len(self.items):
            summary += f", {sum(self.repeats)} samples an epoch with repeats{self._repeat_folders()}"
        several = [len(c) for c in self.captions if len(c) > 1]
        if several:
            summary += f", {len(several)} with several captions ({sum(several)} in all)"
        if any(self.masks):
            summary += f", {sum(1 for m in self.masks if m)} masks"
        if self.bucketed and self.items:
            counts = [(size, self.bucket_of.count(i)) for i, size in enumerate(self.bucket_sizes)]
            summary += ", buckets " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in counts if n)
        return summary

    def _repeat_folders(self):
        """' (3_cat: 20 images x 3, ...)' for a folder's N_ subfolders, so that a '2023_trip' is noticed."""
        if not os.path.isdir(self.path):
            return ""
        folders = Counter((top_folder(self.path, image), repeats) for (image, _), repeats in zip(self.items,
                                                                                               self.repeats))
        named = [f"{name}: {n} images x {repeats}" for (name, repeats), n in sorted(folders.items()) if repeats > 1]
        return f" ({', '.join(named[:MAX_NAMES_LISTED])})"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.load(i)

    def load(self, i, caption=0, flip=False):
        """Item i with its caption number `caption`, mirrored left to right if `flip` (its mask too)."""
        path = self.items[i][0]
        size = self.bucket_sizes[self.bucket_of[i]]
        try:
            image = load_image(path, self.resolution, size=size)
            mask = load_mask(self.masks[i], size) if self.masks[i] else None
        except Exception as e:  # it decoded at start-up, so the file changed underneath us
            raise DatasetError(f"could not load {path} (it loaded when the dataset was built): {e}") from e
        item = {"image": image_to_tensor(image), "caption": self.captions[i][caption]}
        if self.has_masks:
            item["mask"] = mask if mask is not None else torch.ones(1, size[1], size[0])
        if flip:
            item = {key: value.flip(-1) if key != "caption" else value for key, value in item.items()}
        return item

    def split(self, fraction, seed):
        """-> (the rest, the held-out part): round(fraction x images) images (at least one) drawn with `seed`,
        never trained on."""
        n = len(self.items)
        held = max(1, round(fraction * n))
        if held >= n:
            raise DatasetError(f"--val_fraction {fraction:g} of {n} images leaves none to train on: use a smaller "
                               "fraction, or pass --val_data")
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        return self.subset(sorted(order[held:])), self.subset(sorted(order[:held]))

    def subset(self, indices):
        part = copy.copy(self)
        for name in ("items", "captions", "repeats", "masks", "bucket_of"):
            setattr(part, name, [getattr(self, name)[i] for i in indices])
        part.has_masks = any(part.masks)
        return part

    def squares(self):
        """The same images as resolution x resolution squares, whatever their buckets."""
        part = self.subset(range(len(self)))
        part.bucketed, part.bucket_sizes, part.bucket_of = False, [(self.resolution,) * 2], [0] * len(self)
        return part


# ----------------------------------------------------------------------------------------------------------------
# Masks


def mask_size(mask):
    """A mask's size as displayed, or None without a mask; a file Pillow cannot read is a one-line DatasetError."""
    if mask is None:
        return None
    try:
        with Image.open(mask) as img:
            return ImageOps.exif_transpose(img).size
    except Exception:  # any decoder failure: not an image
        raise DatasetError(f"mask {mask} is not an image Pillow can read: save it as a PNG (white = train, black = "
                           "ignore)") from None


def load_mask(path, size):
    """The mask as a [1, H, W] weight in [0, 1] (white = 1), resized and cropped as its image is."""
    with Image.open(path) as img:
        gray = ImageOps.exif_transpose(img).convert("L")
    return torch.from_numpy(np.asarray(cover_and_crop(gray, tuple(size)), dtype=np.float32) / 255.0)[None]


def build_dataset(data, resolution, split="train", log=print, num_samples=None, seed=0, **user):
    """'builtin' -> ShapesDataset(split, ...), 'builtin:white' the same in white only (or other colours, comma
    separated); a folder or .jsonl -> ImageCaptionDataset (split, num_samples and seed only apply to the built-in
    data; `user`, ImageCaptionDataset's buckets (a list of (width, height) sizes) and captions (CaptionOptions),
    only to user data). Anything else raises DatasetError."""
    if data == "builtin" or data.startswith("builtin:"):
        if user.get("buckets") is not None:
            raise DatasetError(f"--data {data}: aspect-ratio buckets are for user images; the built-in shapes are "
                               "all square, so leave buckets off")
        colors = [c for c in data.partition(":")[2].split(",") if c] or None
        try:
            dataset = ShapesDataset(split, num_samples or 20000, resolution, seed, colors=colors)
        except ValueError as e:
            raise DatasetError(f"--data {data}: {e}") from None
        log(f"dataset {data}: {len(dataset)} {split} shapes samples at {resolution}px (seed {seed})")
        return dataset
    return ImageCaptionDataset(data, resolution, log=log, **user)
