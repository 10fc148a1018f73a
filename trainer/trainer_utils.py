"""What every training stage shares: distributed set-up, logging, LR schedule, data order, saving and resuming,
EMA, sample grids and the training loop itself. A stage script builds its model and calls `train`."""
import contextlib
import json
import math
import os
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

from model.components import build_components, drop_captions  # noqa: E402
from model.file_io import atomic_path, atomic_write_text  # noqa: E402
from model.model_lora import attach_lora, merge_lora, read_lora_file, set_lora_scale  # noqa: E402
from model.model_sd3light import (  # noqa: E402
    PRESETS, SD3Light, SD3LightConfig, StateDictMismatchError, check_state_dict,
)
from model.rectified_flow import (  # noqa: E402
    PREDICTIONS, add_noise, euler_sample, flow_loss, predict_velocity, sample_sigmas,
)
from trainer.checkpoint import (  # noqa: E402
    CheckpointError, checkpoint_file, load_safetensors, load_torch, manifest_path, read_manifest, remove_leftovers,
    save_checkpoint, stem_of,
)

DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "out")
DEFAULT_SAVE_DIR = os.path.join(REPO_ROOT, "checkpoints")
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class UserError(Exception):
    """A problem the user can fix (bad path, mismatched resume...): printed as one line, no traceback."""


def run_main(main):
    """Run a stage's main(): user errors become one line on stderr and exit code 2."""
    try:
        main()
    except (UserError, CheckpointError) as e:
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


class EpochSampler(torch.utils.data.Sampler):
    """Each epoch is one global permutation (seed + epoch). The position in it is counted in global samples,
    and the rest of the epoch is dealt round-robin to the ranks, so a resume (also with another world size)
    continues the same permutation: nothing of the epoch is seen twice or skipped."""

    def __init__(self, num_samples, rank, world_size, seed=0, shuffle=True):
        self.n, self.rank, self.world, self.seed, self.shuffle = num_samples, rank, world_size, seed, shuffle
        self.epoch, self.consumed = 0, 0

    def set_position(self, epoch, consumed):
        self.epoch, self.consumed = epoch, consumed

    def permutation(self, epoch):
        if not self.shuffle:
            return torch.arange(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def __iter__(self):
        rest = self.permutation(self.epoch)[self.consumed:]
        usable = len(rest) // self.world * self.world
        return iter(rest[self.rank:usable:self.world].tolist())

    def __len__(self):
        return (self.n - self.consumed) // self.world


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


def load_weights(name_or_path, out_dir=DEFAULT_OUT_DIR, device="cpu"):
    """-> (SD3Light in fp32, components, record). Files checked against their manifest; strict: every key fits."""
    stem = resolve_weights(name_or_path, out_dir)
    record = read_manifest(stem, "weights")
    record.setdefault("prediction", "v")  # weights written before x-prediction existed predict v
    model = SD3Light(SD3LightConfig.from_dict(record["transformer"]))
    components = build_components(record["components"])
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


class FullModel:
    """What pretraining and full SFT train: every weight of the transformer. The resume file and the EMA hold
    its whole state dict, and the export is a weights checkpoint at `stem` (save_weights). The LoRA stage has
    its own class with the same methods (trainer/train_lora.py)."""

    def __init__(self, stem):
        self.stem = stem  # also where a killed save's leftovers are looked for

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
        """-> bytes written."""
        return save_weights(self.stem, step, model, state, components.trained_state_dict(), record, dtype)

    def describe(self):
        return manifest_path(self.stem)


# Stages whose weights another stage can start from: `--from_weight pretrain` means out/pretrain_<preset>.
WEIGHT_STAGES = ("pretrain", "sft")


def load_start_weights(args):
    """The weights a fine-tune starts from: `--from_weight` is a stage name or a path. Their preset must be
    --preset, and the prediction (x or v) is theirs: args.prediction is set from them.
    -> (model in fp32, components, record with "manifest": the manifest's path)."""
    source = run_name(args.from_weight, args.preset) if args.from_weight in WEIGHT_STAGES else args.from_weight
    model, components, record = load_weights(source, args.out_dir)
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


def load_for_sampling(weights, out_dir, device, lora=None, lora_scale=1.0, merge=False):
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
    model, components, record = load_weights(weights, out_dir, device)
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
    with torch.no_grad():
        shape = components.encode_images(torch.zeros(1, 3, resolution, resolution, device=device)).shape[1:]
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
    a("--data", default="builtin", help="'builtin' shapes, a folder of images + .txt captions, or a .jsonl manifest")
    a("--resolution", type=int, default=32, help="training image size (square, centre-cropped)")
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
               "dtype", "gradient_checkpointing", "use_wandb", "wandb_project", "log_sample_ids"}


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
# The training loop


def flow_matching_loss(model, components, batch, generator, args, device, autocast_dtype):
    images, captions = batch["image"].to(device), list(batch["caption"])
    with torch.no_grad():
        latents = components.encode_images(images)
        tokens, pooled = components.encode_prompts(captions)
        drop = torch.rand(len(captions), generator=generator) < args.caption_dropout
        tokens, pooled = drop_captions(tokens, pooled, drop.to(device))
    noise = torch.randn(latents.shape, generator=generator).to(device)
    s = sample_sigmas(len(captions), args.sigma_scheme, args.logit_mean, args.logit_std, shift=args.train_shift,
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
    trained = trained or FullModel(weights_stem(args.out_dir, name))
    resume_at = resume_stem(args.save_dir, name)
    metrics_path = os.path.join(args.out_dir, f"{name}_metrics.jsonl")
    model.to(device).train()
    components.to(device)
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
    with torch.no_grad():  # a resolution the model's position table cannot hold: one line now, not a traceback later
        latent_h, latent_w = components.encode_images(torch.zeros(1, 3, args.resolution, args.resolution,
                                                                  device=device)).shape[-2:]
    try:
        model.pos_embed.cropped_table(latent_h // model.config.patch_size, latent_w // model.config.patch_size)
    except ValueError as e:
        raise UserError(f"--resolution {args.resolution}: {e}") from None
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
    plan_steps = args.max_steps if args.max_steps > 0 else args.epochs * (len(dataset) // plan_batch)
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
    sampler = EpochSampler(len(dataset), info.rank, info.world_size, seed=args.seed)
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
            if consumed + global_batch > len(dataset):
                epoch, consumed = epoch + 1, 0
            sampler.set_position(epoch, consumed)
            mine = list(sampler)  # this rank's share of the rest of the epoch, in micro-batches
            batches = [mine[i:i + args.batch_size] for i in range(0, len(mine) - args.batch_size + 1, args.batch_size)]
            loader = zip(batches, torch.utils.data.DataLoader(
                dataset, batch_sampler=batches, num_workers=args.num_workers, worker_init_fn=ignore_sigint,
                generator=torch.Generator().manual_seed(args.seed)))  # its own generator: torch's stream untouched
            while samples_seen < total_samples and consumed + global_batch <= len(dataset) and not stop:
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
