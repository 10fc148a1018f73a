"""What an epoch shows of the user's images: each image as often as its repeats say (kohya's N_ folders, a
manifest's "repeats"), and each time one of its variants: one of its captions, mirrored or not (--random_flip),
its comma-separated tags shuffled after the first --keep_tags (--shuffle_tags).

The finite variants (an image x a caption x a flip) are what the feature cache encodes, each once; a sample slot
of an epoch picks its variant by a draw seeded with (seed, epoch, slot), so every process, and a resumed run,
picks the same, whatever the number of processes. Tag shuffles have no finite set: they need the text encoders
at every step (no text cache).

    samples = EpochSamples([dataset, prior], flip=0.5, seed=0)
    samples.variants                # a Dataset of every variant: what the cache encodes
    samples.for_epoch(3)[slot]      # the slot's sample in epoch 3 (from the variants, or their cache: .reading())
"""
import copy
import random

import torch

from dataset.image_folder import bucket_layout
from model.file_io import json_digest


class EpochSamples(torch.utils.data.Dataset):
    """The sample slots of an epoch over `parts` (datasets; user images carry captions, repeats and masks, and
    only they are flipped). len() is the slots of an epoch; bucket_of / bucket_sizes are per slot."""

    def __init__(self, parts, resolution, flip=0.0, shuffle_tags=False, keep_tags=0, seed=0):
        self.parts, self.flip, self.seed = list(parts), float(flip), seed
        self.shuffle_tags, self.keep_tags = bool(shuffle_tags), int(keep_tags)
        self.masked = any(getattr(part, "has_masks", False) for part in self.parts)
        item_buckets, self.bucket_sizes = bucket_layout(torch.utils.data.ConcatDataset(self.parts), resolution)
        self.keys, self.slots, self.bucket_of, variant_buckets = [], [], [], []  # keys: (part, item, caption, flip)
        n = 0
        for p, part in enumerate(self.parts):
            user = hasattr(part, "captions")
            flips = (False, True) if self.flip > 0 and user else (False,)
            for i in range(len(part)):
                captions = len(part.captions[i]) if user else 1
                slot = (len(self.keys), captions, len(flips))
                self.keys += [(p, i, k, f) for k in range(captions) for f in flips]
                variant_buckets += [item_buckets[n]] * (captions * len(flips))
                repeats = part.repeats[i] if user else 1
                self.slots += [slot] * repeats
                self.bucket_of += [item_buckets[n]] * repeats
                n += 1
        self.variants = Variants(self, variant_buckets)
        self.source = self.variants  # where a slot's sample is read: the variants, or their cache

    def __len__(self):
        return len(self.slots)

    def __getitem__(self, slot):
        return self.for_epoch(0)[slot]

    def variant_of(self, epoch, slot):
        """The variant slot `slot` shows in `epoch`: one of its captions, flipped with probability --random_flip."""
        first, captions, flips = self.slots[slot]
        if captions == 1 and flips == 1:
            return first
        draw = random.Random(f"{self.seed}:{epoch}:{slot}")  # a string seed hashes the same in every process
        caption, flip = draw.randrange(captions), draw.random() < self.flip
        return first + caption * flips + (flip and flips == 2)

    def for_epoch(self, epoch):
        return EpochView(self, epoch)

    def reading(self, source):
        """The same slots, read from `source` (the variants' feature cache)."""
        view = copy.copy(self)
        view.source = source
        return view

    def fingerprint(self):
        """What the variants' features depend on beyond each part's files: which variants there are."""
        return {"variants": json_digest([list(key) for key in self.keys]), "flip": self.flip > 0,
                "masks": self.masked}


class Variants(torch.utils.data.Dataset):
    """Every variant of the samples once: {"image", "caption", and "mask" when any part has masks}."""

    def __init__(self, samples, bucket_of):
        self.samples, self.bucket_of, self.bucket_sizes = samples, bucket_of, samples.bucket_sizes

    def __len__(self):
        return len(self.samples.keys)

    def __getitem__(self, v):
        p, i, caption, flip = self.samples.keys[v]
        part = self.samples.parts[p]
        item = part.load(i, caption, flip) if hasattr(part, "load") else dict(part[i])
        if self.samples.masked and "mask" not in item:  # a part without masks trains everywhere
            item["mask"] = torch.ones(1, *item["image"].shape[1:])
        return item


class EpochView(torch.utils.data.Dataset):
    """The samples of one epoch: slot -> its variant's item (or cached features), tags shuffled if asked."""

    def __init__(self, samples, epoch):
        self.samples, self.epoch = samples, epoch

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, slot):
        s = self.samples
        item = s.source[s.variant_of(self.epoch, slot)]
        if s.shuffle_tags and "caption" in item:
            draw = random.Random(f"{s.seed}:{self.epoch}:{slot}:tags")
            item = {**item, "caption": shuffled_tags(item["caption"], s.keep_tags, draw)}
        return item


def split_tags(caption):
    return [tag.strip() for tag in caption.split(",") if tag.strip()]


def shuffled_tags(caption, keep, draw):
    """The comma-separated tags of `caption` with all but the first `keep` shuffled by `draw` (random.Random)."""
    tags = split_tags(caption)
    rest = tags[keep:]
    draw.shuffle(rest)
    return ", ".join(tags[:keep] + rest)


def count_short_of(parts, keep):
    """How many captions have no more than `keep` tags (nothing of theirs is shuffled)."""
    return sum(len(split_tags(c)) <= keep for part in parts if hasattr(part, "captions")
               for captions in part.captions for c in captions)


def epoch_view(dataset, epoch):
    """What an epoch reads: the epoch's draw of EpochSamples, or any other dataset as it is."""
    return dataset.for_epoch(epoch) if hasattr(dataset, "for_epoch") else dataset
