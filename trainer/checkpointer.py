"""The Checkpointer saves and resumes a run's resume checkpoint, and does nothing else:

    stem = checkpoint_stem(args.save_dir, name)
    saved = find_resume(args.from_resume, stem, info)     # trainer/resume.py: read and verified, or None
    ...
    checkpointer = Checkpointer(stem, info, spec, position, {"model": model, "optimizer": ..., "ema": ema})
    checkpointer.restore(saved)                           # a fresh run: nothing to restore (outputs.resume_run)
    ...
    if position.step % args.save_interval == 0 or ...:
        written = checkpointer.save()

It holds the run's position (trainer/position.py) and its named objects, anything with state_dict() and
load_state_dict() (networks, optimizers, EMAs, the metrics' wandb id), the run's spec (trainer/resume.RunSpec:
what a resume compares) and every rank's random streams. The stage decides when to save, and writes what other
tools read (the exported weights) itself. Only rank 0 writes, except in a sharded run (--fsdp 1), where every rank
writes its shards of the named objects (trainer/sharded_checkpoint.py) and rank 0 the rest; the manifest commits
them all (model/checkpoint.py).
"""
import os

from model.checkpoint import remove_leftovers, save_checkpoint, stem_of, step_file
from model.errors import UserError
from model.file_io import drop_pages, mapped_ranges
from trainer.parallel import conform
from trainer.trainer_utils import leaves


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
                from trainer.sharded_checkpoint import read_shards  # DCP: sharded runs only (1 s of imports)

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
            from trainer.sharded_checkpoint import split_tensors, write_shards

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
