"""The Checkpointer saves and resumes a run's resume checkpoint, and does nothing else:

    stem = checkpoint_stem(args.save_dir, name)
    saved = find_resume(args.from_resume, stem, info)     # below: read and verified, or None
    ...
    checkpointer = Checkpointer(stem, info, spec, position, {"model": model, "optimizer": ..., "ema": ema})
    checkpointer.restore(saved)                           # a fresh run: nothing to restore (trainer_utils.resume_run)
    ...
    if position.due(args.save_interval) or stopping:     # the stage decides; trainer_utils.save_step saves
        written = checkpointer.save()

It holds the run's position (trainer/mechanics/position.py) and its named objects, anything with state_dict()
and load_state_dict() (networks, optimizers, EMAs, the metrics' wandb id), the run's spec (RunSpec, below: what a
resume compares) and every rank's random streams. The stage decides when to save; trainer_utils.save_step calls
this and then writes what other tools read (the exported weights). Only rank 0 writes, except in a sharded run
(--fsdp 1), where every rank writes its shards of the named objects (trainer/mechanics/sharded_checkpoint.py) and
rank 0 the rest; the manifest commits them all (model/checkpoint.py).

Finding a resume checkpoint (every process reads it, all stop together if one cannot) and checking that it can
continue this run: the same stage, what is trained, the identity arguments; recipe changes only when forced. What
a start says of it, in lines the stage logs.
"""
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.checkpoint import (
    CheckpointError, checkpoint_file, load_torch, manifest_path, read_manifest, remove_leftovers, save_checkpoint,
    stem_of, step_file,
)
from model.errors import UserError
from model.file_io import drop_pages, mapped_ranges
from trainer.mechanics.distributed import conform
from trainer.mechanics.state import leaves


def checkpoint_stem(save_dir, name):
    """Where the run `name` keeps its resume checkpoint: checkpoints/<run>_resume (.json, and the step's files)."""
    return os.path.join(save_dir, f"{name}_resume")


class Checkpointer:
    """The resume checkpoint at `stem` (checkpoints/<run>_resume) of the run `spec` describes (RunSpec), holding
    `position` and the named `objects` (a None object is saved as None and not restored), on info's processes.
    Rank 0 first deletes what a killed save left half-written."""

    def __init__(self, stem, info, spec, position, objects):
        self.stem, self.info, self.spec, self.position, self.objects = stem, info, spec, position, objects
        if info.is_main:
            remove_leftovers(stem)

    def restore(self, state):
        """Continue the position and each named object from `state` (find_resume's; None: a fresh run, nothing to
        restore), each laid out as the run holds it now: shards read from the DCP folder into any layout, or whole
        tensors from the resume file (cut into this process's shards if the run is sharded). Strict: a missing
        object or a key that does not fit is a one-line error. A None saved state (an EMA the saved run did not
        keep yet) is given to its object as None."""
        if state is None:
            return
        where, objects = state["manifest"], {name: obj for name, obj in self.objects.items() if obj is not None}
        missing = [name for name in objects if name not in state]
        if missing:
            raise UserError(f"{where} holds no {', '.join(missing)}: it was saved by another kind of run")
        saved, shards = {name: state[name] for name in objects}, state.get("shards")
        try:
            if shards or self.info.sharded:  # the run's own state dicts give the layout
                from trainer.mechanics.sharded_checkpoint import read_shards  # DCP: sharded runs only (1 s of imports)

                current = {name: objects[name].state_dict() for name, value in saved.items() if value is not None}
                ours = {name: saved[name] for name in current}
                saved.update(read_shards(os.path.join(os.path.dirname(where), shards), ours, current, where) if shards
                             else conform(ours, current))
            mapped = mapped_ranges(stem_of(where))  # the resume file's pages: let go as each object has its state
            for name, value in saved.items():
                objects[name].load_state_dict(value)
                for tensor in leaves(value).values():
                    drop_pages(tensor, mapped)
        except (ValueError, RuntimeError) as e:  # strict: names the keys that do not fit
            raise UserError(f"{where} does not fit this run: {' '.join(str(e).split())[:400]}") from None
        # the position and random streams last: an optimizer's state may be built by a step (torch's own for
        # torchao's), which may draw from them (stochastic rounding)
        self.position.load_state_dict(state)

    def save(self):
        """Write the resume checkpoint (every process calls it): the position with every rank's random streams,
        the run's spec, each named object's state; verified, then committed by its manifest. A sharded run writes
        the objects' tensors as DCP shards, every rank its own. -> the bytes of the whole checkpoint on rank 0, 0
        on the others."""
        spec, position = self.spec, self.position
        state = {"kind": "resume", "stage": spec.stage, "trained": spec.trains, "args": spec.arguments,
                 "resolved": spec.resolved, "shards": None, **position.state_dict()}
        clash = set(state) & set(self.objects)
        if clash:
            raise ValueError(f"object names {sorted(clash)} are taken by the resume checkpoint's own keys")
        if not (self.info.is_main or self.info.sharded):
            return 0
        states = {name: obj.state_dict() if obj is not None else None for name, obj in self.objects.items()}
        shards = {}
        if self.info.sharded:  # the tensors as DCP shards, the rest in the .pt
            from trainer.mechanics.sharded_checkpoint import split_tensors, write_shards

            folder = step_file(self.stem, position.step, ".dcp")
            states, tensors = split_tensors(states)
            shards, state["shards"] = write_shards(folder, tensors, self.info), os.path.basename(folder)
        if not self.info.is_main:
            return 0
        state.update(states)  # torch.save copies GPU tensors to the CPU one at a time as it writes
        manifest = {"kind": "resume", "stage": spec.stage, "preset": spec.arguments["preset"],
                    "samples_seen": position.samples_seen, "world_size": self.info.world_size,
                    "dtype": spec.resolved.get("dtype")}
        return save_checkpoint(self.stem, position.step, manifest, {".pt": state}, written=shards)


