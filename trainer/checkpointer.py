"""The Checkpointer owns a run's saves: it finds the resume checkpoint (--from_resume), checks it and restores the
run from it, and saves on its cadence, every --save_interval steps, at the end and on a stop signal:

    checkpointer = Checkpointer(args, info, "pretrain", name, metrics)  # reads which resume checkpoint, if any
    checkpointer.start(run, export, exported=ema or model, model=model, optimizer=..., ema=ema)
    for batches in run.steps(train_model):
        ...
        checkpointer.save(run)    # when due: the resume checkpoint, then the export, each committed by a manifest

The resume checkpoint holds the tracked objects (anything with state_dict() and load_state_dict(): networks,
optimizers, EMAs), the data position and every rank's random streams; the export (model/weights.py's
WeightsExport, model/model_lora.py's LoRAExport) writes what other tools read. Only rank 0 writes files, except in
a sharded run (--fsdp 1), where every rank writes its shards of the resume checkpoint (trainer/sharded_checkpoint.py)
and the exported weights are gathered to rank 0.
"""
import argparse
import os
import signal
import time

import torch.distributed as dist

from dataset.samplers import BucketSampler
from dataset.training_data import warn_truncated
from model.checkpoint import manifest_path, remove_leftovers, save_checkpoint, stem_of, step_file
from model.errors import UserError
from trainer.parallel import NamedOptimizerState, as_list, conform, gathered
from trainer.resume import check_resume, find_resume, saved_record
from trainer.sharded_checkpoint import read_shards, split_tensors, write_shards
from trainer.trainer_utils import rng_state, set_rng_state, to_cpu


