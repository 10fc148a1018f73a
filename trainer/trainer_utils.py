"""The mechanics every training stage composes, as small pieces: distributed set-up, stop signals, the
learning-rate schedule, EMA, random states, and finding and checking a resume. The bookkeeper that puts them
together for a run (data position, save / resume / sample-grid cadence) is trainer/training_run.py. Nothing here
computes a loss or builds an optimizer: the stage script does both.
"""
import contextlib
import json
import math
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.checkpoint import CheckpointError, checkpoint_file, load_torch, manifest_path, read_manifest, stem_of
from model.errors import UserError
from model.file_io import atomic_write_text

# ----------------------------------------------------------------------------------------------------------------
# Processes and signals


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    mesh: object = None  # the device mesh FSDP shards over (--fsdp 1), else None

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def sharded(self):
        return self.mesh is not None


def init_distributed(fsdp=0, shard_size=0):
    """torchrun sets RANK/WORLD_SIZE: NCCL on CUDA, gloo on CPU. Plain `python` runs as one process. With `fsdp`, a
    device mesh to shard over: every process holds a shard, or with `shard_size` the processes form groups of
    that size that shard within and replicate across (hybrid sharding: a group per node). Checked first: a bad
    size is one line before any work."""
    cuda = torch.cuda.is_available()
    env = "RANK" in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")) if env else (0, 0, 1)
    if shard_size and not fsdp:
        raise UserError("--fsdp_shard_size shards the weights: it needs --fsdp 1")
    if shard_size and world % shard_size:
        raise UserError(f"--fsdp_shard_size {shard_size} does not divide the {world} process(es): use a divisor of "
                        f"{world}, e.g. the GPUs of one node, or 0 to shard over all")
    device = torch.device((f"cuda:{local_rank}" if env else "cuda") if cuda else "cpu")
    if env and cuda:
        torch.cuda.set_device(local_rank)
    if env:
        dist.init_process_group("nccl" if cuda else "gloo")
    elif fsdp:  # FSDP on one process: a group of one
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = None
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        groups = world // shard_size if shard_size else 1
        mesh = init_device_mesh(device.type, (groups, world // groups), mesh_dim_names=("replicate", "shard")) \
            if groups > 1 else init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return DistInfo(rank, local_rank, world, device, mesh)


def mean_and_any(values, flag, info):
    """(the means of a list of floats over ranks, whether `flag` is set on any rank), in one all-reduce."""
    if info.world_size == 1:
        return list(values), bool(flag)
    t = torch.tensor([*values, float(flag)], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return [v / info.world_size for v in t[:-1].tolist()], t[-1].item() > 0


class StopSignal:
    """SIGTERM and SIGINT (what schedulers send before pre-emption, and Ctrl-C) only set `received`: the loop
    saves at the next step boundary and returns, so every rank exits 0. A second Ctrl-C stops at once."""

    def __init__(self):
        self.received, self.previous = None, {}

    def handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def ignore_sigint(worker_id):
    """Data loader workers leave Ctrl-C to the main process, which stops cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# ----------------------------------------------------------------------------------------------------------------
# Schedule, EMA, random states, state trees


def lr_at(step, total_steps, base_lr, warmup_steps, min_lr_ratio=0.1):
    """Linear warmup, then cosine decay to min_lr_ratio * base_lr. `step` counts from 0."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class EMA:
    """Exponential moving average of `source`'s state dict (a model, or anything with state_dict(), such as a
    model's LoRA adapters), in fp32, on `device` (None: where the weights are; "cpu": off the GPU, --ema_device).
    The decay warms up as (1 + step) / (10 + step), so a short run is not dominated by its random initial
    weights."""

    def __init__(self, source, decay, device=None):
        self.source, self.decay, self.device = source, decay, None if device in (None, "auto") else device
        self.shadow = self.copy_of_source()

    def copy_of_source(self):
        return {k: v.detach().to(self.device).float().clone() for k, v in self.source.state_dict().items()}

    @torch.no_grad()
    def update(self, step):
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in self.source.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].lerp_(v.to(self.device).float(), 1 - decay)
            else:
                self.shadow[k].copy_(v)

    def state_dict(self):
        return self.shadow

    def load_state_dict(self, shadow):
        """The average a resume file holds; None (the run had no EMA so far): start from the source's weights."""
        self.shadow = shadow if shadow is not None else self.copy_of_source()

    @contextlib.contextmanager
    def swapped_in(self, model):
        """`model` with the average in the source's place while the block runs (what the sample grids draw and
        the export holds), then the trained weights back, bit for bit. No copy of the model: a sharded one works
        too."""
        trained = {k: v.detach().clone() for k, v in self.source.state_dict().items()}
        self.source.load_state_dict(self.shadow)
        try:
            yield model
        finally:
            self.source.load_state_dict(trained)


def rng_state(generator, device):
    """This process's random streams: the training generator (sigmas, noise, caption dropout) and torch's own."""
    return {"train": generator.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, generator, device):
    generator.set_state(state["train"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def leaves(tree, path=()):
    """-> {path: tensor} of every tensor in a nested dict/list state (path: the keys on the way, as a tuple)."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {p: t for key, sub in items for p, t in leaves(sub, path + (key,)).items()}


def map_leaves(tree, fn, path=()):
    """The same nested state with each tensor replaced by fn(path, tensor)."""
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(v, fn, path + (i,)) for i, v in enumerate(tree))
    return tree


def to_cpu(obj):
    """A nested state with every tensor on the CPU (what a resume file holds)."""
    return map_leaves(obj, lambda path, tensor: tensor.detach().cpu())


# ----------------------------------------------------------------------------------------------------------------
# Finding and checking a resume


def find_resume(from_resume, default_stem, info):
    """-> (stem, state) of the resume checkpoint to continue, or (stem, None) to start fresh. `from_resume` is
    "0", "1" (the default checkpoint, if there is one) or a path. Every process reads the file itself, so the
    save folder must be one that every node sees; the processes share the hashing of its files. If any process
    fails, all stop with a one-line error."""
    if from_resume in ("0", ""):
        return default_stem, None
    stem = default_stem if from_resume == "1" else stem_of(from_resume)
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


def check_resume(state, args, stage, dataset_size, identity=None, not_shorter=False):
    """Raise a one-line UserError if `state` cannot continue this run; -> the recipe changes accepted by
    --force_resume (empty when nothing changed). How each argument is treated, args.resume_kinds says
    (trainer/arguments.py). `not_shorter`: the schedule does not end earlier than the saved one, so changed lengths
    (--max_steps, --epochs) are no recipe change. `identity`: what is trained (e.g. the LoRA's base weights),
    which must match."""
    if not isinstance(state, dict) or state.get("kind") != "resume":
        raise UserError("the resume file is not a MiniSD3 resume checkpoint")
    if state["stage"] != stage:
        raise UserError(f"the resume checkpoint is from stage '{state['stage']}', not '{stage}'")
    saved_identity, identity = state.get("trained", {"kind": "full"}), identity or {"kind": "full"}
    if saved_identity != identity:
        raise UserError(f"the resume checkpoint trained {json.dumps(saved_identity)}, this run would train "
                        f"{json.dumps(identity)}: resume from what it started with, or start a fresh run")
    saved, now, kinds = {**EARLIER_VALUES, **state["args"]}, vars(args), args.resume_kinds
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


def truncate_metrics(path, step):
    """Drop metric rows past `step` (-1 for a fresh run: all of them, its step-0 row too), and a last line cut
    short by a kill."""
    if not os.path.exists(path):
        return
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:  # a line without its newline is the half-written last row of a killed run
                if line.endswith("\n") and json.loads(line)["step"] <= step:
                    rows.append(line)
            except (ValueError, KeyError, TypeError):
                pass
    atomic_write_text(path, "".join(rows))
