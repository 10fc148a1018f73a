"""TrainingRun: where a run is in its data and its schedule, and the small helpers a stage's loop calls by name.

    run = TrainingRun(args, info, dataset, metrics)
    checkpointer.start(run, ...)                      # resumes the position, or starts fresh
    for batches in run.steps(train_model):            # this rank's micro-batches of the next step
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        for batch in batches:
            run.backward(<the stage's loss of one micro-batch>)
        losses = run.mean_losses()                    # over micro-batches and processes
        grad_norm = run.optimizer_step(optimizer, params, losses["loss"], args.grad_clip, ema)
        run.end_step()                                # the samples counted, the step timed
        ...                                           # metrics, validation, the save, the grid: each its own piece

It keeps the data position in samples (samples_seen; the epoch and `consumed`, the position in it) and the
schedule in steps of the global batch the run started with (plan_batch), so a resume with another number of
processes continues the same epoch and the same schedule.
"""
import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dataset.buckets import bucket_layout
from dataset.samplers import make_sampler
from dataset.samples import epoch_view
from model.errors import UserError
from trainer.distributed import mean_and_any
from trainer.parallel import as_list, to_item
from trainer.trainer_utils import StopSignal, ignore_sigint, lr_at

NAN_STEPS_LIMIT = 10  # this many non-finite losses in a row stop the run


