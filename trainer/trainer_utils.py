"""What every training stage shares: distributed set-up, logging, LR schedule, data order, saving and resuming,
EMA, sample grids and the training loop itself. A stage script builds its model and calls `train`."""
import contextlib
import json
import math
import os
import sys
import textwrap
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from model.components import build_components, drop_captions  # noqa: E402
from model.file_io import atomic_path, atomic_write_text  # noqa: E402
from model.model_sd3light import SD3Light, SD3LightConfig  # noqa: E402
from model.rectified_flow import (  # noqa: E402
    PREDICTIONS, add_noise, euler_sample, flow_loss, predict_velocity, sample_sigmas,
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
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
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


def all_mean(value, info):
    """Mean of a float over ranks."""
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.item() / info.world_size


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
# Saving and loading (every write atomic: temp file, fsync, os.replace)


def weights_paths(out_dir, name):
    stem = os.path.join(out_dir, name)
    return {"weights": stem + ".safetensors", "components": stem + ".components.safetensors",
            "config": stem + ".json"}


def save_weights(out_dir, name, model_state, components_state, record, dtype):
    """Export for sampling and fine-tuning: transformer weights (diffusers key names, `dtype`), the trained parts
    of the components, and a JSON record that rebuilds both. The JSON is written last and names the step, which
    the weights files carry too, so a crash mid-save can never pass a mixed set as whole."""
    if not model_state:
        raise RuntimeError("refusing to save an empty state dict")
    paths = weights_paths(out_dir, name)
    meta = {"step": str(record["step"])}
    tensors = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().cpu()
               for k, v in model_state.items()}
    with atomic_path(paths["weights"]) as tmp:
        save_file(tensors, tmp, metadata=meta)
    if components_state:
        with atomic_path(paths["components"]) as tmp:
            save_file({k: v.contiguous().cpu() for k, v in components_state.items()}, tmp, metadata=meta)
    atomic_write_text(paths["config"], json.dumps(record, indent=2) + "\n")
    return paths


