"""Where a run is: its step, the epoch and the place in the epoch's order, the samples seen, and the generator that
draws its noise, sigmas and caption dropout. A stage's loop asks it for this rank's micro-batches of each step;
its state_dict() is what a resume continues from.

    position = Position(dataset, args.resolution, args.batch_size, args.accumulation_steps, args.seed, info)
    position.plan(args.max_steps, args.epochs)
    while not position.finished:
        for batch in position.next_step():        # step + 1: this rank's micro-batches of it
            ...
        position.end_step()                       # the step's samples counted as seen

The place in the data is counted in samples (the samplers below), and the schedule in steps of the global batch
the run started with (plan_batch), so a resume with another number of processes continues the same epoch and
the same schedule.
"""
import math
import os

import torch
import torch.distributed as dist

from dataset.image_folder import bucket_layout
from dataset.samples import epoch_view
from model.errors import UserError
from trainer.mechanics.signals import leave_stopping_to_the_main_process, stop_signals_held
from trainer.mechanics.state import rng_state, set_rng_state, to_cpu

SEED_MIX = 1_000_003  # a prime: (seed, epoch, bucket) -> one generator seed, distinct for small values of each


def data_workers(requested, device):
    """--num_workers: a number of data loader processes, or auto: none on a CPU (every core trains, and a worker
    would take one from it), else 4 for each GPU's process, within the cores a process has."""
    if requested != "auto":
        return int(requested)
    if device.type == "cpu":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_process = cores // max(1, torch.cuda.device_count())
    return max(0, min(4, per_process - 1))