def resume_stem(from_resume, default_stem):
    """The stem of the resume checkpoint --from_resume names: None for "0", `default_stem` for "1" (continued if
    it is there), else the stem of the path given."""
    from_resume = str(from_resume)
    if from_resume in ("0", ""):
        return None
    return default_stem if from_resume == "1" else stem_of(from_resume)


def find_resume(from_resume, default_stem, info):
    """-> the state of the resume checkpoint --from_resume names, to continue (with "manifest": the path it was read
    through), or None to start fresh. `from_resume` is "0", "1" (the checkpoint at `default_stem`, if there is
    one) or a path. Every process reads the file itself (memory-mapped), so the save folder must be one that every
    node sees; the processes share the hashing of its files. If any process fails, all stop with a one-line
    error."""
    from_resume, stem = str(from_resume), resume_stem(from_resume, default_stem)
    if stem is None:
        return None
    error, state = None, None
    try:
        if from_resume != "1" or os.path.exists(manifest_path(stem)):
            manifest = read_manifest(stem, "resume", share=(info.rank, info.world_size))
            state = load_torch(checkpoint_file(stem, manifest, ".pt"))
    except CheckpointError as e:
        error = str(e)
    ok, found = error is None, state is not None
    if info.world_size > 1:
        counts = torch.tensor([ok, found], dtype=torch.float64, device=info.device)
        dist.all_reduce(counts)
        ok, found = counts[0].item() == info.world_size, counts[1].item()
        if error is None and ok and 0 < found < info.world_size:
            raise UserError(f"only {found:.0f} of {info.world_size} processes see {manifest_path(stem)}: "
                            "--save_dir must be on a filesystem that every node sees")
    if error is not None:
        raise CheckpointError(error)
    if not ok:
        raise UserError("another process could not read the resume checkpoint (its error is above)")
    if isinstance(state, dict):
        state = {**earlier_layout(state), "manifest": manifest_path(stem)}
    return state


def earlier_layout(state):
    """A resume file from before the metrics had their own entry and the position its micro-batch size, in
    today's layout: the wandb run's id under "metrics", the micro-batch size that of its arguments."""
    if "metrics" not in state and "args" in state:
        state = {**state, "metrics": {"wandb_id": state.get("wandb_id")},
                 "batch_size": state.get("batch_size", state["args"].get("batch_size"))}
        state.pop("wandb_id", None)
    return state


# What runs saved before an argument existed did, by its name: their frozen transformers were held in fp32, and
# their captions were read whole, unprefixed, unshuffled, unflipped, with no images held out.
EARLIER_VALUES = {"frozen_dtype": "fp32", "caption_prefix": "", "caption_suffix": "", "caption_lines": "join",
                  "random_flip": 0.0, "shuffle_tags": 0, "keep_tags": 0, "val_fraction": 0.0, "trained_dtype": "fp32",
                  "stochastic_rounding": 1, "step_in_backward": 0, "route_ratio": 0.0, "route_first": 2,
                  "route_last": -2, "adapter": "lora", "lokr_factor": -1, "train_text_encoders": (),
                  "text_encoder_steps": 0}


@dataclass(frozen=True)
class RunSpec:
    """What a resume checkpoint records of its run, and a resume compares: the stage, what it trains (`trains`,
    e.g. a LoRA's base weights; it must match), the arguments as parsed (`arguments`: vars(args)) with each one's
    resume kind (`kinds`: args.resume_kinds, trainer/arguments.py), and the settings decided from them at
    start-up (`resolved`: the prediction the start weights have for --prediction unset, the precision...),
    compared in their place."""
    stage: str
    trains: dict
    arguments: dict
    kinds: dict
    resolved: dict


