"""What every training stage shares: distributed set-up, logging, LR schedule, data order, saving and resuming,
EMA, sample grids and the training loop itself. A stage script builds its model and calls `train`."""
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import textwrap
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from dataset.buckets import BucketBatches, bucket_layout, bucket_sizes  # noqa: E402
from dataset.cache import CacheError, build_cache  # noqa: E402
from dataset.image_folder import build_dataset  # noqa: E402
from dataset.shapes import GRAMMAR_WORDS, SHAPES_VERSION  # noqa: E402
from model.components import (  # noqa: E402
    BuiltinComponents, ComponentsError, SD3Components, build_components,
)
from model.file_io import atomic_path, atomic_write_text, json_digest  # noqa: E402
from model.model_lora import attach_lora, merge_lora, read_lora_file, set_lora_scale  # noqa: E402
from model.model_sd3light import (  # noqa: E402
    PRESETS, SD3Light, SD3LightConfig, StateDictMismatchError, check_state_dict,
)
from model.rectified_flow import (  # noqa: E402
    PREDICTIONS, add_noise, euler_sample, flow_loss, predict_velocity, sample_sigmas,
)
from trainer.checkpoint import (  # noqa: E402
    CheckpointError, checkpoint_file, load_safetensors, load_torch, manifest_path, read_manifest, remove_leftovers,
    save_checkpoint, sha256_of, stem_of, step_file,
)

DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "out")
DEFAULT_SAVE_DIR = os.path.join(REPO_ROOT, "checkpoints")
DEFAULT_CACHE_DIR = os.path.join(REPO_ROOT, "cache")
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class UserError(Exception):
    """A problem the user can fix (bad path, mismatched resume...): printed as one line, no traceback."""


def run_main(main):
    """Run a stage's main(): user errors become one line on stderr and exit code 2."""
    try:
        main()
    except (UserError, CheckpointError, ComponentsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now; the last committed checkpoint is intact
        print("interrupted: the last saved checkpoint is intact; continue with --from_resume 1", file=sys.stderr)
        sys.exit(130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Distributed


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self):
        return self.rank == 0


def init_distributed():
    """torchrun sets RANK/WORLD_SIZE: NCCL on CUDA, gloo on CPU. Plain `python` runs as one process."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return DistInfo(device=torch.device("cuda" if cuda else "cpu"))
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return DistInfo(rank, local_rank, world, torch.device(f"cuda:{local_rank}" if cuda else "cpu"))


def mean_and_any(value, flag, info):
    """(mean of a float over ranks, whether `flag` is set on any rank), in one all-reduce."""
    if info.world_size == 1:
        return value, bool(flag)
    t = torch.tensor([value, float(flag)], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t[0].item() / info.world_size, t[1].item() > 0


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


class Logger:
    """Prints on rank 0 only (through tqdm when a bar is showing, so lines do not break it)."""

    def __init__(self, info):
        self.info, self.bar = info, None

    def __call__(self, msg):
        if not self.info.is_main:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Schedule and data order


def lr_at(step, total_steps, base_lr, warmup_steps, min_lr_ratio=0.1):
    """Linear warmup, then cosine decay to min_lr_ratio * base_lr. `step` counts from 0."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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


def make_sampler(bucket_of, num_samples, batch_size, info, seed):
    """Buckets when the samples come in more than one image size, else one permutation an epoch."""
    if len(set(bucket_of)) > 1:
        return BucketSampler(bucket_of, info.rank, info.world_size, batch_size, seed)
    return EpochSampler(num_samples, info.rank, info.world_size, seed=seed)


# ----------------------------------------------------------------------------------------------------------------
# Weights and resume checkpoints (trainer/checkpoint.py: verified files, committed by a manifest)


def run_name(stage, preset):
    """What a run's files are called: pretrain_tiny.json, pretrain_tiny_metrics.jsonl, pretrain_tiny_resume.json."""
    return f"{stage}_{preset}"


def weights_stem(out_dir, name):
    return os.path.join(out_dir, name)


def resume_stem(save_dir, name):
    return os.path.join(save_dir, f"{name}_resume")


def save_weights(stem, step, model, state, components_state, record, dtype):
    """Export for sampling and fine-tuning: transformer weights `state` (the model's keys, diffusers names) in
    `dtype`, the trained parts of the components, and `record`, which rebuilds both. `state` must fit `model`
    exactly (every parameter and buffer, right shapes): an empty or partial state dict never reaches the disk."""
    check_state_dict(model, state)
    tensors = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().cpu()
               for k, v in state.items()}
    parts = {".safetensors": tensors}
    if components_state:
        parts[".components.safetensors"] = {k: v.detach().contiguous().cpu() for k, v in components_state.items()}
    return save_checkpoint(stem, step, {**record, "kind": "weights"}, parts)


def resolve_weights(name_or_path, out_dir):
    """A stage name ('pretrain_tiny'), or the path of the manifest, one of its files or the stem -> the stem."""
    stem = stem_of(name_or_path)
    if not os.path.dirname(stem) and not os.path.exists(manifest_path(stem)):
        stem = os.path.join(out_dir, stem)
    if not os.path.exists(manifest_path(stem)):
        raise UserError(f"no weights at {manifest_path(stem)}: train a stage first or pass the right path")
    return stem


def load_weights(name_or_path, out_dir=DEFAULT_OUT_DIR, device="cpu", base=None):
    """-> (SD3Light in fp32, components, record). Our weights: files checked against their manifest; strict: every
    key fits. Or a diffusers folder (a pipeline, or just its transformer/). `base`: the SD3 folder to take the
    VAE and text encoders from, instead of the one the weights record names."""
    if os.path.isdir(name_or_path) and diffusers_transformer_dir(name_or_path):
        return load_diffusers_weights(name_or_path, device, base)
    stem = resolve_weights(name_or_path, out_dir)
    record = read_manifest(stem, "weights")
    record.setdefault("prediction", "v")  # weights written before x-prediction existed predict v
    model = SD3Light(SD3LightConfig.from_dict(record["transformer"]))
    components = components_for(record["components"], base, device, manifest_path(stem))
    try:
        model.load_state_dict({k: v.float() for k, v in
                               load_safetensors(checkpoint_file(stem, record, ".safetensors")).items()})
        components_file = checkpoint_file(stem, record, ".components.safetensors")
        if os.path.basename(components_file) in record["files"]:
            components.load_trained_state_dict(load_safetensors(components_file))
    except (StateDictMismatchError, RuntimeError) as e:
        raise UserError(f"{manifest_path(stem)}: {str(e).splitlines()[0][:400]}") from None
    record["manifest"] = manifest_path(stem)  # where it was read from (not part of the file)
    return model.to(device).eval(), components.to(device), record


