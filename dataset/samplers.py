"""Which samples each process takes at each step. The position in an epoch is counted in samples over all
processes, so a resume on another number of processes continues the same epoch: nothing of it is seen twice or
skipped. A step takes `global_batch` samples: batch size x accumulation steps x processes."""
import math

import torch

from dataset.buckets import BucketBatches


class EpochSampler:
    """Each epoch is one global permutation (seed + epoch). The position in it is counted in global samples,
    and the rest of the epoch is dealt round-robin to the ranks, so a resume (also with another world size)
    continues the same permutation: nothing of the epoch is seen twice or skipped. An epoch's last samples that
    do not fill a global batch are left for that epoch (the next permutation differs)."""

    def __init__(self, num_samples, rank, world_size, seed=0, shuffle=True):
        self.n, self.rank, self.world, self.seed, self.shuffle = num_samples, rank, world_size, seed, shuffle

    def permutation(self, epoch):
        if not self.shuffle:
            return torch.arange(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def steps_left(self, consumed, global_batch):
        """Whole steps left in an epoch after `consumed` of its samples."""
        return max(0, self.n - consumed) // global_batch

    def rank_batches(self, epoch, consumed, batch_size, global_batch):
        """This rank's micro-batches for the rest of the epoch, in the order the steps take them."""
        rest = self.permutation(epoch)[consumed:]
        mine = rest[self.rank:len(rest) // self.world * self.world:self.world].tolist()
        return [mine[i:i + batch_size] for i in range(0, len(mine) - batch_size + 1, batch_size)]


class BucketSampler:
    """Aspect-ratio buckets: the epoch is a shuffled list of micro-batches, each from one bucket
    (dataset/buckets.py: every image at least once an epoch). A step deals its world x accumulation micro-batches
    round-robin to the ranks; the position is counted in samples, so a resume with another world size continues
    the same list. The epoch's last step is filled from the list's start: nothing is dropped however the
    global batch grows."""

    def __init__(self, bucket_of, rank, world_size, batch_size, seed=0):
        self.rank, self.world = rank, world_size
        self.plan = BucketBatches(bucket_of, batch_size, seed)
        self.n = self.plan.len_micro_batches() * batch_size  # samples in an epoch's list

    def steps_left(self, consumed, global_batch):
        return math.ceil(max(0, self.n - consumed) / global_batch)

    def rank_batches(self, epoch, consumed, batch_size, global_batch):
        plan = self.plan.micro_batches(epoch)
        rest = plan[consumed // batch_size:]
        per_step = global_batch // batch_size  # micro-batches in a step, over all ranks
        rest += plan[:(-len(rest)) % per_step]
        return [rest[i] for i in range(self.rank, len(rest), self.world)]


def make_sampler(bucket_of, batch_size, rank, world_size, seed):
    """Buckets when the samples come in more than one image size (`bucket_of`: each sample's), else one
    permutation an epoch."""
    if len(set(bucket_of)) > 1:
        return BucketSampler(bucket_of, rank, world_size, batch_size, seed)
    return EpochSampler(len(bucket_of), rank, world_size, seed=seed)
