"""TrainingRun, the bookkeeper of one run, the same in every stage. The stage names what the resume checkpoint
holds (its networks, optimizers and EMAs: anything with state_dict() and load_state_dict()) and what its export
writes, and loops:

    run.start(dataset, components, prompts, output, exported=ema or model, model=model,
              optimizer=NamedOptimizerState(model, optimizer), ema=ema)
    for batches in run.steps(train_model):
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        loss = run.backward(batches, lambda batch: <the stage's loss of one micro-batch>)
        grad_norm = run.optimizer_step(optimizer, params, loss, args.grad_clip, ema)
        run.end_step(export, sample_model, loss=loss, lr=lr, grad_norm=grad_norm)

It keeps the data position in samples (samples_seen; the epoch and `consumed`, the position in it) and the
schedule in steps of the global batch the run started with (plan_batch), so a resume with another number of
processes continues the same epoch and the same schedule. It writes the metrics, the resume checkpoint and the
sample grids on their cadence; the stage's `export(step, weights)` writes the weights. Only rank 0 writes files,
except in a sharded run (--fsdp 1), where every rank writes its shards of the resume checkpoint
(trainer/sharded_checkpoint.py), the exported weights are gathered to rank 0, and every rank draws the sample
grids (each forward needs them all).
"""
import argparse
import contextlib
import json
import math
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dataset.buckets import bucket_layout
from dataset.samplers import BucketSampler, make_sampler
from dataset.samples import epoch_view
from dataset.training_data import warn_truncated
from eval.eval_loss import heldout_losses
from eval.plot_metrics import plot_runs
from eval.sampling import sample_images, save_grid
from model.checkpoint import manifest_path, remove_leftovers, save_checkpoint, stem_of, step_file
from model.errors import UserError
from model.precision import resolve_dtype, resolve_frozen_dtype
from trainer.arguments import autocast_dtype
from trainer.parallel import NamedOptimizerState, as_list, conform, gathered, to_item
from trainer.sharded_checkpoint import read_shards, split_tensors, write_shards
from trainer.trainer_utils import (
    StopSignal, check_resume, find_resume, ignore_sigint, lr_at, mean_and_any, rng_state, set_rng_state, to_cpu,
    truncate_metrics,
)

NAN_STEPS_LIMIT = 10  # this many non-finite losses in a row stop the run


def resolve_precision(args, dtype_given, device, stage, frozen_transformer, why):
    """--frozen_dtype as held (model/precision.py), and a transformer held frozen in bf16 or int8 computes under
    bf16 autocast (args.dtype set so). -> (frozen dtype, why the run computes in args.dtype)."""
    frozen, _ = resolve_frozen_dtype(getattr(args, "frozen_dtype", "auto"), dtype_given, device,
                                     bool(getattr(args, "base", None)))
    if frozen == "int8" and not frozen_transformer:
        raise UserError(f"--frozen_dtype int8 quantises a frozen transformer, and the {stage} stage trains every "
                        "weight of its own: use it with trainer/train_lora.py, or drop it")
    if frozen_transformer and frozen != "fp32" and args.dtype == "fp32":
        if dtype_given == "fp32":
            raise UserError(f"--dtype fp32 with --frozen_dtype {frozen}: a transformer held in {frozen} computes in "
                            "bf16; drop --dtype fp32, or pass --frozen_dtype fp32")
        args.dtype, why = "bf16", f"the frozen transformer is held in {frozen}"
    return frozen, why


