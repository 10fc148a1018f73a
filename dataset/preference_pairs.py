"""Preference pairs: a caption with a chosen and a rejected image of it, what preference tuning trains on
(trainer/train_dpo.py). Items are {"caption": str, "chosen": [3, H, W], "rejected": [3, H, W]} in [-1, 1].

Two sources:
    PreferencePairs   a manifest, one JSON line {"prompt", "chosen", "rejected"} per pair with image paths
                      (relative to the file), the shape of Pick-a-Pic. Every image is decoded once up front; a
                      line that is malformed, has an empty prompt or a missing or unreadable image is left out and
                      counted in one summary line.
    PairPool          the pairs a run draws for itself (--pairs builtin): filled round after round from the model
                      being tuned, and saved in the resume checkpoint with the rest of the run.
"""
import json
import os

import numpy as np
import torch

from dataset.image_folder import SKIP_REASONS, DatasetError, check_image, load_image
from dataset.shapes import SAMPLE_PROMPTS, image_to_tensor
from model.file_io import json_digest

PAIR_FORMAT = '{"prompt": "...", "chosen": "a.png", "rejected": "b.png"}'
LINE_REASONS = ("malformed", "empty prompt")  # listed before the image reasons in the summary
MAX_LINES_LISTED = 5


def encode_pairs(components, chosen, rejected, captions):
    """Encode a batch of pairs in one pass -> the caption's features ("text_*", ...) and each side's latents
    under "chosen_latents", "rejected_latents" (and their "_std" where the autoencoder gives one)."""
    n = len(captions)
    both = components.encode(torch.cat([chosen, rejected]), list(captions) * 2)
    features = {k: v[:n] for k, v in both.items() if not k.startswith("latents")}
    for key in (k for k in both if k.startswith("latents")):
        features[f"chosen_{key}"], features[f"rejected_{key}"] = both[key][:n], both[key][n:]
    return features


def side(features, which):
    """The latents of one side of encoded pairs ("chosen" or "rejected"), keyed as components.latents reads them."""
    prefix = f"{which}_"
    return {k[len(prefix):]: v for k, v in features.items() if k.startswith(prefix)}


def read_pair_line(line, root):
    """One manifest line -> ((prompt, chosen path, rejected path), None) or (None, reason)."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None, "malformed"
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("prompt", "chosen", "rejected")):
        return None, "malformed"
    prompt = " ".join(entry["prompt"].split())
    if not prompt:
        return None, "empty prompt"
    return (prompt, *(os.path.join(root, os.path.expanduser(entry[k])) for k in ("chosen", "rejected"))), None


class PreferencePairs(torch.utils.data.Dataset):
    """A manifest of preference pairs at resolution x resolution (centre-cropped squares). After construction:
    items (the kept (prompt, chosen path, rejected path)), skipped ({reason: [line numbers]}), summary (the line
    that was logged), path."""

    def __init__(self, path, resolution, log=print):
        self.path, self.resolution = os.fspath(path), int(resolution)
        if not os.path.isfile(self.path):
            raise DatasetError(f"pairs manifest {self.path} does not exist: pass 'builtin' or a .jsonl file with one "
                               f"line per pair like {PAIR_FORMAT}")
        root = os.path.dirname(os.path.abspath(self.path))
        self.items, self.skipped = [], {}
        with open(self.path, encoding="utf-8-sig") as f:
            lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
        for number, line in lines:
            item, reason = read_pair_line(line, root)
            if item is not None:
                reason = next((r for r in (check_image(p, self.resolution)[0] for p in item[1:]) if r), None)
            if reason is None:
                self.items.append(item)
            else:
                self.skipped.setdefault(reason, []).append(number)
        self.summary = self._summary()
        if not self.items:
            raise DatasetError(f"no usable pairs: {self.summary} (one line per pair like {PAIR_FORMAT})")
        log(self.summary)

    def _summary(self):
        parts = []
        for reason in LINE_REASONS + SKIP_REASONS:
            numbers = self.skipped.get(reason, [])
            if numbers:
                more = f", +{len(numbers) - MAX_LINES_LISTED} more" if len(numbers) > MAX_LINES_LISTED else ""
                what = reason if reason in LINE_REASONS else f"{reason} image"
                parts.append(f"{len(numbers)} {what} (line {', '.join(map(str, numbers[:MAX_LINES_LISTED]))}{more})")
        skipped = sum(len(n) for n in self.skipped.values())
        return (f"pairs {self.path}: {len(self.items)} pairs, {skipped} skipped" + (f": {'; '.join(parts)}"
                                                                                    if parts else ""))

    def fingerprint(self):
        """What the cached features of these pairs depend on: the files (path, size, mtime) and the prompts."""
        files = [[os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for item in self.items
                 for p in item[1:]]
        return {"data": os.path.abspath(self.path), "count": len(self.items), "files": json_digest(files),
                "captions": json_digest([item[0] for item in self.items])}

    def sample_prompts(self, count=8):
        """The sample grids' prompts: `count` of the pairs' prompts, spread over the file, and the unconditional."""
        picks = [self.items[k * len(self.items) // count][0] for k in range(min(count, len(self.items)))]
        return list(dict.fromkeys(picks)) + [""]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        prompt, *paths = self.items[i]
        try:
            chosen, rejected = (image_to_tensor(load_image(p, self.resolution)) for p in paths)
        except Exception as e:  # it decoded at start-up, so the file changed underneath us
            raise DatasetError(f"could not load the pair on {self.path}'s item {i} (it loaded when the pairs were "
                               f"read): {e}") from e
        return {"caption": prompt, "chosen": chosen, "rejected": rejected}


class PairPool(torch.utils.data.Dataset):
    """The pairs a run draws for itself: `slots` items, filled each round with that round's pairs (repeated in
    turn when it found fewer than the slots). Its state (the round and its pairs, uint8 images) goes in the resume
    checkpoint, so a resumed run trains on the same pairs."""

    cacheable = False  # it changes every round: its features are encoded as it trains

    def __init__(self, slots, resolution):
        self.slots, self.resolution = slots, resolution
        self.round, self.captions = -1, []
        self.chosen = self.rejected = torch.zeros(0, resolution, resolution, 3, dtype=torch.uint8)

    def fill(self, round_, captions, chosen, rejected):
        """A round's pairs: captions and uint8 images [n, H, W, 3] of each side."""
        self.round, self.captions = round_, list(captions)
        self.chosen, self.rejected = torch.as_tensor(np.asarray(chosen)), torch.as_tensor(np.asarray(rejected))

    def sample_prompts(self):
        return list(SAMPLE_PROMPTS)  # the built-in data's own

    def __len__(self):
        return self.slots

    def __getitem__(self, i):
        if not self.captions:
            raise RuntimeError("the pair pool is empty: fill it before training on it")
        k = i % len(self.captions)

        def image(array):
            return array.permute(2, 0, 1).float().div(127.5).sub(1.0)  # as image_to_tensor

        return {"caption": self.captions[k], "chosen": image(self.chosen[k]), "rejected": image(self.rejected[k])}

    def state_dict(self):
        return {"round": self.round, "captions": list(self.captions), "chosen": self.chosen,
                "rejected": self.rejected}

    def load_state_dict(self, state):
        self.fill(state["round"], state["captions"], state["chosen"], state["rejected"])
