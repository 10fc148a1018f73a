"""Where a run is: its step, the epoch and the place in the epoch's order, the samples seen, and the generator that
draws its noise, sigmas and caption dropout. A stage's loop asks it for this rank's micro-batches of each step;
its state_dict() is what a resume continues from.

    position = Position(dataset, args.resolution, args.batch_size, args.accumulation_steps, args.seed, info)
    position.plan(args.max_steps, args.epochs)
    while not position.finished:
        for batch in position.next_step():        # step + 1: this rank's micro-batches of it
            ...
        position.end_step()                       # the step's samples counted as seen

The place in the data is counted in samples (dataset/samplers.py), and the schedule in steps of the global batch
the run started with (plan_batch), so a resume with another number of processes continues the same epoch and
the same schedule.
"""
import math
import os

import torch
import torch.distributed as dist

from dataset.buckets import bucket_layout
from dataset.samplers import BucketSampler, make_sampler
from dataset.samples import epoch_view
from model.errors import UserError
from trainer.mechanics.signals import leave_stopping_to_the_main_process, stop_signals_held
from trainer.mechanics.state import rng_state, set_rng_state, to_cpu


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
                            f"({self.global_batch} = batch_size x accumulation_steps x processes): lower --batch_size or "
                            "--accumulation_steps, or add images")
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