class TrainingRun:
    """The data position, the schedule and the step of one run over `dataset` (the module's docstring shows the
    loop). `num_workers`: data loader processes (default --num_workers)."""

    def __init__(self, args, info, dataset, metrics, num_workers=None):
        self.args, self.info, self.dataset, self.log, self.metrics = args, info, dataset, metrics.log, metrics
        self.global_batch = args.batch_size * args.accumulation_steps * info.world_size
        if len(dataset) < self.global_batch:
            raise UserError(f"the dataset has {len(dataset)} samples, fewer than one global batch "
                            f"({self.global_batch} = batch_size x accumulation_steps x processes): lower --batch_size")
        self.num_workers = args.num_workers if num_workers is None else num_workers
        self.generator = torch.Generator().manual_seed(args.seed * 1000 + info.rank)  # sigmas, noise, dropout
        self.step = self.epoch = self.consumed = self.samples_seen = self.nan_streak = 0
        self.stop, self.skipped, self.resumed, self.ids, self.totals = False, False, False, [], {}
        self.images_per_s, self.stop_signal = 0.0, StopSignal()
        self.sampler = make_sampler(bucket_layout(dataset, args.resolution)[0], args.batch_size, info.rank,
                                    info.world_size, args.seed)
        self.plan(self.global_batch)

    def plan(self, plan_batch):
        """The schedule in steps of `plan_batch` samples (the global batch the run started with)."""
        self.plan_batch = plan_batch
        self.plan_steps = self.planned_steps(self.args)
        self.total_samples = self.plan_steps * self.plan_batch

    def planned_steps(self, args):
        """The steps `args` (these, or a saved run's) plan: --max_steps, else --epochs of the data."""
        return args.max_steps if args.max_steps > 0 else args.epochs * self.sampler.steps_left(0, self.plan_batch)

    @property
    def finished(self):
        return self.samples_seen >= self.total_samples

    @property
    def steps_left(self):
        return math.ceil((self.total_samples - self.samples_seen) / self.global_batch)

    # ------------------------------------------------------------------------------------------------------------
    # The steps

    def steps(self, *models):
        """Yield, step after step, this rank's micro-batches of the step (an iterator; `models` skip the gradient
        all-reduce on all but the last), until the planned samples are seen or a stop signal came. Stop signals are
        caught meanwhile: the step in progress completes, is saved, and the loop ends."""
        a = self.args
        with self.stop_signal:
            while not (self.finished or self.stop):
                if self.sampler.steps_left(self.consumed, self.global_batch) == 0:
                    self.epoch, self.consumed = self.epoch + 1, 0
                # this rank's share of the rest of the epoch; the loader has its own generator: torch's stream untouched
                batches = self.sampler.rank_batches(self.epoch, self.consumed, a.batch_size, self.global_batch)
                loader = zip(batches, torch.utils.data.DataLoader(
                    epoch_view(self.dataset, self.epoch), batch_sampler=batches, num_workers=self.num_workers,
                    worker_init_fn=ignore_sigint, generator=torch.Generator().manual_seed(a.seed)))
                while not (self.finished or self.stop) and self.sampler.steps_left(self.consumed, self.global_batch):
                    self.step, self.skipped, self.ids, self.totals = self.step + 1, False, [], {}
                    self.started = time.perf_counter()
                    yield self._micro_batches(loader, models)
        self.metrics.close()
        if self.info.world_size > 1:
            dist.barrier()  # leave together: rank 0 may still be writing the last save or sample grid

    def _micro_batches(self, loader, models):
        for micro in range(self.args.accumulation_steps):
            last = micro == self.args.accumulation_steps - 1
            ids, batch = next(loader)
            self.ids += ids
            # DDP all-reduces gradients once per step, on the last micro-batch; FSDP reduce-scatters each one (its
            # gradients stay sharded in between)
            with contextlib.ExitStack() as no_sync:
                if not last:
                    for model in models:
                        if isinstance(model, DistributedDataParallel):
                            no_sync.enter_context(model.no_sync())
                yield batch

    def schedule_lr(self, optimizer, base_lr, warmup_steps, min_lr_ratio):
        """Set the learning rate of `optimizer` (or of each of a list) for this step (warmup, then cosine; counted in
        samples) -> the rate."""
        lr = lr_at(self.samples_seen / self.plan_batch, self.plan_steps, base_lr, warmup_steps, min_lr_ratio)
        for group in (group for opt in as_list(optimizer) for group in opt.param_groups):
            if isinstance(group["lr"], torch.Tensor):  # torchao's 8-bit AdamW keeps it as a tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        return lr

    def backward(self, losses):
        """Backward through one micro-batch's loss (a tensor named "loss", or a dict of named losses: backward takes
        their sum), scaled so that the gradients accumulated over the step are the micro-batches' mean; each
        value is kept for mean_losses."""
        losses = losses if isinstance(losses, dict) else {"loss": losses}
        (sum(losses.values()) / self.args.accumulation_steps).backward()
        for name, loss in losses.items():
            self.totals[name] = self.totals.get(name, 0.0) + loss.item()

    def mean_losses(self):
        """-> {name: the step's loss averaged over micro-batches and processes}: one all-reduce, which also tells
        every rank whether any was asked to stop."""
        means, stop = mean_and_any([total / self.args.accumulation_steps for total in self.totals.values()],
                                   self.stop_signal.received is not None, self.info)
        self.stop = self.stop or stop
        return dict(zip(self.totals, means))

    def optimizer_step(self, optimizer, params, loss, grad_clip, ema=None):
        """Clip the gradients of `params`, step `optimizer` (or each of a list) and update `ema`; -> the gradient
        norm. A loss or a gradient norm that is not finite (the same on every rank: both are global, sharded
        gradients included) skips the update instead, -> None; ten in a row stop the run."""
        grad_norm = to_item(torch.nn.utils.clip_grad_norm_(params, grad_clip)) if math.isfinite(loss) else None
        if grad_norm is not None and math.isfinite(grad_norm):
            self.nan_streak = 0
            for opt in as_list(optimizer):
                opt.step()
            if ema is not None:
                ema.update(self.step)
        else:
            what = f"loss is {loss}" if grad_norm is None else f"gradient norm is {grad_norm}"
            self.skipped, self.nan_streak, grad_norm = True, self.nan_streak + 1, None
            self.log(f"warning: {what} at step {self.step}; update skipped ({self.nan_streak} in a row)")
            if self.nan_streak >= NAN_STEPS_LIMIT:
                raise UserError(f"loss was not finite for {self.nan_streak} steps in a row (last good save in "
                                f"{self.args.save_dir}): lower --learning_rate or check the data")
        for opt in as_list(optimizer):
            opt.zero_grad(set_to_none=True)
        return grad_norm

    def end_step(self):
        """The step's samples counted (and, with --log_sample_ids, every rank's gathered) and its speed taken:
        what follows (validation, the save, the grid) is not timed."""
        self.images_per_s = self.global_batch / (time.perf_counter() - self.started)
        self.consumed, self.samples_seen = self.consumed + self.global_batch, self.samples_seen + self.global_batch
        if self.args.log_sample_ids and self.info.world_size > 1:
            per_rank = [None] * self.info.world_size
            dist.all_gather_object(per_rank, self.ids)
            self.ids = [i for rank_ids in per_rank for i in rank_ids]