class TrainingRun:
    """The bookkeeper of one run (the module's docstring shows how a stage uses it)."""

    def __init__(self, args, info, stage, name, sampling=None, cpu_bf16=True, frozen_transformer=False):
        """`sampling`: how the sample grids draw and the export records it is drawn (eval.sampling.sample_images's
        settings); by default the stage's --sample_steps, --sample_cfg and --sample_shift. `cpu_bf16`: whether
        --dtype fast may take bf16 on a CPU (model/precision.py); a stage whose loss compares two predictions
        closer than bf16 resolves says no. `frozen_transformer`: whether the stage holds a transformer that does
        not train (a LoRA base, a teacher, a reference), which --frozen_dtype applies to."""
        self.args, self.info, self.stage, self.name, self.device = args, info, stage, name, info.device
        self.given_sampling = sampling
        self.resume_stem = os.path.join(args.save_dir, f"{name}_resume")
        self.metrics_path = os.path.join(args.out_dir, f"{name}_metrics.jsonl")
        self.generator = torch.Generator().manual_seed(args.seed * 1000 + info.rank)  # sigmas, noise, dropout
        self.global_batch = args.batch_size * args.accumulation_steps * info.world_size
        self.step = self.epoch = self.consumed = self.samples_seen = self.nan_streak = 0
        self.plan_batch, self.wandb_id, self.bar, self.wandb_run = self.global_batch, None, None, None
        self.stop, self.skipped, self.ids, self.resumed, self.last_val = False, False, [], False, None
        self.stop_signal = StopSignal()
        # --dtype auto or fast decided once, here (fast on a CPU measures whether bf16 pays); saved with the args
        self.dtype_given = args.dtype
        args.dtype, why = resolve_dtype(args.dtype, info.device, info.world_size > 1, cpu_bf16)
        args.frozen_dtype, why = resolve_precision(args, self.dtype_given, info.device, stage, frozen_transformer, why)
        if self.dtype_given in ("auto", "fast") or why.startswith("the frozen"):
            self.log(f"computing in {args.dtype} ({why})")
        if frozen_transformer or getattr(args, "base", None):
            self.log(f"frozen networks held in {args.frozen_dtype}")

    def log(self, msg):
        """Print on rank 0 only (through the progress bar while it shows, so lines do not break it)."""
        if self.info.is_main:
            if self.bar is not None:
                self.bar.write(msg)
            else:
                print(msg, flush=True)

    @property
    def sampling(self):
        a = self.args
        return self.given_sampling or {"steps": a.sample_steps, "cfg": a.sample_cfg, "shift": a.sample_shift}

    @property
    def finished(self):
        return self.samples_seen >= self.total_samples

    # ------------------------------------------------------------------------------------------------------------
    # Start: resume or start fresh, and plan

    def start(self, dataset, components, prompts, output, exported, identity=None, first_grid=None, validation=None,
              **tracked):
        """Resume the named `tracked` objects from the resume checkpoint if asked (else start fresh) and plan the
        run over `dataset`. `output`: what the stage exports (its manifest or file); `exported`: whose state_dict()
        the export writes; `identity`: what is trained, which a resume must match (by default the whole model);
        `first_grid`: a fresh run draws a step-0 sample grid with `first_grid()` (a fine-tune's starting weights,
        to compare with); `validation`: the validation images, encoded (start_up's), scored every --val_interval
        steps."""
        self.validation = validation
        if len(dataset) < self.global_batch:
            raise UserError(f"the dataset has {len(dataset)} samples, fewer than one global batch "
                            f"({self.global_batch} = batch_size x accumulation_steps x processes): lower --batch_size")
        self.dataset, self.components, self.prompts, self.output = dataset, components, prompts, output
        self.tracked, self.exported, self.identity = tracked, exported, identity or {"kind": "full"}
        if self.info.is_main:  # whatever a killed run left half-written
            for stem in (stem_of(output), self.resume_stem, os.path.join(self.args.out_dir, "samples", self.name)):
                remove_leftovers(stem)
        resume_from, state = find_resume(str(self.args.from_resume), self.resume_stem, self.info)
        self._plan(state)
        if state is not None:
            self._resume(state, manifest_path(resume_from))
        elif self.args.from_resume == "1":
            self.log(f"no resume checkpoint at {manifest_path(self.resume_stem)}: starting from scratch")
        elif os.path.exists(manifest_path(self.resume_stem)):
            self.log(f"warning: starting a fresh run; the resume checkpoint at {manifest_path(self.resume_stem)} "
                     "will be replaced at the first save (pass --from_resume 1 to continue it instead)")
        self._open_logs()
        if first_grid is not None and not self.resumed:
            self.sample_grid(first_grid)
            if self.validation:  # the starting weights' validation loss: what a fine-tune must improve on
                self._write_row({"step": 0, "epoch": 0, "val_loss": self.validate(first_grid), "samples_seen": 0})

    def _resume(self, state, where):
        saved_plan = self._planned_steps(argparse.Namespace(**state["args"]))
        for change in check_resume(state, self.args, self.stage, len(self.dataset), self.identity,
                                   not_shorter=self.plan_steps >= saved_plan):
            self.log(f"warning: resuming with a changed setting (--force_resume): {change}")
        if isinstance(self.sampler, BucketSampler) and state["args"]["batch_size"] != self.args.batch_size:
            raise UserError(f"cannot resume bucketed data with --batch_size {self.args.batch_size}: its epochs are "
                            f"planned in micro-batches of {state['args']['batch_size']} (change "
                            "--accumulation_steps instead)")
        if self.plan_steps > saved_plan:
            self.log(f"the schedule now ends at step {self.plan_steps} (it was to end at step {saved_plan}): the "
                     "learning rate follows the longer schedule from here")
        saved_dtype = state["args"].get("dtype")
        if self.dtype_given == "fast" and saved_dtype in ("bf16", "fp32") and saved_dtype != self.args.dtype and \
                state["world_size"] == self.info.world_size:
            self.args.dtype = saved_dtype  # the trajectory goes on as it began, whatever today's check says
            self.log(f"computing in {saved_dtype}, as the run it resumes did")
        missing = [name for name, obj in self.tracked.items() if obj is not None and name not in state]
        if missing:
            raise UserError(f"{where} holds no {', '.join(missing)}: it was saved by another kind of run")
        try:
            self._restore(state, where)
        except (ValueError, RuntimeError) as e:  # strict: names the keys that do not fit
            raise UserError(f"{where} does not fit this run: {' '.join(str(e).split())[:400]}") from None
        self.resumed = True
        self.step, self.epoch, self.consumed = state["step"], state["epoch"], state["consumed"]
        self.samples_seen, self.wandb_id = state["samples_seen"], state["wandb_id"]
        if state["world_size"] == self.info.world_size and state["global_batch"] == self.global_batch:
            set_rng_state(state["rng"][self.info.rank], self.generator, self.device)
        else:  # the data position carries over exactly; the noise stream restarts, seeded by step and rank
            self.generator.manual_seed(self.args.seed * 1000 + self.info.rank + 7919 * self.step)
            self.log(f"resuming with {self.info.world_size} process(es) and global batch {self.global_batch} (saved: "
                     f"{state['world_size']}, {state['global_batch']}): {self.samples_seen} samples seen, epoch "
                     f"{self.epoch} continues at sample {self.consumed} of its permutation")
        self.log(f"resumed {where} at step {self.step} (epoch {self.epoch}, {self.samples_seen} samples seen)")

    def _restore(self, state, where):
        """Load each tracked object's saved state, laid out as the run holds it now: shards read from the DCP
        folder into any layout, or whole tensors from the resume file (cut into this process's shards if the run
        is sharded)."""
        saved = {name: state[name] for name, obj in self.tracked.items() if obj is not None}
        shards = state.get("shards")
        if shards or self.info.sharded:  # the run's own state dicts give the layout
            current = {name: self.tracked[name].state_dict() for name, value in saved.items() if value is not None}
            ours = {name: saved[name] for name in current}
            saved.update(read_shards(os.path.join(os.path.dirname(where), shards), ours, current, where) if shards
                         else conform(ours, current))
        for name, value in saved.items():
            self.tracked[name].load_state_dict(value)  # None: an EMA the saved run did not keep yet

    def _planned_steps(self, args):
        return args.max_steps if args.max_steps > 0 else args.epochs * self.sampler.steps_left(0, self.plan_batch)

    def _plan(self, state):
        """The data order and the schedule: in steps of the global batch the run started with (plan_batch)."""
        a = self.args
        self.sampler = make_sampler(bucket_layout(self.dataset, a.resolution)[0], a.batch_size, self.info.rank,
                                    self.info.world_size, a.seed)
        self.plan_batch = state["plan_batch"] if state is not None else self.global_batch
        self.plan_steps = self._planned_steps(a)
        self.total_samples = self.plan_steps * self.plan_batch

    def _open_logs(self):
        a = self.args
        if self.info.is_main:  # rows past this step belong to an earlier run, or to the lost tail of the resumed one
            os.makedirs(a.out_dir, exist_ok=True)
            truncate_metrics(self.metrics_path, self.step if self.resumed else -1)  # a fresh run keeps no row
        if a.use_wandb and self.info.is_main:
            import wandb

            self.wandb_run = wandb.init(project=a.wandb_project, name=self.name, id=self.wandb_id, resume="allow",
                                        config=vars(a), dir=a.out_dir,
                                        mode="online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb_id = self.wandb_run.id
        trainable = {id(p): p.numel() for obj in self.tracked.values() if isinstance(obj, NamedOptimizerState)
                     for opt in as_list(obj.optimizer) for group in opt.param_groups for p in group["params"]}
        steps_left = math.ceil((self.total_samples - self.samples_seen) / self.global_batch)
        how = f"FSDP over mesh {tuple(self.info.mesh.shape)}" if self.info.sharded else \
            "DDP" if self.info.world_size > 1 else "one process"
        self.log(f"{self.stage}: {sum(trainable.values()) / 1e6:.1f}M trainable parameters, {len(self.dataset)} "
                 f"samples, global batch {self.global_batch}, {self.step + steps_left} steps, {self.info.world_size} "
                 f"process(es) on {self.device.type} ({how})")
        self.bar_span = (self.step, self.step + steps_left)  # the bar opens when the first step ends (_open_bar)

    def _open_bar(self):
        """The progress bar, from the end of the first step on: an error in the first step (the one that meets bad
        data, memory limits, an empty pair set) then prints as one line, with no half-drawn bar around it."""
        if self.info.is_main and self.bar is None:
            from tqdm import tqdm

            first, total = self.bar_span
            self.bar = tqdm(total=total, initial=first, desc=self.stage, dynamic_ncols=True)

    # ------------------------------------------------------------------------------------------------------------
    # The steps

    def steps(self, *models):
        """Yield, step after step, this rank's micro-batches of the step (an iterator; `models` skip the gradient
        all-reduce on all but the last), until the planned samples are seen or a stop signal came. Stop signals are
        caught meanwhile: the step in progress completes, is saved, and the loop ends."""
        a, self.t_last = self.args, time.perf_counter()
        with self.stop_signal:
            while not (self.finished or self.stop):
                if self.sampler.steps_left(self.consumed, self.global_batch) == 0:
                    self.epoch, self.consumed = self.epoch + 1, 0
                # this rank's share of the rest of the epoch; the loader has its own generator: torch's stream untouched
                batches = self.sampler.rank_batches(self.epoch, self.consumed, a.batch_size, self.global_batch)
                loader = zip(batches, torch.utils.data.DataLoader(
                    epoch_view(self.dataset, self.epoch), batch_sampler=batches, num_workers=a.num_workers,
                    worker_init_fn=ignore_sigint, generator=torch.Generator().manual_seed(a.seed)))
                while not (self.finished or self.stop) and self.sampler.steps_left(self.consumed, self.global_batch):
                    self.step, self.skipped, self.ids = self.step + 1, False, []
                    yield self._micro_batches(loader, models)
        self._finish()

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

    def backward(self, micro_batches, loss_of):
        """Forward and backward through each micro-batch (`loss_of(batch)` -> the loss, or a dict of named losses
        whose sum backward takes), gradients accumulated. -> the loss (or each named loss) averaged over
        micro-batches and processes: one all-reduce, which also tells every rank whether any was asked to stop."""
        totals, single = {}, False
        for batch in micro_batches:
            losses = loss_of(batch)
            single = not isinstance(losses, dict)
            losses = {"loss": losses} if single else losses
            (sum(losses.values()) / self.args.accumulation_steps).backward()
            for name, loss in losses.items():
                totals[name] = totals.get(name, 0.0) + loss.item()
        means, stop = mean_and_any([total / self.args.accumulation_steps for total in totals.values()],
                                   self.stop_signal.received is not None, self.info)
        self.stop = self.stop or stop
        return means[0] if single else dict(zip(totals, means))

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

    def end_step(self, export, sample_model, **metrics):
        """Count the step's samples, write its metrics (unless its update was skipped), then save (the resume
        checkpoint, then `export(step, weights)`) and draw a sample grid with `sample_model()` when due:
        every --save_interval / --sample_interval steps, at the end, and (saving only) on a stop signal."""
        images_per_s = self.global_batch / (time.perf_counter() - self.t_last)  # validation, saves, grids: not timed
        self._open_bar()
        self.consumed, self.samples_seen = self.consumed + self.global_batch, self.samples_seen + self.global_batch
        if self.args.log_sample_ids and self.info.world_size > 1:
            per_rank = [None] * self.info.world_size
            dist.all_gather_object(per_rank, self.ids)
            self.ids = [i for rank_ids in per_rank for i in rank_ids]
        if self.validation and (self.step % self.args.val_interval == 0 or self.finished):
            metrics["val_loss"] = self.validate(sample_model)
        if not self.skipped:
            self._write_metrics(metrics, images_per_s)
        if self.bar is not None:
            self.bar.update(1)
        if self.step % self.args.save_interval == 0 or self.finished or self.stop:
            self.save(export)
        if not self.stop and ((self.args.sample_interval and self.step % self.args.sample_interval == 0)
                              or self.finished):
            self.sample_grid(sample_model)
        self.t_last = time.perf_counter()

    def _write_metrics(self, metrics, images_per_s):
        if not self.info.is_main:
            return
        row = {"step": self.step, "epoch": self.epoch, **metrics, "images_per_s": images_per_s,
               "samples_seen": self.samples_seen}
        if self.args.log_sample_ids:
            row["sample_ids"] = self.ids
        self._write_row(row)
        self.last_val = metrics.get("val_loss", self.last_val)  # the bar keeps the last validation loss in view
        shown = {name: f"{value:.2e}" if name == "lr" else f"{value:.4f}" for name, value in
                 {**metrics, "val_loss": self.last_val}.items() if name != "grad_norm" and isinstance(value, float)}
        self.bar.set_postfix(shown, img_s=f"{images_per_s:.0f}")

    def _write_row(self, row):
        """One row of the metrics file (rank 0), and to wandb."""
        if not self.info.is_main:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=row["step"])

    # ------------------------------------------------------------------------------------------------------------
    # Saving, sample grids, the end

    def save(self, export):
        """The resume checkpoint (every tracked object, the data position, every rank's random streams), then the
        stage's `export(step, weights)` with the exported object's weights, whole -> bytes: if the export is cut
        short, training can still continue. A sharded run writes the tensors of the resume checkpoint as DCP
        shards, every rank its own, and the manifest commits them with the rest."""
        rng = [rng_state(self.generator, self.device)]
        if self.info.world_size > 1:
            rng = [None] * self.info.world_size
            dist.all_gather_object(rng, rng_state(self.generator, self.device))
        if not (self.info.is_main or self.info.sharded):
            return
        t0 = time.perf_counter()
        state = {"kind": "resume", "stage": self.stage, "step": self.step, "epoch": self.epoch,
                 "consumed": self.consumed, "samples_seen": self.samples_seen, "world_size": self.info.world_size,
                 "global_batch": self.global_batch, "plan_batch": self.plan_batch, "dataset_size": len(self.dataset),
                 "trained": self.identity, "rng": to_cpu(rng), "wandb_id": self.wandb_id, "args": vars(self.args),
                 "shards": None}
        clash = set(state) & set(self.tracked)
        if clash:
            raise ValueError(f"tracked names {sorted(clash)} are taken by the resume checkpoint's own keys")
        states = {name: obj.state_dict() if obj is not None else None for name, obj in self.tracked.items()}
        shards = {}
        if self.info.sharded:  # the tensors as DCP shards, the rest in the .pt
            folder = step_file(self.resume_stem, self.step, ".dcp")
            states, tensors = split_tensors(states)
            shards, state["shards"] = write_shards(folder, tensors, self.info), os.path.basename(folder)
        weights = gathered(self.exported.state_dict(), self.info)
        if not self.info.is_main:
            return
        state.update(to_cpu(states))
        record = {"kind": "resume", "stage": self.stage, "preset": self.args.preset, "samples_seen": self.samples_seen}
        written = save_checkpoint(self.resume_stem, self.step, record, {".pt": state}, written=shards)
        written += export(self.step, weights)
        self.log(f"saved step {self.step}: {written / 1e6:.0f} MB written and verified in "
                 f"{time.perf_counter() - t0:.1f} s")
        self.plot()

    def validate(self, sample_model):
        """The validation loss of what is exported and sampled (`sample_model()`, e.g. the EMA swapped in):
        eval/eval_loss.py's mean over its fixed sigmas and noise, so the two agree on the same weights. Rank 0
        alone, or every rank of a sharded run (each forward gathers the shards)."""
        if not (self.info.is_main or self.info.sharded):
            return None
        with sample_model() as model:
            was_training = model.training
            model.eval()
            losses = heldout_losses(model, self.validation, self.args.prediction, self.args.seed,
                                    autocast_dtype(self.args.dtype, self.device))
            model.train(was_training)
        return sum(losses.values()) / len(losses)

    def plot(self):
        """The run's curves so far (eval/plot_metrics.py) beside its sample grids; a failure is a warning, never
        the end of training."""
        path = os.path.join(self.args.out_dir, "samples", f"{self.name}_metrics.png")
        try:
            plot_runs([self.metrics_path], path, title=f"{self.name} (step {self.step})")
        except Exception as e:  # a plot is a convenience: the weights are saved already
            self.log(f"warning: could not draw {path}: {' '.join(str(e).split())[:200]}")
            return
        self.log(f"curves: {path}")

    def weights_record(self, config, components, **extra):
        """What the exported weights' manifest records: how to rebuild and sample them, and the run's arguments."""
        a = self.args
        return {"stage": self.stage, "preset": a.preset, "samples_seen": self.samples_seen,
                "resolution": a.resolution, "prediction": a.prediction, "ema": a.ema_decay > 0,
                "save_dtype": a.save_dtype, "transformer": config.to_dict(), "components": components.spec,
                "sampling": self.sampling, **extra,
                "args": vars(a)}

    def sample_grid(self, sample_model):
        """Draw the sample prompts with fixed noise from the model `sample_model()` gives (a context: e.g. the EMA
        weights swapped in while it lasts) into out/samples/<run>_stepNNNNNN.png: rank 0 alone, or every rank of a
        sharded run (each forward gathers the shards), rank 0 writing."""
        if not (self.info.is_main or self.info.sharded):
            return
        a = self.args
        with sample_model() as model:
            images = sample_images(model, self.components, self.prompts, seed=a.seed, **self.sampling,
                                   resolution=a.resolution, device=self.device, prediction=a.prediction,
                                   autocast=autocast_dtype(a.dtype, self.device))
        if not self.info.is_main:
            return
        path = os.path.join(a.out_dir, "samples", f"{self.name}_step{self.step:06d}.png")
        save_grid(path, images, self.prompts)
        self.log(f"sample grid: {path}")

    def _finish(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.info.world_size > 1:
            dist.barrier()  # leave together: rank 0 may still be writing the last save or sample grid
        if self.wandb_run is not None:
            self.wandb_run.finish()
        warn_truncated(self.components, self.info, self.log)  # when encoding as it trained (no cache)
        if self.stop:
            received = self.stop_signal.received
            what = signal.Signals(received).name if received else "a stop signal on another rank"
            self.log(f"stopped by {what} at step {self.step}, checkpoint saved: continue with --from_resume 1")
        else:
            self.log(f"done: {self.output} (step {self.step})")