class Checkpointer:
    """The resume checkpoint and the save cadence of one run (the module's docstring shows its use)."""

    def __init__(self, args, info, stage, name, metrics):
        self.args, self.info, self.stage, self.name = args, info, stage, name
        self.metrics, self.log = metrics, metrics.log
        self.stem = os.path.join(args.save_dir, f"{name}_resume")
        self.saved = saved_record(args.from_resume, self.stem)

    @property
    def resumed_dtype(self):
        """What the run it resumes computed in (its manifest says; same number of processes only), or None."""
        same = self.saved is not None and self.saved.get("world_size") == self.info.world_size
        return self.saved.get("dtype") if same else None

    def start(self, run, export, exported, identity=None, resolved=None, **tracked):
        """Resume `run` and the named `tracked` objects from the resume checkpoint if asked (else start fresh).
        `export`: what each save exports (its .output, its .write(step, weights, samples_seen)); `exported`: whose
        state_dict() it writes; `identity`: what is trained, which a resume must match (by default the whole
        model); `resolved`: the settings decided at start-up from the arguments (prediction, precision...), saved
        and compared beside them."""
        self.export, self.exported, self.tracked = export, exported, tracked
        self.identity, self.resolved = identity or {"kind": "full"}, resolved or {}
        if self.info.is_main:  # whatever a killed run left half-written
            for stem in (stem_of(export.output), self.stem, os.path.join(self.args.out_dir, "samples", self.name)):
                remove_leftovers(stem)
        resume_from, state = find_resume(str(self.args.from_resume), self.stem, self.info)
        if state is not None:
            run.plan(state["plan_batch"])
            self._resume(run, state, manifest_path(resume_from))
        elif self.args.from_resume == "1":
            self.log(f"no resume checkpoint at {manifest_path(self.stem)}: starting from scratch")
        elif os.path.exists(manifest_path(self.stem)):
            self.log(f"warning: starting a fresh run; the resume checkpoint at {manifest_path(self.stem)} "
                     "will be replaced at the first save (pass --from_resume 1 to continue it instead)")
        self.wandb_id = self.metrics.open(run.step, run.step + run.steps_left, run.resumed,
                                          state["wandb_id"] if state is not None else None)
        self._describe(run)

    def _resume(self, run, state, where):
        saved_plan = run.planned_steps(argparse.Namespace(**state["args"]))
        for change in check_resume(state, self.args, self.stage, len(run.dataset), self.identity,
                                   not_shorter=run.plan_steps >= saved_plan, resolved=self.resolved):
            self.log(f"warning: resuming with a changed setting (--force_resume): {change}")
        if isinstance(run.sampler, BucketSampler) and state["args"]["batch_size"] != self.args.batch_size:
            raise UserError(f"cannot resume bucketed data with --batch_size {self.args.batch_size}: its epochs are "
                            f"planned in micro-batches of {state['args']['batch_size']} (change "
                            "--accumulation_steps instead)")
        if run.plan_steps > saved_plan:
            self.log(f"the schedule now ends at step {run.plan_steps} (it was to end at step {saved_plan}): the "
                     "learning rate follows the longer schedule from here")
        missing = [name for name, obj in self.tracked.items() if obj is not None and name not in state]
        if missing:
            raise UserError(f"{where} holds no {', '.join(missing)}: it was saved by another kind of run")
        try:
            self._restore(state, where)
        except (ValueError, RuntimeError) as e:  # strict: names the keys that do not fit
            raise UserError(f"{where} does not fit this run: {' '.join(str(e).split())[:400]}") from None
        run.resumed = True
        run.step, run.epoch, run.consumed, run.samples_seen = (state[k] for k in
                                                                ("step", "epoch", "consumed", "samples_seen"))
        if state["world_size"] == self.info.world_size and state["global_batch"] == run.global_batch:
            set_rng_state(state["rng"][self.info.rank], run.generator, self.info.device)
        else:  # the data position carries over exactly; the noise stream restarts, seeded by step and rank
            run.generator.manual_seed(self.args.seed * 1000 + self.info.rank + 7919 * run.step)
            self.log(f"resuming with {self.info.world_size} process(es) and global batch {run.global_batch} (saved: "
                     f"{state['world_size']}, {state['global_batch']}): {run.samples_seen} samples seen, epoch "
                     f"{run.epoch} continues at sample {run.consumed} of its permutation")
        self.log(f"resumed {where} at step {run.step} (epoch {run.epoch}, {run.samples_seen} samples seen)")

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

    def _describe(self, run):
        """One line: what trains, on how much data, in how many steps, on how many processes."""
        trainable = {id(p): p.numel() for obj in self.tracked.values() if isinstance(obj, NamedOptimizerState)
                     for opt in as_list(obj.optimizer) for group in opt.param_groups for p in group["params"]}
        info = self.info
        how = f"FSDP over mesh {tuple(info.mesh.shape)}" if info.sharded else \
            "DDP" if info.world_size > 1 else "one process"
        self.log(f"{self.stage}: {sum(trainable.values()) / 1e6:.1f}M trainable parameters, {len(run.dataset)} "
                 f"samples, global batch {run.global_batch}, {run.step + run.steps_left} steps, {info.world_size} "
                 f"process(es) on {info.device.type} ({how})")

    # ------------------------------------------------------------------------------------------------------------
    # Saving

    def due(self, run):
        return run.step % self.args.save_interval == 0 or run.finished or run.stop

    def save(self, run):
        """When due: the resume checkpoint (every tracked object, the data position, every rank's random streams),
        then the export of the exported object's weights, whole: if the export is cut short, training can still
        continue. A sharded run writes the tensors of the resume checkpoint as DCP shards, every rank its own,
        and the manifest commits them with the rest."""
        if not self.due(run):
            return
        rng = [rng_state(run.generator, self.info.device)]
        if self.info.world_size > 1:
            rng = [None] * self.info.world_size
            dist.all_gather_object(rng, rng_state(run.generator, self.info.device))
        if not (self.info.is_main or self.info.sharded):
            return
        t0 = time.perf_counter()
        state = self._state(run, rng)
        states = {name: obj.state_dict() if obj is not None else None for name, obj in self.tracked.items()}
        shards = {}
        if self.info.sharded:  # the tensors as DCP shards, the rest in the .pt
            folder = step_file(self.stem, run.step, ".dcp")
            states, tensors = split_tensors(states)
            shards, state["shards"] = write_shards(folder, tensors, self.info), os.path.basename(folder)
        weights = gathered(self.exported.state_dict(), self.info)
        if not self.info.is_main:
            return
        state.update(to_cpu(states))
        record = {"kind": "resume", "stage": self.stage, "preset": self.args.preset, "samples_seen": run.samples_seen,
                  "world_size": self.info.world_size, "dtype": self.resolved.get("dtype")}
        written = save_checkpoint(self.stem, run.step, record, {".pt": state}, written=shards)
        written += self.export.write(run.step, weights, run.samples_seen)
        self.log(f"saved step {run.step}: {written / 1e6:.0f} MB written and verified in "
                 f"{time.perf_counter() - t0:.1f} s")
        self.metrics.plot(run.step)

    def _state(self, run, rng):
        state = {"kind": "resume", "stage": self.stage, "step": run.step, "epoch": run.epoch,
                 "consumed": run.consumed, "samples_seen": run.samples_seen, "world_size": self.info.world_size,
                 "global_batch": run.global_batch, "plan_batch": run.plan_batch, "dataset_size": len(run.dataset),
                 "trained": self.identity, "rng": to_cpu(rng), "wandb_id": self.wandb_id, "args": vars(self.args),
                 "resolved": self.resolved, "shards": None}
        clash = set(state) & set(self.tracked)
        if clash:
            raise ValueError(f"tracked names {sorted(clash)} are taken by the resume checkpoint's own keys")
        return state

    def finish(self, run, components):
        """The run's last lines: captions cut short (when encoding as it trained), and where the output is, or how
        to continue a stopped run."""
        warn_truncated(components, self.info, self.log)
        if run.stop:
            received = run.stop_signal.received
            what = signal.Signals(received).name if received else "a stop signal on another rank"
            self.log(f"stopped by {what} at step {run.step}, checkpoint saved: continue with --from_resume 1")
        else:
            self.log(f"done: {self.export.output} (step {run.step})")


def export_record(args, stage, prediction, sampling, config, components, **extra):
    """What the exported weights' manifest records: how to rebuild and sample them, and the run's arguments (the
    export adds the samples seen, and a LoRA file the step, at each save)."""
    return {"stage": stage, "preset": args.preset, "resolution": args.resolution,
            "prediction": prediction, "ema": args.ema_decay > 0, "save_dtype": args.save_dtype,
            "transformer": config.to_dict(), "components": components.spec, "sampling": sampling, **extra,
            "args": vars(args)}