class Position:
    """The position of a run over `dataset` in micro-batches of `batch_size`, `accumulation_steps` a step on each of
    info's processes (the module's docstring shows its use). `num_workers`: data loader processes, or "auto"
    (data_workers)."""

    def __init__(self, dataset, resolution, batch_size, accumulation_steps, seed, info, num_workers=0):
        self.dataset, self.batch_size, self.accumulation_steps = dataset, batch_size, accumulation_steps
        self.seed, self.info, self.num_workers = seed, info, data_workers(num_workers, info.device)
        self.global_batch = batch_size * accumulation_steps * info.world_size
        if len(dataset) < self.global_batch:
            raise UserError(f"the dataset has {len(dataset)} samples, fewer than one global batch "
                            f"({self.global_batch} = batch_size x accumulation_steps x processes): lower "
                            "--batch_size or --accumulation_steps, or add images")
        self.generator = torch.Generator().manual_seed(seed * 1000 + info.rank)  # sigmas, noise, dropout
        self.sampler = make_sampler(bucket_layout(dataset, resolution)[0], batch_size, info.rank, info.world_size,
                                    seed)
        self.step = self.epoch = self.consumed = self.samples_seen = 0
        self.ids, self.loader = [], None  # the step's dataset indices on this rank; the epoch's batches
        self.plan_batch, self.max_steps, self.epochs = self.global_batch, 0, 1

    def plan(self, max_steps, epochs):
        """The schedule's length: `max_steps` optimizer steps, or (0) `epochs` of the data."""
        self.max_steps, self.epochs = max_steps, epochs

    def planned_steps(self, max_steps, epochs, plan_batch):
        """The steps of `plan_batch` samples that `max_steps` (or `epochs` of the data) make."""
        return max_steps if max_steps > 0 else epochs * self.sampler.steps_left(0, plan_batch)

    @property
    def plan_steps(self):
        return self.planned_steps(self.max_steps, self.epochs, self.plan_batch)

    @property
    def progress(self):
        """The steps done, in the schedule's steps (of the global batch the run started with)."""
        return self.samples_seen / self.plan_batch

    @property
    def finished(self):
        return self.samples_seen >= self.plan_steps * self.plan_batch

    def due(self, interval):
        """Whether what a run does every `interval` steps (save, sample, validate) is due at this step: at each
        multiple of it, and at the run's end (`interval` 0: at the end only)."""
        return self.finished or bool(interval) and self.step % interval == 0

    @property
    def steps_left(self):
        return math.ceil((self.plan_steps * self.plan_batch - self.samples_seen) / self.global_batch)

    def next_step(self):
        """Count the next step; -> an iterator over this rank's micro-batches of it, each fetched when asked for,
        from the epoch's order (a new epoch begins where the last one has no whole step left)."""
        if self.sampler.steps_left(self.consumed, self.global_batch) == 0:
            self.epoch, self.consumed, self.loader = self.epoch + 1, 0, None
        if self.loader is None:  # this rank's share of the rest of the epoch; torch's random stream untouched
            batches = self.sampler.rank_batches(self.epoch, self.consumed, self.batch_size, self.global_batch)
            loader = torch.utils.data.DataLoader(
                epoch_view(self.dataset, self.epoch), batch_sampler=batches, num_workers=self.num_workers,
                pin_memory=self.info.device.type == "cuda",  # page-locked batches: their copy does not block
                worker_init_fn=leave_stopping_to_the_main_process, generator=torch.Generator().manual_seed(self.seed))
            with stop_signals_held():  # the workers start here
                self.loader = zip(batches, loader)
        self.step, self.ids = self.step + 1, []
        return self._micro_batches()

    def _micro_batches(self):
        for _ in range(self.accumulation_steps):
            ids, batch = next(self.loader)
            self.ids += ids
            yield batch

    def end_step(self):
        """The step's samples, over all processes, counted as seen."""
        self.consumed, self.samples_seen = self.consumed + self.global_batch, self.samples_seen + self.global_batch

    def close(self):
        """Let the data loader go (its worker processes end with it)."""
        self.loader = None

    def step_ids(self):
        """The dataset indices the step trained on, over all processes (every process calls it)."""
        if self.info.world_size == 1:
            return self.ids
        per_rank = [None] * self.info.world_size
        dist.all_gather_object(per_rank, self.ids)
        return [i for rank_ids in per_rank for i in rank_ids]

    def state_dict(self):
        """The position, and every process's random streams (every process calls it: they are gathered)."""
        rng = [rng_state(self.generator, self.info.device)]
        if self.info.world_size > 1:
            rng = [None] * self.info.world_size
            dist.all_gather_object(rng, rng_state(self.generator, self.info.device))
        return {"step": self.step, "epoch": self.epoch, "consumed": self.consumed, "samples_seen": self.samples_seen,
                "world_size": self.info.world_size, "global_batch": self.global_batch, "plan_batch": self.plan_batch,
                "batch_size": self.batch_size, "dataset_size": len(self.dataset), "rng": to_cpu(rng)}

    def load_state_dict(self, state):
        """Continue from a saved position: the same epoch and place in it, the same schedule. With as many
        processes and the same global batch the random streams go on too; otherwise the noise stream restarts,
        seeded by step and rank."""
        if isinstance(self.sampler, BucketSampler) and state["batch_size"] != self.batch_size:
            raise UserError(f"cannot resume bucketed data with --batch_size {self.batch_size}: its epochs are planned "
                            f"in micro-batches of {state['batch_size']} (change --accumulation_steps instead)")
        self.step, self.epoch, self.consumed, self.samples_seen = (state[k] for k in
                                                                    ("step", "epoch", "consumed", "samples_seen"))
        self.plan_batch, self.loader = state["plan_batch"], None
        if state["world_size"] == self.info.world_size and state["global_batch"] == self.global_batch:
            set_rng_state(state["rng"][self.info.rank], self.generator, self.info.device)
        else:
            self.generator.manual_seed(self.seed * 1000 + self.info.rank + 7919 * self.step)


# ----------------------------------------------------------------------------------------------------------------
# Which samples each process takes at each step. The position in an epoch is counted in samples over all
# processes, so a resume on another number of processes continues the same epoch: nothing of it is seen twice
# or skipped. A step takes `global_batch` samples: batch size x accumulation steps x processes.


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
    (BucketBatches below: every image at least once an epoch). A step deals its world x accumulation micro-batches
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