def components_for(spec, base, device, where):
    """The components a weights record names; `base` replaces the SD3 folder it names (moved, or another copy)."""
    if base:
        if spec["kind"] != "sd3":
            raise UserError(f"--base {base}: {where} was trained on the built-in components, not SD3 ones")
        spec = {**spec, "path": os.path.abspath(base)}
    try:
        return build_components(spec, device)
    except ComponentsError as e:
        raise UserError(f"{e} (the components of {where})") from None


# ----------------------------------------------------------------------------------------------------------------
# diffusers folders: reading a published SD3 transformer, writing ours


DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def diffusers_transformer_dir(folder):
    """The transformer folder of a diffusers pipeline folder (or the folder itself), or None."""
    for candidate in (os.path.join(folder, "transformer"), folder):
        if os.path.isfile(os.path.join(candidate, "config.json")) and (
                os.path.isfile(os.path.join(candidate, DIFFUSERS_WEIGHTS)) or
                os.path.isfile(os.path.join(candidate, DIFFUSERS_WEIGHTS + ".index.json"))):
            return candidate
    return None


def diffusers_weight_files(transformer_dir):
    """The safetensors files of a transformer folder: one file, or the shards its index names."""
    index = os.path.join(transformer_dir, DIFFUSERS_WEIGHTS + ".index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(transformer_dir, name) for name in names]
    return [os.path.join(transformer_dir, DIFFUSERS_WEIGHTS)]


def preset_of(config):
    """The name of the preset a config is, or None."""
    return next((name for name, values in PRESETS.items()
                 if SD3LightConfig(**values).to_dict() == config.to_dict()), None)


def load_diffusers_weights(folder, device="cpu", base=None):
    """A diffusers SD3 transformer (its folder, or a pipeline folder holding it) -> (SD3Light in fp32, components,
    record). The components come from `base`, else from the pipeline folder itself. Published SD3 transformers
    predict the velocity."""
    transformer_dir = diffusers_transformer_dir(folder)
    if transformer_dir is None:
        raise UserError(f"{folder} holds no diffusers transformer (transformer/config.json and "
                        f"{DIFFUSERS_WEIGHTS} or its shards)")
    try:
        config = SD3LightConfig.load_json(transformer_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"{transformer_dir}/config.json: {e}") from None
    preset = preset_of(config)
    if preset is None:
        raise UserError(f"the transformer in {transformer_dir} matches no preset (layers {config.num_layers}, width "
                        f"{config.inner_dim}): add its config to PRESETS in model/model_sd3light.py")
    # the components first: a wrong --base is a one-line error before gigabytes of weights are read
    pipeline = os.path.dirname(os.path.abspath(transformer_dir))  # a transformer folder's parent may be a pipeline
    components_path = base or (pipeline if os.path.isdir(os.path.join(pipeline, "vae")) else None)
    if components_path is None:
        raise UserError(f"{folder} holds a transformer only: pass --base, the SD3 folder with its VAE and text "
                        "encoders")
    components = components_for({"kind": "sd3", "path": os.path.abspath(components_path), "t5_max_length": 77},
                                None, device, folder)
    model = SD3Light(config)
    files = diffusers_weight_files(transformer_dir)
    try:
        state = {}
        for path in files:
            state.update(load_safetensors(path))
        model.load_state_dict({k: v.float() for k, v in state.items()})
    except (OSError, StateDictMismatchError, RuntimeError) as e:
        raise UserError(f"{transformer_dir}: {str(e).splitlines()[0][:400]}") from None
    shift = 3.0
    scheduler = os.path.join(pipeline, "scheduler", "scheduler_config.json")
    if os.path.isfile(scheduler):
        with open(scheduler, encoding="utf-8") as f:
            shift = json.load(f).get("shift", shift)
    record = {"kind": "weights", "stage": "diffusers", "preset": preset, "prediction": "v", "step": 0,
              "resolution": config.sample_size * components.downscale, "transformer": config.to_dict(),
              "components": components.spec, "sampling": {"steps": 28, "cfg": 7.0, "shift": shift},
              "manifest": os.path.abspath(transformer_dir), "weight_files": files}
    return model.to(device).eval(), components.to(device), record


def export_diffusers(folder, model, weights_file, pipeline_from=None, shift=3.0):
    """Give the verified weights file of a save (the model's keys are diffusers' names) a diffusers transformer
    folder, folder/transformer/ (config.json + the file, hard-linked: no second copy is written); with
    `pipeline_from` (an SD3 folder) also the rest of a pipeline folder that StableDiffusion3Pipeline loads: its
    frozen parts linked (copied where links are not possible) and its scheduler with our sampling shift.
    -> bytes written."""
    transformer = os.path.join(folder, "transformer")
    written = 0
    with atomic_path(os.path.join(transformer, DIFFUSERS_WEIGHTS)) as tmp:
        os.remove(tmp)
        try:
            os.link(weights_file, tmp)
        except OSError:  # no hard links here (another filesystem, some network mounts): a checked copy
            shutil.copyfile(weights_file, tmp)
            if sha256_of(tmp) != sha256_of(weights_file):
                raise RuntimeError(f"{tmp}: a copy of {weights_file} reads back different") from None
            written = os.path.getsize(tmp)
    model.config.save_json(os.path.join(transformer, "config.json"))
    if pipeline_from:
        link_pipeline_parts(folder, pipeline_from, shift)
    return written


def link_pipeline_parts(folder, base, shift):
    with open(os.path.join(base, "model_index.json"), encoding="utf-8") as f:
        index = json.load(f)
    index["transformer"] = ["diffusers", "SD3Transformer2DModel"]
    for part, entry in index.items():
        if part.startswith("_") or part in ("transformer", "scheduler") or not isinstance(entry, list) \
                or entry[0] is None:
            continue
        link, target = os.path.join(folder, part), os.path.abspath(os.path.join(base, part))
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        tmp = os.path.join(folder, f".tmp-{part}")
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        try:
            os.symlink(target, tmp, target_is_directory=True)
        except OSError:  # no symlinks here (some filesystems): copy
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(target, tmp)
        if os.path.isdir(link) and not os.path.islink(link):
            shutil.rmtree(link)
        os.replace(tmp, link)
    with open(os.path.join(base, "scheduler", "scheduler_config.json"), encoding="utf-8") as f:
        scheduler = json.load(f)
    atomic_write_text(os.path.join(folder, "scheduler", "scheduler_config.json"),
                      json.dumps({**scheduler, "shift": shift}, indent=2) + "\n")
    atomic_write_text(os.path.join(folder, "model_index.json"), json.dumps(index, indent=2) + "\n")


class FullModel:
    """What pretraining and full SFT train: every weight of the transformer. The resume file and the EMA hold
    its whole state dict, and the export is a weights checkpoint at `stem` (save_weights). The LoRA stage has
    its own class with the same methods (trainer/train_lora.py)."""

    def __init__(self, stem, export_pipeline=False):
        self.stem = stem  # also where a killed save's leftovers are looked for
        self.export_pipeline = export_pipeline

    def identity(self):
        """What a resume file must have been trained as, besides the run's arguments."""
        return {"kind": "full"}

    def state(self, model):
        return model.state_dict()

    def load_state(self, model, state):
        model.load_state_dict(state)  # strict: names the keys that do not fit

    def with_state(self, model, state):
        """A copy of `model` holding `state` (the EMA), for sample grids."""
        copy = SD3Light(model.config).to(next(model.parameters()).device)
        copy.load_state_dict(state)
        return copy

    def export(self, step, model, state, components, record, dtype):
        """Our weights, then (v-prediction only: diffusers reads the output as a velocity) the same as a diffusers
        transformer folder, out/<name>/transformer/, and with --export_pipeline a whole pipeline folder around it.
        -> bytes written."""
        written = save_weights(self.stem, step, model, state, components.trained_state_dict(), record, dtype)
        if record["prediction"] == "v":
            written += export_diffusers(self.stem, model, step_file(self.stem, step, ".safetensors"),
                                        components.spec["path"] if self.export_pipeline else None,
                                        record["sampling"]["shift"])
        return written

    def describe(self):
        return manifest_path(self.stem)


# Stages whose weights another stage can start from: `--from_weight pretrain` means out/pretrain_<preset>.
WEIGHT_STAGES = ("pretrain", "sft")


def load_start_weights(args):
    """The weights a fine-tune starts from: `--from_weight` is a stage name or a path. Their preset must be
    --preset, and the prediction (x or v) is theirs: args.prediction is set from them.
    -> (model in fp32, components, record with "manifest": the manifest's path)."""
    if args.from_weight == "base":
        if not args.base:
            raise UserError("--from_weight base needs --base, the diffusers SD3 folder whose transformer to start from")
        model, components, record = load_diffusers_weights(args.base, base=args.base)
    else:
        source = run_name(args.from_weight, args.preset) if args.from_weight in WEIGHT_STAGES else args.from_weight
        model, components, record = load_weights(source, args.out_dir, base=args.base)
    where = record["manifest"]
    if record["preset"] != args.preset:
        raise UserError(f"--from_weight {where} holds '{record['preset']}' weights, not --preset {args.preset}: "
                        f"pass --preset {record['preset']} or weights of preset {args.preset}")
    if args.prediction not in (None, record["prediction"]):
        raise UserError(f"--from_weight {where} predicts {record['prediction']}, not --prediction {args.prediction}: "
                        "a fine-tune keeps its weights' prediction (leave --prediction unset)")
    args.prediction = record["prediction"]
    return model, components, record


def weights_identity(record, out_dir):
    """Which weights a run started from, to check later: the manifest (relative to out_dir when inside it), the
    step and the transformer file's sha256."""
    manifest = os.path.abspath(record["manifest"])
    if os.path.dirname(manifest) == os.path.abspath(out_dir):
        manifest = os.path.basename(manifest)
    if "weight_files" in record:  # a diffusers folder: hashed only when asked (16 GB for SD3.5-large)
        return {"weights": manifest, "step": record["step"],
                "sha256": json_digest([sha256_of(path) for path in record["weight_files"]])}
    transformer_file = os.path.basename(checkpoint_file(stem_of(record["manifest"]), record, ".safetensors"))
    return {"weights": manifest, "step": record["step"], "sha256": record["files"][transformer_file]["sha256"]}


def lora_run_name(name, preset):
    """A LoRA run's name: its metrics, samples and resume files are called lora_<name>_<preset>*."""
    return run_name(f"lora_{name}", preset)


def lora_file(out_dir, name, preset):
    """Where the LoRA stage writes adapter `name`: out/lora/lora_<name>_<preset>.safetensors."""
    return os.path.join(out_dir, "lora", lora_run_name(name, preset) + ".safetensors")


def resolve_lora(name_or_path, out_dir):
    """A LoRA file's path, or a name trained into out_dir/lora (whatever its preset) -> the file's path."""
    if os.path.isfile(name_or_path):
        return name_or_path
    found = [path for preset in PRESETS if os.path.isfile(path := lora_file(out_dir, name_or_path, preset))]
    if len(found) != 1:
        what = "no LoRA file" if not found else f"{len(found)} LoRA files ({', '.join(found)})"
        raise UserError(f"{what} for --lora {name_or_path} in {os.path.join(out_dir, 'lora')}: pass the file's path")
    return found[0]


def load_for_sampling(weights, out_dir, device, lora=None, lora_scale=1.0, merge=False, base=None):
    """Weights to sample from, with a LoRA applied if given: unmerged (an extra low-rank term in each adapted
    layer) or merged into the weights. `weights` defaults to the LoRA's base, else pretrain_tiny.
    -> (model, components, record of the weights, record of the LoRA or None)."""
    lora_record, path = None, None
    if lora:
        path = resolve_lora(lora, out_dir)
        try:
            lora_state, lora_config, lora_record = read_lora_file(path)
            lora_record = lora_record or {}
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{path} is not a readable LoRA file: {e}") from None
    if weights is None:
        weights = lora_record["base"]["weights"] if lora_record and "base" in lora_record else "pretrain_tiny"
    model, components, record = load_weights(weights, out_dir, device, base)
    if path:
        base = lora_record.get("base")
        if base and base["sha256"] != weights_identity(record, out_dir)["sha256"]:
            print(f"warning: {path} was trained on other weights ({base['weights']} step {base['step']}) than "
                  f"{record['manifest']} (step {record['step']})", file=sys.stderr)
        try:
            attach_lora(model, lora_state, lora_config)
        except ValueError as e:
            raise UserError(f"{path} does not fit {record['manifest']}: {e}") from None
        set_lora_scale(model, lora_scale)
        if merge:
            merge_lora(model)
    return model, components, record, lora_record


def sampling_name(record, lora_record=None):
    """What eval output is called: the weights' run name, or the LoRA's when one is applied."""
    if lora_record and "args" in lora_record:
        return lora_run_name(lora_record["args"]["lora_name"], record["preset"])
    return run_name(record["stage"], record["preset"])


def read_prompt_file(path):
    """One prompt per non-empty line."""
    if not os.path.isfile(path):
        raise UserError(f"prompt file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def sample_prompts_for(dataset, prompt_file=None, count=8):
    """The sample grids' prompts: a file's lines if given; else the built-in data's own; else `count` captions
    spread over the user's dataset, and the unconditional prompt."""
    if prompt_file:
        return read_prompt_file(prompt_file)
    if hasattr(dataset, "sample_prompts"):
        return dataset.sample_prompts()
    picks = [dataset.items[k * len(dataset) // count][1] for k in range(min(count, len(dataset)))]
    return [c for c in dict.fromkeys(picks) if c] + [""]


def to_cpu(obj):
    """A nested state with every tensor on the CPU (what a resume file holds)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def find_resume(from_resume, default_stem, info):
    """-> (stem, state) of the resume checkpoint to continue, or (stem, None) to start fresh. `from_resume` is
    "0", "1" (the default checkpoint, if there is one) or a path. Every process reads the file itself, so the
    save folder must be one that every node sees; if any process fails, all stop with a one-line error."""
    if from_resume in ("0", ""):
        return default_stem, None
    stem = default_stem if from_resume == "1" else stem_of(from_resume)
    error, state = None, None
    try:
        if from_resume != "1" or os.path.exists(manifest_path(stem)):
            state = load_torch(checkpoint_file(stem, read_manifest(stem, "resume"), ".pt"))
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


def rng_state(generator, device):
    """This process's random streams: the training generator (sigmas, noise, caption dropout) and torch's own."""
    return {"train": generator.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, generator, device):
    generator.set_state(state["train"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class EMA:
    """Exponential moving average of the trained tensors (a state dict), in fp32. The decay warms up as
    (1 + step) / (10 + step), so a short run is not dominated by its random initial weights."""

    def __init__(self, state, decay):
        self.decay = decay
        self.shadow = {k: v.detach().float().clone() for k, v in state.items()}

    @torch.no_grad()
    def update(self, state, step):
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in state.items():
            if v.is_floating_point():
                self.shadow[k].lerp_(v.float(), 1 - decay)
            else:
                self.shadow[k].copy_(v)


# ----------------------------------------------------------------------------------------------------------------
# Sample grids


def sample_images(model, components, prompts, seed, steps, cfg, shift, resolution, device, prediction):
    """Generate one image per prompt with fixed noise (seeded per prompt index) -> images in [-1, 1] on CPU.
    `prediction` is what the model outputs, "x" or "v" (its weights record says which)."""
    was_training = model.training
    model.eval()
    tokens, pooled = components.encode_prompts(prompts)
    shape = (components.latent_channels, resolution // components.downscale, resolution // components.downscale)
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(seed + i))
                         for i in range(len(prompts))]).to(device)
    latents = euler_sample(model, noise, tokens.to(device), pooled.to(device), steps=steps, cfg=cfg, shift=shift,
                           prediction=prediction)
    model.train(was_training)
    return components.decode_latents(latents).float().cpu()


def save_grid(path, images, captions, columns=None):
    """Write a captioned grid PNG atomically."""
    with atomic_path(path) as tmp:
        captioned_grid(images, captions, columns=columns).save(tmp, format="PNG")


def to_uint8(images):
    """[N, 3, H, W] in [-1, 1] -> uint8 array [N, H, W, 3], as PNGs store them."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()


def sampling_settings(record, steps=None, cfg=None, shift=None):
    """Sampler settings: the ones given, else what the run sampled its grids with (its weights record)."""
    saved = record["sampling"]
    return {"steps": steps or saved["steps"], "cfg": saved["cfg"] if cfg is None else cfg,
            "shift": saved["shift"] if shift is None else shift}


def captioned_grid(images, captions, tile=128, columns=None):
    """A PNG-ready PIL grid: each image upscaled to `tile` px with its caption underneath."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(images)
    columns = columns or min(n, 8)
    rows = math.ceil(n / columns)
    text_h = 34
    grid = Image.new("RGB", (columns * tile, rows * (tile + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i, (arr, caption) in enumerate(zip(to_uint8(images), captions)):
        pil = Image.fromarray(arr).resize((tile, tile), Image.NEAREST)
        x, y = (i % columns) * tile, (i // columns) * (tile + text_h)
        grid.paste(pil, (x, y))
        for j, line in enumerate(textwrap.wrap(caption or "(unconditional)", width=tile // 6)[:3]):
            draw.text((x + 2, y + tile + 1 + 11 * j), line, fill="black", font=font)
    return grid


# ----------------------------------------------------------------------------------------------------------------
# Arguments every stage takes (a stage passes its own defaults)


def add_training_args(parser, **defaults):
    a = parser.add_argument
    a("--preset", default="tiny", help="model size, see `python -m model.model_sd3light`")
    a("--base", default=None, help="a local diffusers SD3 / SD3.5 folder: its VAE and text encoders (T5 optional) "
      "replace the built-in components; `--from_weight base` starts from its transformer")
    a("--t5_max_length", type=int, default=77, help="T5 tokens of the text (SD3 components); diffusers' pipeline "
      "default is 256: pass max_sequence_length to match")
    a("--data", default="builtin", help="'builtin' shapes, a folder of images + .txt captions, or a .jsonl manifest")
    a("--resolution", type=int, default=32, help="training image size: the side of the square, or the area of the "
      "aspect-ratio buckets")
    a("--buckets", default="auto", help="aspect-ratio buckets for your images: an odd count, 0 = centre-cropped "
      "squares, auto = 5 on SD3 components (--base), else 0")
    a("--cache", default="auto", choices=["auto", "0", "1"], help="encode latents and text once into --cache_dir "
      "and train from that; auto = on with --base (the SD3 encoders are most of a step)")
    a("--cache_dir", default=DEFAULT_CACHE_DIR)
    a("--cache_only", action="store_true", help="build the cache, then stop")
    a("--export_pipeline", action="store_true", help="also write out/<run>/ as a full diffusers pipeline folder "
      "(needs --base and v-prediction); out/<run>/transformer/ is always written for v-prediction")
    a("--num_samples", type=int, default=20000, help="size of the built-in dataset")
    a("--batch_size", type=int, default=16, help="per process")
    a("--accumulation_steps", type=int, default=1)
    a("--learning_rate", type=float, default=1e-3)
    a("--warmup_steps", type=int, default=100)
    a("--min_lr_ratio", type=float, default=0.1, help="cosine decays to this fraction of the learning rate")
    a("--weight_decay", type=float, default=0.0)
    a("--grad_clip", type=float, default=1.0)
    a("--epochs", type=int, default=4)
    a("--max_steps", type=int, default=0, help="optimizer steps; 0 = run --epochs")
    a("--ema_decay", type=float, default=0.995, help="EMA of the weights, exported and sampled; 0 = none")
    a("--sigma_scheme", default="logit_normal", choices=["logit_normal", "uniform", "mode"])
    a("--logit_mean", type=float, default=0.0)
    a("--logit_std", type=float, default=1.0)
    a("--train_shift", type=float, default=1.0, help="shift applied to training sigmas")
    a("--prediction", default="x", choices=PREDICTIONS, help="what the transformer outputs: x = the clean latent "
      "(cleaner images, steadier shapes in pixel space), v = the velocity (SD3's own, and published SD3 weights')")
    a("--loss", default="mse", choices=["mse", "huber"])
    a("--weighting", default="none", choices=["none", "sigma_sqrt", "cosmap"])
    a("--caption_dropout", type=float, default=0.1, help="probability of training a sample unconditionally")
    a("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="autocast; auto = bf16 on GPU, fp32 on CPU")
    a("--gradient_checkpointing", type=int, default=0)
    a("--save_interval", type=int, default=200, help="steps between saves of weights and resume checkpoint")
    a("--save_dtype", default="bf16", choices=list(SAVE_DTYPES))
    a("--sample_interval", type=int, default=400, help="steps between sample grids; 0 = only at the end")
    a("--sample_steps", type=int, default=20)
    a("--sample_cfg", type=float, default=2.0, help="classifier-free guidance scale of the sample grids")
    a("--sample_shift", type=float, default=3.0)
    a("--sample_prompts", default=None, help="file of prompts for the sample grids, one a line; default: fixed "
      "prompts for the built-in data, else 8 captions of the dataset")
    a("--out_dir", default=DEFAULT_OUT_DIR)
    a("--save_dir", default=DEFAULT_SAVE_DIR)
    a("--from_resume", default="0", help="1 = continue from the resume checkpoint in --save_dir if there is one; "
      "or the path of a resume checkpoint (its .json)")
    a("--force_resume", type=int, default=0, help="1 = resume even though recipe settings (learning rate, batch "
      "size, schedule...) changed; preset, resolution, data and prediction can never change")
    a("--log_sample_ids", type=int, default=0, help="1 = record in the metrics file which dataset indices each step "
      "trained on (to audit the data order across resumes)")
    a("--seed", type=int, default=0)
    a("--num_workers", type=int, default=0, help="data loader processes (0 on a small CPU)")
    a("--use_wandb", action="store_true", help="log to wandb (offline without WANDB_API_KEY)")
    a("--wandb_project", default="MiniSD3")
    parser.set_defaults(**defaults)
    return parser


# What a run is: resuming with another value would continue something else, so it is always refused.
RESUME_IDENTITY = ("preset", "resolution", "data", "prediction")
# Settings that do not change what is trained (paths, saving, sampling, hardware use). Every other argument is
# part of the recipe: a change is refused unless --force_resume 1, so a typo cannot silently alter a run.
RESUME_FREE = {"out_dir", "save_dir", "from_resume", "force_resume", "save_interval", "save_dtype",
               "sample_interval", "sample_steps", "sample_cfg", "sample_shift", "sample_prompts", "num_workers",
               "dtype", "gradient_checkpointing", "use_wandb", "wandb_project", "log_sample_ids", "cache", "cache_dir",
               "cache_only", "export_pipeline"}


def check_resume(state, args, stage, dataset_size, identity=None):
    """Raise a one-line UserError if `state` cannot continue this run; -> the recipe changes accepted by
    --force_resume (empty when nothing changed). `identity`: what is trained (FullModel.identity())."""
    if not isinstance(state, dict) or state.get("kind") != "resume":
        raise UserError("the resume file is not a MiniSD3 resume checkpoint")
    if state["stage"] != stage:
        raise UserError(f"the resume checkpoint is from stage '{state['stage']}', not '{stage}'")
    saved_identity, identity = state.get("trained", {"kind": "full"}), identity or {"kind": "full"}
    if saved_identity != identity:
        raise UserError(f"the resume checkpoint trained {json.dumps(saved_identity)}, this run would train "
                        f"{json.dumps(identity)}: resume from what it started with, or start a fresh run")
    saved, now = state["args"], vars(args)

    def change(k):
        return f"--{k} {saved.get(k)} (saved) vs {now.get(k)} (now)"

    identity = [change(k) for k in RESUME_IDENTITY if saved.get(k) != now.get(k)]
    if identity:
        raise UserError("cannot resume, the run was started with other settings: " + "; ".join(identity) +
                        " (start a fresh run to change them)")
    recipe = [change(k) for k in sorted(set(saved) | set(now))
              if k not in RESUME_FREE and k not in RESUME_IDENTITY and saved.get(k) != now.get(k)]
    if state["dataset_size"] != dataset_size:
        recipe.append(f"dataset size {state['dataset_size']} (saved) vs {dataset_size} (now)")
    if recipe and not args.force_resume:
        raise UserError("cannot resume with changed settings: " + "; ".join(recipe) +
                        " (pass --force_resume 1 to continue with the new values)")
    return recipe


# ----------------------------------------------------------------------------------------------------------------
# Data: image sizes, buckets, and the cache of latents and text embeddings


def make_components(args, info):
    """The frozen components of a fresh model: --base's SD3 VAE and text encoders, else the built-in ones."""
    if not args.base:
        return BuiltinComponents(GRAMMAR_WORDS)
    return SD3Components(args.base, t5_max_length=args.t5_max_length, device=info.device)


def training_dataset(args, components, patch_size, log, data=None, num_samples=None):
    """--data (or `data`), in aspect-ratio buckets for user images when --buckets asks for them (auto: 5 buckets
    on SD3 components, centre-cropped squares with the built-in ones)."""
    data = data or args.data
    builtin = data == "builtin" or data.startswith("builtin:")
    count = int(args.buckets) if args.buckets != "auto" else (5 if components.spec["kind"] == "sd3" else 0)
    sizes = None
    if count and not builtin:
        sizes = bucket_sizes(args.resolution, components.downscale * patch_size, count=count)
    return build_dataset(data, args.resolution, num_samples=num_samples or args.num_samples, seed=args.seed, log=log,
                         buckets=sizes)


def check_image_sizes(args, model, components, sizes):
    """Every image size must be a whole number of patches in latent space and fit the model's position table:
    one line now, not a traceback at the first step."""
    multiple = components.downscale * model.config.patch_size
    for width, height in sizes:
        what = f"--resolution {args.resolution}" + ("" if width == height == args.resolution else
                                                    f" (bucket {width}x{height})")
        if width % multiple or height % multiple:
            raise UserError(f"{what}: image sides must be multiples of {multiple} (autoencoder downscale "
                            f"{components.downscale} x patch size {model.config.patch_size})")
        try:
            model.pos_embed.cropped_table(height // multiple, width // multiple)
        except ValueError as e:
            raise UserError(f"{what}: {e}") from None


def data_fingerprint(dataset, resolution):
    """Everything about the data that changes the cached features: the files (path, size, mtime), the captions,
    the image sizes. Several datasets (LoRA's prior data) are listed part by part."""
    if isinstance(dataset, torch.utils.data.ConcatDataset):
        parts = [data_fingerprint(d, resolution) for d in dataset.datasets]
        return {f"{k}" if i == 0 else f"part{i}_{k}": v for i, part in enumerate(parts) for k, v in part.items()}
    sizes = [list(size) for size in bucket_layout(dataset, resolution)[1]]
    if hasattr(dataset, "items"):  # user images
        files = []
        for path, _ in dataset.items:
            stat = os.stat(path)
            files.append([os.path.abspath(path), stat.st_size, stat.st_mtime_ns])
        return {"data": os.path.abspath(dataset.path), "count": len(dataset.items), "files": json_digest(files),
                "captions": json_digest([caption for _, caption in dataset.items]), "sizes": sizes}
    return {"data": f"builtin:{dataset.split}:{','.join(dataset.colors)}", "count": len(dataset),
            "generator": json_digest([dataset.seed, dataset.resolution, SHAPES_VERSION]), "sizes": sizes}


def cache_folder(cache_dir, dataset, fingerprint, components):
    """One cache folder per dataset (its parts' sources) and component set: stages on the same data share it, and
    a resolution, caption or file change rebuilds it in place."""
    source = dataset.datasets[0] if isinstance(dataset, torch.utils.data.ConcatDataset) else dataset
    name = os.path.basename(os.path.normpath(source.path)) if hasattr(source, "path") else "builtin"
    sources = [fingerprint[k] for k in sorted(fingerprint) if k == "data" or k.endswith("_data")]
    key = json_digest([sources, components.spec.get("kind"), components.spec.get("path")])[:16]
    return os.path.join(cache_dir, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key}")


def cached_dataset(args, dataset, components, info, log):
    """Encode every sample once (split across ranks, resumable) and return the cache, read memory-mapped; its
    items are feature dicts (components.encode), in the order of `dataset`'s samples."""
    fingerprint = {**data_fingerprint(dataset, args.resolution), "resolution": args.resolution,
                   "components": json_digest(components.identity())}

    def encode(indices):
        items = [dataset[i] for i in indices]
        features = [None] * len(items)
        by_size = {}
        for k, item in enumerate(items):  # one encoder batch per image size (bucket)
            by_size.setdefault(tuple(item["image"].shape), []).append(k)
        for group in by_size.values():
            images = torch.stack([items[k]["image"] for k in group]).to(info.device)
            batch = components.encode(images, [items[k]["caption"] for k in group])
            for j, k in enumerate(group):
                features[k] = {key: value[j].detach().cpu().contiguous() for key, value in batch.items()}
        return features

    folder = cache_folder(args.cache_dir, dataset, fingerprint, components)
    try:
        cache = build_cache(folder, fingerprint, len(dataset), encode, rank=info.rank, world_size=info.world_size,
                            barrier=dist.barrier if info.world_size > 1 else None, encode_batch=args.batch_size,
                            log=log)
    except CacheError as e:
        raise UserError(str(e)) from None
    warn_truncated(components, info, log)
    return cache


def warn_truncated(components, info, log):
    """One counted warning for the captions CLIP cut short, over all ranks (encoding goes on: diffusers truncates
    the same way). Every rank calls it."""
    count = getattr(components, "truncated_captions", 0)
    if info.world_size > 1:
        total = torch.tensor([float(count)], dtype=torch.float64, device=info.device)
        dist.all_reduce(total)
        count = int(total.item())
    if count:
        log(f"warning: {count} caption(s) were longer than CLIP's 77 tokens and were truncated for CLIP (T5 reads "
            "up to --t5_max_length tokens)")
        components.truncated_captions = 0


def use_cache(args, components):
    """--cache auto: on for real SD3 components (their encoders cost most of a step), off for the built-in ones
    (cheaper to run than to read back)."""
    return args.cache == "1" or (args.cache == "auto" and components.spec["kind"] != "builtin") or args.cache_only


# ----------------------------------------------------------------------------------------------------------------
# The training loop


def flow_matching_loss(model, components, batch, generator, args, device, autocast_dtype):
    """The rectified-flow loss of one micro-batch: raw images and captions, or their cached features."""
    with torch.no_grad():
        if "latents" in batch:  # from the cache
            features = {k: v.to(device) for k, v in batch.items()}
        else:
            features = components.encode(batch["image"].to(device), list(batch["caption"]))
        # Caption dropout per text encoder, independently (SD3): each is dropped with p ** (1 / encoders), so a
        # sample is fully unconditional with probability p (--caption_dropout).
        encoders = len(components.text_encoders)
        p_drop = args.caption_dropout ** (1 / encoders)
        drop = torch.rand(len(features["latents"]), encoders, generator=generator) < p_drop
        tokens, pooled = components.condition(features, drop.to(device))
        latents = components.latents(features, generator)
    noise = torch.randn(latents.shape, generator=generator).to(device)
    s = sample_sigmas(len(latents), args.sigma_scheme, args.logit_mean, args.logit_std, shift=args.train_shift,
                      generator=generator).to(device)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        pred = predict_velocity(model, add_noise(latents, noise, s), tokens, pooled, s, args.prediction)
    return flow_loss(pred, latents, noise, s, args.loss, args.weighting)


def train(args, stage, model, components, dataset, info, log, sample_prompts, trained=None, name=None,
          sample_first=False):
    """Train `model`'s trainable parameters on `dataset`. `trained` says what is trained, resumed and exported:
    by default FullModel, the whole transformer, exported to out_dir/<name>.*; the resume checkpoint goes to
    save_dir/<name>_resume.*, where `name` defaults to <stage>_<preset>. `log` is a Logger (or any callable
    taking a message); `sample_prompts` fill the sample grids; `sample_first` also samples the starting weights
    (step 0) of a fresh run, to compare with. Returns the step reached (short of the end if a stop came)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tqdm import tqdm

    name, device = name or run_name(stage, args.preset), info.device
    trained = trained or FullModel(weights_stem(args.out_dir, name), export_pipeline=args.export_pipeline)
    if args.export_pipeline and (components.spec["kind"] != "sd3" or args.prediction != "v"):
        raise UserError("--export_pipeline needs SD3 components (--base) and v-prediction: diffusers' pipeline has "
                        "neither the built-in components nor a clean-image (x) prediction")
    resume_at = resume_stem(args.save_dir, name)
    metrics_path = os.path.join(args.out_dir, f"{name}_metrics.jsonl")
    model.to(device).train()
    components.to(device)
    bucket_of, sizes = bucket_layout(dataset, args.resolution)
    check_image_sizes(args, model, components, sizes)
    model.gradient_checkpointing = bool(args.gradient_checkpointing)
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") \
        else None
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError("the model has no trainable parameters")
    # fused: one kernel for all parameters, on CPU too (a quarter of the per-step optimizer time of foreach)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    global_batch = args.batch_size * args.accumulation_steps * info.world_size
    if len(dataset) < global_batch:
        raise UserError(f"the dataset has {len(dataset)} samples, fewer than one global batch ({global_batch} = "
                        "batch_size x accumulation_steps x processes): lower --batch_size")
    if use_cache(args, components):
        dataset = cached_dataset(args, dataset, components, info, log)
        if args.cache_only:
            log(f"--cache_only: the cache of {len(dataset)} samples is ready in {dataset.folder}")
            return 0
        if device.type == "cuda" and hasattr(components, "offload_text_encoders"):
            components.offload_text_encoders(sample_prompts)  # GPU memory for the transformer instead
    generator = torch.Generator().manual_seed(args.seed * 1000 + info.rank)  # sigmas, noise, caption dropout
    # Progress: optimizer steps taken, samples seen (all ranks), the epoch and how far into its permutation.
    # The schedule counts samples, in steps of the global batch the run started with (plan_batch), so a resume
    # with another world size or batch size continues the same schedule and the same epoch.
    step = epoch = consumed = samples_seen = 0
    plan_batch, wandb_id, ema_shadow = global_batch, None, None
    if info.is_main:  # whatever a killed run left half-written
        for stem in (trained.stem, resume_at, os.path.join(args.out_dir, "samples", name)):
            remove_leftovers(stem)
    resume_from, state = find_resume(str(args.from_resume), resume_at, info)  # saves still go to resume_at
    if state is not None:
        for change in check_resume(state, args, stage, len(dataset), trained.identity()):
            log(f"warning: resuming with a changed setting (--force_resume): {change}")
        try:
            trained.load_state(model, state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, RuntimeError) as e:  # strict: names the keys that do not fit
            raise UserError(f"{manifest_path(resume_from)} does not fit this model: {' '.join(str(e).split())[:400]}") \
                from None
        step, epoch, consumed, samples_seen = state["step"], state["epoch"], state["consumed"], state["samples_seen"]
        plan_batch, wandb_id, ema_shadow = state["plan_batch"], state["wandb_id"], state["ema"]
        if state["world_size"] == info.world_size and state["global_batch"] == global_batch:
            set_rng_state(state["rng"][info.rank], generator, device)
        else:  # the data position carries over exactly; the noise stream restarts, seeded by step and rank
            generator.manual_seed(args.seed * 1000 + info.rank + 7919 * step)
            log(f"resuming with {info.world_size} process(es) and global batch {global_batch} (saved: "
                f"{state['world_size']}, {state['global_batch']}): {samples_seen} samples seen, epoch {epoch} "
                f"continues at sample {consumed} of its permutation")
        log(f"resumed {manifest_path(resume_from)} at step {step} (epoch {epoch}, {samples_seen} samples seen)")
    elif args.from_resume == "1":
        log(f"no resume checkpoint at {manifest_path(resume_at)}: starting from scratch")
    elif os.path.exists(manifest_path(resume_at)):
        log(f"warning: starting a fresh run; the resume checkpoint at {manifest_path(resume_at)} will be replaced "
            "at the first save (pass --from_resume 1 to continue it instead)")
    ema = EMA(trained.state(model), args.ema_decay) if args.ema_decay > 0 else None
    if ema is not None and ema_shadow is not None:
        ema.shadow = ema_shadow
    sampler = make_sampler(bucket_of, len(dataset), args.batch_size, info, args.seed)
    if isinstance(sampler, BucketSampler) and state is not None and state["args"]["batch_size"] != args.batch_size:
        raise UserError(f"cannot resume bucketed data with --batch_size {args.batch_size}: its epochs are planned in "
                        f"micro-batches of {state['args']['batch_size']} (change --accumulation_steps instead)")
    plan_steps = args.max_steps if args.max_steps > 0 else args.epochs * sampler.steps_left(0, plan_batch)
    total_samples = plan_steps * plan_batch
    if info.is_main:  # rows past this step belong to an earlier run, or to the lost tail of the resumed one
        truncate_metrics(metrics_path, step)

    wandb_run = None
    if args.use_wandb and info.is_main:
        import wandb

        wandb_run = wandb.init(project=args.wandb_project, name=name, id=wandb_id, resume="allow", config=vars(args),
                               dir=args.out_dir, mode="online" if os.environ.get("WANDB_API_KEY") else "offline")
        wandb_id = wandb_run.id

    if info.is_main:
        os.makedirs(args.out_dir, exist_ok=True)
    train_model = DDP(model) if info.world_size > 1 else model
    steps_left = math.ceil((total_samples - samples_seen) / global_batch)
    log(f"{stage}: {sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters, {len(dataset)} samples, "
        f"global batch {global_batch}, {step + steps_left} steps, {info.world_size} process(es) on {device.type}")

    def save():
        rng = [None] * info.world_size
        if info.world_size > 1:
            dist.all_gather_object(rng, rng_state(generator, device))
        else:
            rng = [rng_state(generator, device)]
        if not info.is_main:
            return
        t0 = time.perf_counter()
        record = {"stage": stage, "preset": args.preset, "samples_seen": samples_seen, "resolution": args.resolution,
                  "prediction": args.prediction, "ema": ema is not None, "save_dtype": args.save_dtype,
                  "transformer": model.config.to_dict(), "components": components.spec,
                  "sampling": {"steps": args.sample_steps, "cfg": args.sample_cfg, "shift": args.sample_shift},
                  "args": vars(args)}
        resume = {"kind": "resume", "stage": stage, "step": step, "epoch": epoch, "consumed": consumed,
                  "samples_seen": samples_seen, "world_size": info.world_size, "global_batch": global_batch,
                  "plan_batch": plan_batch, "dataset_size": len(dataset), "trained": trained.identity(),
                  "model": to_cpu(trained.state(model)),
                  "optimizer": to_cpu(optimizer.state_dict()), "ema": to_cpu(ema.shadow) if ema is not None else None,
                  "rng": to_cpu(rng), "wandb_id": wandb_id, "args": vars(args)}
        # the resume checkpoint first: if the weights export is cut short, training can still continue
        written = save_checkpoint(resume_at, step, {"kind": "resume", "stage": stage, "preset": args.preset,
                                                    "samples_seen": samples_seen}, {".pt": resume})
        written += trained.export(step, model, ema.shadow if ema is not None else trained.state(model), components,
                                  record, SAVE_DTYPES[args.save_dtype])
        log(f"saved step {step}: {written / 1e6:.0f} MB written and verified in {time.perf_counter() - t0:.1f} s")

    def sample_grid():
        if not info.is_main:
            return
        sampler_model = trained.with_state(model, ema.shadow) if ema is not None else model
        images = sample_images(sampler_model, components, sample_prompts, seed=args.seed, steps=args.sample_steps,
                               cfg=args.sample_cfg, shift=args.sample_shift, resolution=args.resolution,
                               device=device, prediction=args.prediction)
        path = os.path.join(args.out_dir, "samples", f"{name}_step{step:06d}.png")
        save_grid(path, images, sample_prompts)
        log(f"sample grid: {path}")

    bar = tqdm(total=step + steps_left, initial=step, desc=stage, dynamic_ncols=True) if info.is_main else None
    if isinstance(log, Logger):
        log.bar = bar  # messages go through the bar while it shows
    if sample_first and state is None:
        sample_grid()  # step 0: the starting weights
    nan_streak, t_last, stop = 0, time.perf_counter(), False
    with StopSignal() as stop_signal:
        while samples_seen < total_samples and not stop:
            if sampler.steps_left(consumed, global_batch) == 0:
                epoch, consumed = epoch + 1, 0
            # this rank's share of the rest of the epoch, in micro-batches
            batches = sampler.rank_batches(epoch, consumed, args.batch_size, global_batch)
            loader = zip(batches, torch.utils.data.DataLoader(
                dataset, batch_sampler=batches, num_workers=args.num_workers, worker_init_fn=ignore_sigint,
                generator=torch.Generator().manual_seed(args.seed)))  # its own generator: torch's stream untouched
            while samples_seen < total_samples and sampler.steps_left(consumed, global_batch) and not stop:
                lr = lr_at(samples_seen / plan_batch, plan_steps, args.learning_rate, args.warmup_steps,
                           args.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum, ids = 0.0, []
                for micro in range(args.accumulation_steps):
                    last = micro == args.accumulation_steps - 1
                    # gradients are all-reduced once per step, on the last micro-batch
                    sync = contextlib.nullcontext() if last or info.world_size == 1 else train_model.no_sync()
                    batch_ids, batch = next(loader)
                    with sync:
                        loss = flow_matching_loss(train_model, components, batch, generator, args, device,
                                                  autocast_dtype)
                        (loss / args.accumulation_steps).backward()
                    loss_sum += loss.item()
                    ids += batch_ids
                # one all-reduce: the mean loss, and whether any rank was asked to stop
                loss_mean, stop = mean_and_any(loss_sum / args.accumulation_steps,
                                               stop_signal.received is not None, info)
                if args.log_sample_ids and info.world_size > 1:
                    per_rank = [None] * info.world_size
                    dist.all_gather_object(per_rank, ids)
                    ids = [i for rank_ids in per_rank for i in rank_ids]
                step, consumed, samples_seen = step + 1, consumed + global_batch, samples_seen + global_batch
                if math.isfinite(loss_mean):
                    nan_streak = 0
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip).item()
                    optimizer.step()
                    if ema is not None:
                        ema.update(trained.state(model), step)
                    now = time.perf_counter()
                    images_per_s, t_last = global_batch / (now - t_last), now
                    if info.is_main:
                        row = {"step": step, "epoch": epoch, "loss": loss_mean, "lr": lr, "grad_norm": grad_norm,
                               "images_per_s": images_per_s, "samples_seen": samples_seen}
                        if args.log_sample_ids:
                            row["sample_ids"] = ids
                        with open(metrics_path, "a", encoding="utf-8") as f:
                            f.write(json.dumps(row) + "\n")
                        bar.set_postfix(loss=f"{loss_mean:.4f}", lr=f"{lr:.2e}", img_s=f"{images_per_s:.0f}")
                        if wandb_run is not None:
                            wandb_run.log(row, step=step)
                else:  # skip the update on every rank alike (the loss is averaged over ranks); the batch is used up
                    nan_streak += 1
                    log(f"warning: loss is {loss_mean} at step {step}; update skipped ({nan_streak} in a row)")
                    if nan_streak >= 10:
                        raise UserError(f"loss was not finite for {nan_streak} steps in a row (last good save in "
                                        f"{args.save_dir}): lower --learning_rate or check the data")
                optimizer.zero_grad(set_to_none=True)
                if bar is not None:
                    bar.update(1)
                finished = samples_seen >= total_samples
                if step % args.save_interval == 0 or finished or stop:
                    save()
                if not stop and ((args.sample_interval and step % args.sample_interval == 0) or finished):
                    sample_grid()
    if bar is not None:
        bar.close()
    if isinstance(log, Logger):
        log.bar = None
    if info.world_size > 1:
        dist.barrier()  # leave together: rank 0 may still be writing the last save or sample grid
    if wandb_run is not None:
        wandb_run.finish()
    warn_truncated(components, info, log)  # when encoding as it trained (no cache)
    if stop:
        what = signal.Signals(stop_signal.received).name if stop_signal.received else "a stop signal on another rank"
        log(f"stopped by {what} at step {step}, checkpoint saved: continue with --from_resume 1")
    else:
        log(f"done: {trained.describe()} (step {step})")
    return step


def truncate_metrics(path, step):
    """Drop metric rows past `step` (0 for a fresh run), and a last line cut short by a kill."""
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