def resolve_weights(name_or_path, out_dir):
    """A stage name ('pretrain_tiny'), a .json/.safetensors path, or a stem -> the weights paths."""
    stem = name_or_path
    for suffix in (".components.safetensors", ".safetensors", ".json"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    if not os.path.dirname(stem) and not os.path.exists(stem + ".json"):
        stem = os.path.join(out_dir, stem)
    paths = weights_paths(os.path.dirname(stem) or ".", os.path.basename(stem))
    if not os.path.exists(paths["config"]) or not os.path.exists(paths["weights"]):
        raise UserError(f"no weights at {stem}(.json/.safetensors): train a stage first or pass the right path")
    return paths


def load_weights(name_or_path, out_dir=DEFAULT_OUT_DIR, device="cpu"):
    """-> (SD3Light in fp32, components, record). Strict: every key must fit."""
    paths = resolve_weights(name_or_path, out_dir)
    with open(paths["config"], encoding="utf-8") as f:
        record = json.load(f)
    record.setdefault("prediction", "v")  # weights written before x-prediction existed predict v
    model = SD3Light(SD3LightConfig.from_dict(record["transformer"]))
    state = read_safetensors(paths["weights"], expect_step=record["step"])
    model.load_state_dict({k: v.float() for k, v in state.items()})
    components = build_components(record["components"])
    if os.path.exists(paths["components"]):
        components.load_trained_state_dict(read_safetensors(paths["components"], expect_step=record["step"]))
    return model.to(device).eval(), components.to(device), record


def read_safetensors(path, expect_step=None):
    with safe_open(path, framework="pt") as f:
        step = (f.metadata() or {}).get("step")
        if expect_step is not None and step != str(expect_step):
            raise UserError(f"{path} is from step {step} but its config names step {expect_step}: a save was "
                            "interrupted; use the resume checkpoint or retrain")
        return {k: f.get_tensor(k) for k in f.keys()}


def save_resume(path, state):
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_resume(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickled object, a truncated or foreign file
        raise UserError(f"cannot read resume file {path}: {str(e).splitlines()[0][:200]}") from None


class EMA:
    """Exponential moving average of the weights, in fp32. The decay warms up as (1 + step) / (10 + step), so a
    short run is not dominated by its random initial weights."""

    def __init__(self, model, decay):
        self.decay = decay
        self.shadow = {k: v.detach().float().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model, step):
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in model.state_dict().items():
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
    for i, (img, caption) in enumerate(zip(images, captions)):
        arr = ((img.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
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
    a("--save_interval", type=int, default=200, help="steps between saves of weights and resume file")
    a("--save_dtype", default="bf16", choices=list(SAVE_DTYPES))
    a("--sample_interval", type=int, default=400, help="steps between sample grids; 0 = only at the end")
    a("--sample_steps", type=int, default=20)
    a("--sample_cfg", type=float, default=2.0, help="classifier-free guidance scale of the sample grids")
    a("--sample_shift", type=float, default=3.0)
    a("--out_dir", default=DEFAULT_OUT_DIR)
    a("--save_dir", default=DEFAULT_SAVE_DIR)
    a("--from_resume", type=int, default=0, help="1 = continue from the resume file in --save_dir if there is one")
    a("--seed", type=int, default=0)
    a("--num_workers", type=int, default=0, help="data loader processes (0 on a small CPU)")
    a("--use_wandb", action="store_true", help="log to wandb (offline without WANDB_API_KEY)")
    a("--wandb_project", default="MiniSD3")
    parser.set_defaults(**defaults)
    return parser


# Settings that define a run: resuming with a different value would silently train something else.
RESUME_MUST_MATCH = ("preset", "resolution", "data", "prediction")


def check_resume(state, args, stage):
    if state.get("kind") != "resume":
        raise UserError("the resume file is not a MiniSD3 resume checkpoint")
    if state["stage"] != stage:
        raise UserError(f"the resume file is from stage '{state['stage']}', not '{stage}'")
    diffs = [f"--{k} {state['args'][k]} (saved) vs {getattr(args, k)} (now)"
             for k in RESUME_MUST_MATCH if state["args"].get(k) != getattr(args, k)]
    if diffs:
        raise UserError("cannot resume, the run was started with other settings: " + "; ".join(diffs))


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


def train(args, stage, model, components, dataset, info, log, sample_prompts):
    """Train `model` on `dataset`; save weights to out_dir/<stage>_<preset>.* and resume state to save_dir.
    `log` is a Logger (or any callable taking a message); `sample_prompts` fill the sample grids."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tqdm import tqdm

    name, device = f"{stage}_{args.preset}", info.device
    model.to(device).train()
    components.to(device)
    model.gradient_checkpointing = bool(args.gradient_checkpointing)
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") \
        else None
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel for all parameters, on CPU too (a quarter of the per-step optimizer time of foreach)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    ema = EMA(model, args.ema_decay) if args.ema_decay > 0 else None
    global_batch = args.batch_size * args.accumulation_steps * info.world_size
    steps_per_epoch = len(dataset) // global_batch
    if steps_per_epoch == 0:
        raise UserError(f"the dataset has {len(dataset)} samples, fewer than one global batch ({global_batch} = "
                        "batch_size x accumulation_steps x processes): lower --batch_size")
    total_steps = args.max_steps if args.max_steps > 0 else args.epochs * steps_per_epoch
    generator = torch.Generator().manual_seed(args.seed * 1000 + info.rank)  # sigmas, noise, caption dropout
    step = epoch = consumed = samples_seen = 0
    wandb_id = None
    resume_path = os.path.join(args.save_dir, f"{name}_resume.pt")
    metrics_path = os.path.join(args.out_dir, f"{name}_metrics.jsonl")

    if args.from_resume and os.path.exists(resume_path):
        state = load_resume(resume_path)
        check_resume(state, args, stage)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None and state.get("ema"):
            ema.shadow = state["ema"]
        step, epoch, consumed, samples_seen = state["step"], state["epoch"], state["consumed"], state["samples_seen"]
        wandb_id = state.get("wandb_id")
        if state["world_size"] == info.world_size and state["global_batch"] == global_batch:
            generator.set_state(state["rng"][info.rank])
        else:  # the data position carries over exactly; the noise stream restarts, seeded by step and rank
            generator.manual_seed(args.seed * 1000 + info.rank + 7919 * step)
            log(f"resume with {info.world_size} processes and global batch {global_batch} (saved: "
                f"{state['world_size']}, {state['global_batch']}): continuing at sample {consumed} of epoch {epoch}")
        log(f"resumed {resume_path} at step {step} (epoch {epoch}, {samples_seen} samples seen)")
    elif args.from_resume:
        log(f"no resume file at {resume_path}: starting from scratch")
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
    log(f"{stage}: {sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters, {len(dataset)} samples, "
        f"global batch {global_batch}, {total_steps} steps, {info.world_size} process(es) on {device.type}")

    def save():
        rng = [None] * info.world_size
        if info.world_size > 1:
            dist.all_gather_object(rng, generator.get_state())
        else:
            rng = [generator.get_state()]
        if not info.is_main:
            return
        export = ema.shadow if ema is not None else model.state_dict()
        record = {"stage": stage, "preset": args.preset, "step": step, "samples_seen": samples_seen,
                  "resolution": args.resolution, "prediction": args.prediction, "ema": ema is not None,
                  "save_dtype": args.save_dtype,
                  "transformer": model.config.to_dict(), "components": components.spec,
                  "sampling": {"steps": args.sample_steps, "cfg": args.sample_cfg, "shift": args.sample_shift},
                  "args": vars(args)}
        save_weights(args.out_dir, name, export, components.trained_state_dict(), record, SAVE_DTYPES[args.save_dtype])
        save_resume(resume_path, {
            "kind": "resume", "stage": stage, "step": step, "epoch": epoch, "consumed": consumed,
            "samples_seen": samples_seen, "world_size": info.world_size, "global_batch": global_batch,
            "model": {k: v.float() for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict(),
            "ema": ema.shadow if ema is not None else None, "lr": optimizer.param_groups[0]["lr"], "rng": rng,
            "wandb_id": wandb_id, "args": vars(args)})

    def sample_grid():
        if not info.is_main:
            return
        sampler_model = model
        if ema is not None:
            sampler_model = SD3Light(model.config).to(device)
            sampler_model.load_state_dict(ema.shadow)
        images = sample_images(sampler_model, components, sample_prompts, seed=args.seed, steps=args.sample_steps,
                               cfg=args.sample_cfg, shift=args.sample_shift, resolution=args.resolution,
                               device=device, prediction=args.prediction)
        path = os.path.join(args.out_dir, "samples", f"{name}_step{step:06d}.png")
        save_grid(path, images, sample_prompts)
        log(f"sample grid: {path}")

    bar = tqdm(total=total_steps, initial=step, desc=stage, dynamic_ncols=True) if info.is_main else None
    if isinstance(log, Logger):
        log.bar = bar  # messages go through the bar while it shows
    nan_streak, t_last = 0, time.perf_counter()
    while step < total_steps:
        if consumed + global_batch > len(dataset):
            epoch, consumed = epoch + 1, 0
        sampler.set_position(epoch, consumed)
        loader = iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                                  num_workers=args.num_workers, drop_last=True))
        while step < total_steps and consumed + global_batch <= len(dataset):
            lr = lr_at(step, total_steps, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = 0.0
            for micro in range(args.accumulation_steps):
                last = micro == args.accumulation_steps - 1
                # gradients are all-reduced once per step, on the last micro-batch
                sync = contextlib.nullcontext() if last or info.world_size == 1 else train_model.no_sync()
                with sync:
                    loss = flow_matching_loss(train_model, components, next(loader), generator, args, device,
                                              autocast_dtype)
                    (loss / args.accumulation_steps).backward()
                loss_sum += loss.item()
            loss_mean = all_mean(loss_sum / args.accumulation_steps, info)
            step, consumed, samples_seen = step + 1, consumed + global_batch, samples_seen + global_batch
            if math.isfinite(loss_mean):
                nan_streak = 0
                grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip).item()
                optimizer.step()
                if ema is not None:
                    ema.update(model, step)
                now = time.perf_counter()
                images_per_s, t_last = global_batch / (now - t_last), now
                if info.is_main:
                    row = {"step": step, "epoch": epoch, "loss": loss_mean, "lr": lr, "grad_norm": grad_norm,
                           "images_per_s": images_per_s, "samples_seen": samples_seen}
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
            if step % args.save_interval == 0 or step == total_steps:
                save()
            if (args.sample_interval and step % args.sample_interval == 0) or step == total_steps:
                sample_grid()
    if bar is not None:
        bar.close()
    if isinstance(log, Logger):
        log.bar = None
    if info.world_size > 1:
        dist.barrier()  # leave together: rank 0 may still be writing the last save or sample grid
    if wandb_run is not None:
        wandb_run.finish()
    log(f"done: {weights_paths(args.out_dir, name)['weights']} (step {step})")
    return step


def truncate_metrics(path, step):
    """Drop metric rows past `step` (0 for a fresh run)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(rows))
