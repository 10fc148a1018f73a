"""Aspect-ratio buckets: user images keep (about) their shape instead of all being centre-cropped to squares.

A few bucket sizes (width, height) share about the same area, so a batch costs about the same memory in any
bucket. Each image goes to the bucket whose aspect ratio is nearest its own, and every micro-batch is drawn from one
bucket, so its images stack into one tensor.
"""
import math

import torch

MAX_AREA_FACTOR = 1.1  # a bucket may exceed resolution^2 by this much: sides are rounded to a multiple, not floored
SEED_MIX = 1_000_003  # a prime: (seed, epoch, bucket) -> one generator seed, distinct for small values of each


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


def _generator(*keys):
    seed = 0
    for key in keys:
        seed = (seed * SEED_MIX + key) % 2 ** 63  # manual_seed takes at most 64 bits
    return torch.Generator().manual_seed(seed)


class BucketBatches:
    """Plans an epoch of micro-batches in which each micro-batch holds samples of one bucket only.

    Each bucket is shuffled on its own and padded up to a multiple of batch_size by repeating the start of that
    same shuffle (a bucket smaller than batch_size is repeated as often as needed), then cut into micro-batches of
    exactly batch_size; the micro-batches of all buckets are then shuffled together. So no sample is ever dropped
    (truncating each bucket's tail to a whole batch would silently lose small buckets), and no sample is seen twice
    in an epoch except the padding, fewer than batch_size repeats per bucket. The plan depends only on (seed,
    epoch), not on the world size: the trainer deals consecutive micro-batches to the ranks and counts its position
    in micro-batches, so a resume, also with another world size, continues the same plan exactly.
    """

    def __init__(self, bucket_of, batch_size, seed):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
        if not bucket_of:
            raise ValueError("no samples to plan batches for (bucket_of is empty)")
        self.batch_size, self.seed = batch_size, seed
        self.members = {}  # bucket id -> its sample indices, ascending
        for index, bucket in enumerate(bucket_of):
            self.members.setdefault(int(bucket), []).append(index)

    def len_micro_batches(self):
        """Micro-batches per epoch: the same every epoch, since only the order changes."""
        return sum(-(-len(indices) // self.batch_size) for indices in self.members.values())

    def micro_batches(self, epoch):
        """The epoch's micro-batches in training order, each a list of batch_size sample indices of one bucket."""
        batches = []
        for bucket in sorted(self.members):
            indices = torch.tensor(self.members[bucket])
            order = indices[torch.randperm(len(indices), generator=_generator(self.seed, epoch, bucket + 1))]
            padded = -(-len(order) // self.batch_size) * self.batch_size
            order = order.repeat(-(-padded // len(order)))[:padded].tolist()
            batches += [order[i:i + self.batch_size] for i in range(0, padded, self.batch_size)]
        shuffle = torch.randperm(len(batches), generator=_generator(self.seed, epoch)).tolist()
        return [batches[i] for i in shuffle]