def check_resume(state, spec, dataset_size, not_shorter=False):
    """Raise a one-line UserError if `state` cannot continue the run `spec` describes; -> the recipe changes
    accepted by --force_resume (empty when nothing changed). `not_shorter`: the schedule does not end earlier than
    the saved one, so changed lengths (--max_steps, --epochs) are no recipe change."""
    if not isinstance(state, dict) or state.get("kind") != "resume":
        raise UserError("the resume file is not a MiniSD3 resume checkpoint")
    if state["stage"] != spec.stage:
        raise UserError(f"the resume checkpoint is from stage '{state['stage']}', not '{spec.stage}'")
    saved_trains = state.get("trained", {"kind": "full"})
    if saved_trains != spec.trains:
        raise UserError(f"the resume checkpoint trained {json.dumps(saved_trains)}, this run would train "
                        f"{json.dumps(spec.trains)}: resume from what it started with, or start a fresh run")
    # a checkpoint saves the resolved settings beside the arguments as parsed (one from before kept them in its
    # arguments); an argument this stage no longer has changes nothing; one the file lacks is compared as None
    saved = {**EARLIER_VALUES, **state["args"], **state.get("resolved", {})}
    now, kinds = {**spec.arguments, **spec.resolved}, spec.kinds
    changed = sorted(k for k in now if saved.get(k) != now[k] and kinds.get(k) != "free")

    def change(k):
        return f"--{k} {saved.get(k)} (saved) vs {now.get(k)} (now)"

    identity = [change(k) for k in changed if kinds.get(k) == "identity"]
    if identity:
        raise UserError("cannot resume, the run was started with other settings: " + "; ".join(identity) +
                        " (start a fresh run to change them)")
    recipe = [change(k) for k in changed if not (kinds.get(k) == "length" and not_shorter)]
    if state["dataset_size"] != dataset_size:
        recipe.append(f"dataset size {state['dataset_size']} (saved) vs {dataset_size} (now)")
    if recipe and not spec.arguments["force_resume"]:
        raise UserError("cannot resume with changed settings: " + "; ".join(recipe) +
                        " (pass --force_resume 1 to continue with the new values)")
    return recipe


def resume_lines(state, spec, position, stem):
    """What a start says of resuming, after checking that `state` (a resume checkpoint, or None) fits the run
    (check_resume; a refusal is a one-line UserError): a fresh run's word on the checkpoint at `stem` it does not
    continue, or the recipe changes --force_resume accepted, a longer schedule, another number of processes, and
    where the run goes on. `position`: the run's, before it is restored."""
    if state is None:
        if str(spec.arguments["from_resume"]) == "1":
            return [f"no resume checkpoint at {manifest_path(stem)}: starting from scratch"]
        if os.path.exists(manifest_path(stem)):
            return [f"warning: starting a fresh run; the resume checkpoint at {manifest_path(stem)} will be replaced "
                    "at the first save (pass --from_resume 1 to continue it instead)"]
        return []
    args = state["args"]
    saved_plan = position.planned_steps(args["max_steps"], args["epochs"], state["plan_batch"])
    plan = position.planned_steps(position.max_steps, position.epochs, state["plan_batch"])
    lines = [f"warning: resuming with a changed setting (--force_resume): {change}"
             for change in check_resume(state, spec, len(position.dataset), not_shorter=plan >= saved_plan)]
    if plan > saved_plan:
        lines.append(f"the schedule now ends at step {plan} (it was to end at step {saved_plan}): the learning rate "
                     "follows the longer schedule from here")
    if (state["world_size"], state["global_batch"]) != (position.info.world_size, position.global_batch):
        lines.append(f"resuming with {position.info.world_size} process(es) and global batch {position.global_batch} "
                     f"(saved: {state['world_size']}, {state['global_batch']}): {state['samples_seen']} samples seen, "
                     f"epoch {state['epoch']} continues at sample {state['consumed']} of its permutation")
    lines.append(f"resumed {state['manifest']} at step {state['step']} (epoch {state['epoch']}, "
                 f"{state['samples_seen']} samples seen)")
    return lines


def resumed_dtype(state, world_size):
    """What the run a resume continues computed in (its resolved dtype), where it ran on as many processes; or
    None: --dtype fast keeps it, so the trajectory goes on as it began."""
    if state is None or state.get("world_size") != world_size:
        return None
    return state.get("resolved", {}).get("dtype")
