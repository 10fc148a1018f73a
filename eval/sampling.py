"""Sampling: weights (with a LoRA, if asked) to images, and images to captioned PNG grids. The training stages draw
their sample grids with the same functions, so a grid from training and one from eval_sample.py agree."""
import math
import os
import re
import sys
import textwrap

import torch

from model.errors import UserError
from model.file_io import atomic_path
from model.model_lora import attach_lora, merge_lora, read_lora_file, set_lora_scale, text_encoders_for
from model.rectified_flow import Sampler, euler_sample
from model.weights import load_weights, resolve_lora, sampling_name, weights_identity


def sample_images(model, components, prompts, seed, sampler, device):
    """Generate one image per prompt with fixed noise (prompt i's noise seeded with seed + i, or with seed[i] for
    a list of seeds), as `sampler` (model/rectified_flow.Sampler) says -> images in [-1, 1] on CPU. A re-noising
    sampler draws each prompt's fresh noise from its own seeded stream, as diffusers' pipeline draws it from its
    generator. The prompts go sampler.batch at a time (all of them for 0), each with its own noise either way; the
    latents are decoded one image at a time (a 1024px decode is the VAE's largest activation)."""
    was_training, device = model.training, torch.device(device)
    model.eval()
    with torch.no_grad():  # (trained text encoders run here)
        tokens, pooled = components.encode_prompts(prompts)
    seeds = seed if isinstance(seed, (list, tuple)) else [seed + i for i in range(len(prompts))]
    step = sampler.batch or len(prompts)
    latents = torch.cat([sampled_latents(model, components, (tokens[k:k + step], pooled[k:k + step]),
                                         seeds[k:k + step], sampler, device) for k in range(0, len(prompts), step)])
    model.train(was_training)
    return torch.cat([components.decode_latents(latent[None]).float().cpu() for latent in latents.float()])


def sampled_latents(model, components, text, seeds, sampler, device):
    """The latents of one forward's prompts (`text`: their tokens and pooled vectors), each from its own seed."""
    side = sampler.resolution // components.downscale
    shape, autocast = (components.latent_channels, side, side), sampler.autocast
    streams = [torch.Generator().manual_seed(s) for s in seeds]

    def fresh_noise():
        return torch.stack([torch.randn(shape, generator=stream) for stream in streams]).to(device)

    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        return euler_sample(model, fresh_noise(), text[0].to(device), text[1].to(device), sampler,
                            fresh_noise=fresh_noise if sampler.renoise else None)


def sampler_for(record, steps=None, cfg=None, shift=None, resolution=None):
    """How to sample a weights record's model: the settings given, else what its run sampled its grids with (a
    distilled generator's record says it re-noises), at its resolution, as it predicts."""
    saved = record["sampling"]
    return Sampler(resolution or record["resolution"], steps or saved["steps"], saved["cfg"] if cfg is None else cfg,
                   saved["shift"] if shift is None else shift, record["prediction"], saved.get("renoise", False))


# ----------------------------------------------------------------------------------------------------------------
# Weights to sample from


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
            text = text_encoders_for(components.text_models(), lora_config)  # those it adapts too, if any
            for prefix, encoder in text.items():
                attach_lora(encoder, lora_state, lora_config["text"][prefix], prefix=prefix)
        except ValueError as e:
            raise UserError(f"{path} does not fit {record['manifest']}: {e}") from None
        for adapted in (model, *text.values()):
            set_lora_scale(adapted, lora_scale)
            if merge:
                merge_lora(adapted)
    return model, components, record, lora_record


def output_path(record, lora_record, out_dir, pattern):
    """Where eval output about some weights goes by default: `pattern` (e.g. "samples/{name}_eval.png") beside
    the weights' manifest, in their run's own folder, so runs of the same name in different folders never
    overwrite each other's output; for a diffusers folder, in `out_dir` and named after the folder."""
    if record["stage"] == "diffusers":
        folder = record["manifest"].rstrip(os.sep)
        if os.path.basename(folder) == "transformer":
            folder = os.path.dirname(folder)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(folder))
        return os.path.join(out_dir, pattern.format(name=name))
    folder = os.path.dirname(os.path.abspath(record["manifest"]))
    return os.path.join(folder, pattern.format(name=sampling_name(record, lora_record)))


# ----------------------------------------------------------------------------------------------------------------
# Grids


def to_uint8(images):
    """[N, 3, H, W] in [-1, 1] -> uint8 array [N, H, W, 3], as PNGs store them."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()


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


def save_grid(path, images, captions, columns=None):
    """Write a captioned grid PNG atomically."""
    with atomic_path(path) as tmp:
        captioned_grid(images, captions, columns=columns).save(tmp, format="PNG")
