"""Finding a resume checkpoint (every process reads it, all stop together if one cannot) and checking that it can
continue this run: the same stage, what is trained, the identity arguments; recipe changes only when forced."""
import json
import os

import torch
import torch.distributed as dist

from model.checkpoint import CheckpointError, checkpoint_file, load_torch, manifest_path, read_manifest, stem_of
from model.errors import UserError


def resume_stem(from_resume, default_stem):
    """The stem of the resume checkpoint --from_resume names: None for "0", `default_stem` for "1" (continued if
    it is there), else the stem of the path given."""
    from_resume = str(from_resume)
    if from_resume in ("0", ""):
        return None
    return default_stem if from_resume == "1" else stem_of(from_resume)


def saved_record(from_resume, default_stem):
    """The record of the resume checkpoint --from_resume names (its manifest alone, read before anything is
    built: what the run computed in), or None; find_resume reads and checks the checkpoint itself later."""
    stem = resume_stem(from_resume, default_stem)
    if stem is None:
        return None
    try:
        with open(manifest_path(stem), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def find_resume(from_resume, default_stem, info):
    """-> (stem, state) of the resume checkpoint to continue, or (stem, None) to start fresh. `from_resume` is
    "0", "1" (the default checkpoint, if there is one) or a path. Every process reads the file itself, so the
    save folder must be one that every node sees; the processes share the hashing of its files. If any process
    fails, all stop with a one-line error."""
    stem = resume_stem(from_resume, default_stem)
    if stem is None:
        return default_stem, None
    error, state = None, None
    try:
        if from_resume != "1" or os.path.exists(manifest_path(stem)):
            record = read_manifest(stem, "resume", share=(info.rank, info.world_size))
            state = load_torch(checkpoint_file(stem, record, ".pt"))
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
    return stem, state


# What runs saved before an argument existed did, by its name: their frozen transformers were held in fp32, and
# their captions were read whole, unprefixed, unshuffled, unflipped, with no images held out.
EARLIER_VALUES = {"frozen_dtype": "fp32", "caption_prefix": "", "caption_suffix": "", "caption_lines": "join",
                  "random_flip": 0.0, "shuffle_tags": 0, "keep_tags": 0, "val_fraction": 0.0}


def check_resume(state, args, stage, dataset_size, identity=None, not_shorter=False, resolved=None):
    """Raise a one-line UserError if `state` cannot continue this run; -> the recipe changes accepted by
    --force_resume (empty when nothing changed). How each argument is treated, args.resume_kinds says
    (trainer/arguments.py). `not_shorter`: the schedule does not end earlier than the saved one, so changed lengths
    (--max_steps, --epochs) are no recipe change. `identity`: what is trained (e.g. the LoRA's base weights),
    which must match. `resolved`: the settings decided at start-up from the arguments (e.g. the prediction the
    start weights have, for --prediction unset), compared in their place: a checkpoint saves them beside the
    arguments as parsed (one from before kept them in its arguments)."""
    if not isinstance(state, dict) or state.get("kind") != "resume":
        raise UserError("the resume file is not a MiniSD3 resume checkpoint")
    if state["stage"] != stage:
        raise UserError(f"the resume checkpoint is from stage '{state['stage']}', not '{stage}'")
    saved_identity, identity = state.get("trained", {"kind": "full"}), identity or {"kind": "full"}
    if saved_identity != identity:
        raise UserError(f"the resume checkpoint trained {json.dumps(saved_identity)}, this run would train "
                        f"{json.dumps(identity)}: resume from what it started with, or start a fresh run")
    saved = {**EARLIER_VALUES, **state["args"], **state.get("resolved", {})}
    now, kinds = {**vars(args), **(resolved or {})}, args.resume_kinds
    # an argument this stage no longer has changes nothing; one it has that the file lacks is compared as None
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
    if recipe and not args.force_resume:
        raise UserError("cannot resume with changed settings: " + "; ".join(recipe) +
                        " (pass --force_resume 1 to continue with the new values)")
    return recipe
