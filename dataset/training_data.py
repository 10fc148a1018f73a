"""What a stage trains on: `--data` as a dataset (aspect-ratio buckets for user images), the sample grids' prompts,
the check that every image size fits the model, the validation images (encoded once), and the cache of encoded
features (dataset/cache.py) that training reads instead of the images. stage_data puts them together: the call a
stage makes (through trainer/trainer_utils.py); DPO, which trains on preference pairs, calls validation_data and
ready_data on its pairs.

The glue takes DataSettings, what a stage's arguments say of its data, which the stage's parser fills
(args.data_settings); `info` is the process's rank, world size and device (trainer/mechanics/distributed.DistInfo).
"""
import os
import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dataset.cache import CacheLayout, Processes, build_cache
from dataset.image_folder import (
    CaptionOptions, DatasetError, ImageCaptionDataset, bucket_layout, bucket_sizes, build_dataset, read_prompt_file,
)
from dataset.preference_pairs import encode_pairs
from dataset.samples import EpochSamples, count_short_of
from dataset.shapes import SHAPES_VERSION
from model.components import BuiltinComponents
from model.errors import UserError
from model.checkpoint import load_safetensors
from model.file_io import json_digest, write_safetensors
from model.memory import fit_cache_build
from model.model_sd3light import check_patch_grid
from model.rectified_flow import mask_to_latents


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """What a stage's arguments say of its data: each field is the value of the option of its name (--data, the
    data, validation and plumbing groups of trainer/arguments.py), and the stage's parser fills it
    (args.data_settings): the data, its size, buckets and captions, what an epoch does with your images, the
    validation images, the cache, and the grids' prompts. A stage that trains on no --data (DPO's pairs) has no
    --data and no data group: those fields keep their defaults, and what it reads of the rest is the validation
    images and the cache."""
    resolution: int
    seed: int
    val_data: str
    val_samples: int
    val_interval: int
    cache: str
    cache_dir: str
    cache_only: bool
    encode_batch_size: int
    data: str = None
    num_samples: int = None
    buckets: str = None
    caption_prefix: str = ""
    caption_suffix: str = ""
    caption_lines: str = "join"
    random_flip: float = 0.0
    shuffle_tags: int = 0
    keep_tags: int = 0
    val_fraction: float = 0.0
    sample_prompts: str = None

    @property
    def captions(self):
        """How captions are read (CaptionOptions): --caption_prefix, --caption_suffix, and --caption_lines each."""
        return CaptionOptions(self.caption_prefix, self.caption_suffix, self.caption_lines == "each")


def training_dataset(settings, components, patch_size, log, data=None, num_samples=None):
    """--data (or `data`), in aspect-ratio buckets for user images when --buckets asks for them (auto: 5 buckets
    on SD3 components, centre-cropped squares with the built-in ones)."""
    data, resolution = data or settings.data, settings.resolution
    builtin = data == "builtin" or data.startswith("builtin:")
    count = int(settings.buckets) if settings.buckets != "auto" else (5 if components.spec["kind"] == "sd3" else 0)
    sizes = None
    if count and not builtin:
        try:
            sizes = bucket_sizes(resolution, components.downscale * patch_size, count=count)
        except ValueError as e:
            raise UserError(f"--buckets {settings.buckets} at --resolution {resolution}: {e}") from None
    dataset = build_dataset(data, resolution, num_samples=num_samples or settings.num_samples, seed=settings.seed,
                            log=log, buckets=sizes, captions=settings.captions)
    warn_long_captions(dataset, components, log)
    return dataset


def caption_options(settings):
    """CaptionOptions from a run's arguments (a dict: vars(args), or the args an exported record keeps); runs
    from before these arguments read captions whole and unprefixed."""
    return CaptionOptions(settings.get("caption_prefix", ""), settings.get("caption_suffix", ""),
                          settings.get("caption_lines", "join") == "each")


def epoch_samples(settings, parts, log):
    """What an epoch shows (dataset/samples.py): the user's images (parts[0]) with their repeats, captions, flips
    and tag shuffles, beside any other parts (LoRA's prior data). Built-in data alone (or first) is trained as it
    was: one permutation of its samples an epoch."""
    if not isinstance(parts[0], ImageCaptionDataset):
        features = {"caption_prefix": settings.captions.prefix, "caption_suffix": settings.captions.suffix,
                    "random_flip": settings.random_flip, "shuffle_tags": settings.shuffle_tags}
        used = [f"--{name}" for name, value in features.items() if value]
        if used:
            raise UserError(f"{', '.join(used)} apply to your own images (--data a folder or .jsonl), not to the "
                            "built-in shapes (their captions name left and right, and carry no tags)")
        return parts[0] if len(parts) == 1 else torch.utils.data.ConcatDataset(parts)
    shuffle, keep = settings.shuffle_tags, settings.keep_tags
    short = count_short_of(parts, keep) if shuffle else 0
    if short:
        log(f"warning: {short} caption(s) have no more than --keep_tags {keep} tags: they are trained as they are, "
            "unshuffled")
    samples = EpochSamples(parts, settings.resolution, settings.random_flip, shuffle, keep, settings.seed)
    if len(samples) != len(parts[0]) or samples.flip or shuffle or len(samples.keys) != len(samples):
        log(f"an epoch shows {len(samples)} samples drawn from {len(samples.keys)} variants (image x caption x "
            f"flip{', tags shuffled' if shuffle else ''})")
    return samples


def split_validation(settings, dataset):
    """--val_fraction of the user's images held out, never trained on -> (what trains, held out or None)."""
    fraction = settings.val_fraction
    if not fraction:
        return dataset, None
    if settings.val_data:
        raise UserError("pass --val_data or --val_fraction, not both")
    if fraction >= 1:
        raise UserError(f"--val_fraction {fraction:g} would hold out every image: use a fraction below 1 (e.g. 0.1)")
    if not isinstance(dataset, ImageCaptionDataset):
        raise UserError("--val_fraction splits your own images; the built-in data has its own held-out split: pass "
                        "--val_data builtin")
    return dataset.split(fraction, settings.seed)


def validation_data(settings, held_out, log):
    """The validation images: --val_data (the built-in held-out split for 'builtin'), or what --val_fraction held
    out, as resolution x resolution squares with their first caption; None without either."""
    s = settings
    if held_out is None and not s.val_data:
        return None
    if held_out is None:
        try:
            held_out = build_dataset(s.val_data, s.resolution, split="heldout", num_samples=s.val_samples,
                                     seed=s.seed, log=lambda line: None, captions=s.captions)
        except DatasetError as e:
            raise UserError(f"--val_data {s.val_data}: {e}") from None
    if isinstance(held_out, ImageCaptionDataset):
        held_out = held_out.squares()
    log(f"validation: {min(len(held_out), s.val_samples)} images of {s.val_data or '--data'} every "
        f"{s.val_interval} steps, at sigmas 0.1 ... 0.9 with fixed noise; its loss is the unweighted MSE whatever "
        "--loss and --weighting train (eval/eval_loss.py's, comparable across runs)")
    return held_out


def warn_long_captions(dataset, components, log):
    """One counted warning for the user captions the built-in text encoder cuts short (it reads the first words
    that fit its tokens; training goes on)."""
    if not isinstance(components, BuiltinComponents):
        return
    tokenizer = components.text_encoder.tokenizer
    captions = (caption for _, caption in getattr(dataset, "items", ()))  # user images; the built-in shapes fit
    count = sum(len(tokenizer.words(caption)) > tokenizer.max_words for caption in captions)
    if count:
        log(f"warning: {count} caption(s) have more than {tokenizer.max_words} words; the built-in text encoder "
            f"reads their first {tokenizer.max_words} (SD3 components read 77 tokens: --base)")


def sample_prompts_for(dataset, prompt_file=None, count=8):
    """The sample grids' prompts: a file's lines if given; else the built-in data's own; else `count` captions
    spread over the user's dataset, and the unconditional prompt."""
    if prompt_file:
        return read_prompt_file(prompt_file)
    if hasattr(dataset, "sample_prompts"):
        return dataset.sample_prompts()
    picks = [dataset.items[k * len(dataset) // count][1] for k in range(min(count, len(dataset)))]
    return [c for c in dict.fromkeys(picks) if c] + [""]


def check_image_sizes(resolution, dataset, config, components):
    """Every image size must be a whole number of patches in latent space and fit the position table of a model of
    `config` (pos_embed_max_size patches a side): one line now, not a traceback at the first step."""
    multiple = components.downscale * config.patch_size
    for width, height in bucket_layout(dataset, resolution)[1]:
        what = f"--resolution {resolution}" + ("" if width == height == resolution else f" (bucket {width}x{height})")
        if width % multiple or height % multiple:
            raise UserError(f"{what}: image sides must be multiples of {multiple} (autoencoder downscale "
                            f"{components.downscale} x patch size {config.patch_size})")
        try:
            check_patch_grid(height // multiple, width // multiple, config.pos_embed_max_size)
        except ValueError as e:
            raise UserError(f"{what}: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# A stage's data, put together


@dataclass(frozen=True)
class StageData:
    """What a stage's steps read (the cache when it is on; None after --cache_only), the grids' prompts, and the
    validation images: held out (a dataset, or None), and encoded on the ranks that score them (`validation`:
    encode_heldout's batches, else None)."""
    dataset: object
    prompts: list
    held_out: object = None
    validation: list = None


def stage_data(settings, components, config, info, batch_size, log, prior=None):
    """--data as an epoch shows it (with the `prior` dataset beside it: LoRA's prior data), the grids' prompts (a
    file's, the built-in data's own, or captions of the user's data) and the validation images (--val_data, or
    --val_fraction of --data held out), made ready for the steps (ready_data). `settings`: DataSettings."""
    dataset, held_out = split_validation(settings, training_dataset(settings, components, config.patch_size, log))
    prompts = sample_prompts_for(dataset, settings.sample_prompts)
    dataset = epoch_samples(settings, [dataset] + ([prior] if prior is not None else []), log)
    data = StageData(dataset, prompts, validation_data(settings, held_out, log))
    return ready_data(settings, data, components, config, info, batch_size, log)


def ready_data(settings, data, components, config, info, batch_size, log):
    """`data` (StageData) made ready for the steps: every image size checked against the model's `config`, the
    validation images encoded in batches of `batch_size` while the text encoders are in memory, on the ranks that
    score them, and the cache built (the text encoders then freed)."""
    check_image_sizes(settings.resolution, data.dataset, config, components)
    if hasattr(components, "stream_text_encoders"):  # SD3's: what the device holds while they encode, planned
        components.stream_text_encoders(fit_cache_build(components.encoder_sizes(), settings.encode_batch_size,
                                                        settings.resolution, info.device, log), log)
    validation = None
    if data.held_out is not None and (info.is_main or info.sharded):
        validation = encode_heldout(components, data.held_out, settings.val_samples, batch_size, info.device)
    dataset = features_to_train_on(settings, data.dataset, components, data.prompts, info, log)
    return replace(data, dataset=dataset, validation=validation)


@torch.no_grad()
def encode_heldout(components, dataset, num_samples, batch_size, device):
    """The first num_samples items encoded once, in batches: [{"first": index of its first item, "latents" (the
    latent distribution's mean), "tokens", "pooled"}], on the CPU. What a training run's validation keeps (its text
    encoders may be freed later)."""
    batches = []
    for start in range(0, min(num_samples, len(dataset)), batch_size):
        items = [dataset[i] for i in range(start, min(num_samples, len(dataset), start + batch_size))]
        latents = components.encode_images(torch.stack([it["image"] for it in items]).to(device))
        captions = [it["caption"] for it in items]
        if getattr(components, "trained_text", ()):  # the text features, run through the trained encoders each time
            text = {"text": {k: v.cpu() for k, v in components.encode_text(captions).items()}}
        else:
            tokens, pooled = components.encode_prompts(captions)
            text = {"tokens": tokens.cpu(), "pooled": pooled.cpu()}
        batches.append({"first": start, "latents": latents.cpu(), **text})
    return batches


# ----------------------------------------------------------------------------------------------------------------
# The cache of encoded features


def use_cache(settings, components):
    """--cache auto: on for real SD3 components (their encoders cost most of a step), off for the built-in ones
    (cheaper to run than to read back)."""
    cache = settings.cache
    return cache == "1" or (cache == "auto" and components.spec["kind"] != "builtin") or settings.cache_only


def parts_of(dataset):
    """The datasets a run's data is made of, --data's first (LoRA's prior data beside it), or just the one."""
    if isinstance(dataset, torch.utils.data.ConcatDataset):
        return list(dataset.datasets)
    return dataset.parts if isinstance(dataset, EpochSamples) else [dataset]


def file_stamp(path):
    """(size, mtime in ns): a file's change, as the fingerprint sees it."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def data_fingerprint(dataset, resolution):
    """Everything about the data that changes the cached features: the files (path, size, mtime), the captions,
    the image sizes. Several datasets (LoRA's prior data) are listed part by part."""
    if parts_of(dataset) != [dataset]:
        parts = [data_fingerprint(d, resolution) for d in parts_of(dataset)]
        merged = {f"{k}" if i == 0 else f"part{i}_{k}": v for i, part in enumerate(parts) for k, v in part.items()}
        return {**merged, **(dataset.fingerprint() if isinstance(dataset, EpochSamples) else {})}
    sizes = [list(size) for size in bucket_layout(dataset, resolution)[1]]
    if hasattr(dataset, "fingerprint"):  # preference pairs
        return {**dataset.fingerprint(), "sizes": sizes}
    if hasattr(dataset, "items"):  # user images
        files = [[os.path.abspath(path), *file_stamp(path)] for path, _ in dataset.items]
        found = {"data": os.path.abspath(dataset.path), "count": len(dataset.items), "files": json_digest(files),
                 "captions": json_digest([caption for _, caption in dataset.items]), "sizes": sizes}
        if any(len(captions) > 1 for captions in getattr(dataset, "captions", [])):
            found["all_captions"] = json_digest(dataset.captions)
        if any(getattr(dataset, "masks", [])):
            found["masks"] = json_digest([[m, *file_stamp(m)] if m else None for m in dataset.masks])
        return found
    return {"data": f"builtin:{dataset.split}:{','.join(dataset.colors)}", "count": len(dataset),
            "generator": json_digest([dataset.seed, dataset.resolution, SHAPES_VERSION]), "sizes": sizes}


def cache_folder(cache_dir, dataset, fingerprint, components):
    """One cache folder per dataset (its parts' sources) and component set: stages on the same data share it, and
    a resolution, caption or file change rebuilds it in place."""
    source = parts_of(dataset)[0]
    name = os.path.basename(os.path.normpath(source.path)) if hasattr(source, "path") else "builtin"
    sources = [fingerprint[k] for k in sorted(fingerprint) if k == "data" or k.endswith("_data")]
    parts = [sources, components.spec.get("kind"), components.spec.get("path")]
    as_ids = components.identity().get("text_ids")  # the encoders that train, cached as ids: a folder of their own
    key = json_digest(parts + [as_ids] if as_ids else parts)[:16]
    return os.path.join(cache_dir, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key}")


def cached_dataset(settings, dataset, components, info, log):
    """Encode every sample once (split across ranks, resumable) and return the cache, read memory-mapped; its
    items are feature dicts (components.encode), in the order of `dataset`'s samples, and it keeps their image
    sizes (bucket_of, bucket_sizes) so they batch as the images would."""
    fingerprint = {**data_fingerprint(dataset, settings.resolution), "resolution": settings.resolution,
                   "components": json_digest(components.identity())}
    samples, dataset = dataset, getattr(dataset, "variants", dataset)  # each variant of an image once

    def encode(indices):
        items = [dataset[i] for i in indices]
        features = [None] * len(items)
        by_size, pairs = {}, "chosen" in items[0]  # preference pairs: both images and the caption
        for k, item in enumerate(items):  # one encoder batch per image size (bucket)
            by_size.setdefault(tuple(item["chosen" if pairs else "image"].shape), []).append(k)
        for group in by_size.values():
            def stacked(key):
                return torch.stack([items[k][key] for k in group]).to(info.device)
            captions = [items[k]["caption"] for k in group]
            batch = encode_pairs(components, stacked("chosen"), stacked("rejected"), captions) if pairs else \
                components.encode(stacked("image"), captions)
            if "mask" in items[0]:  # at the latents' size, as the loss weighs them
                batch["mask"] = mask_to_latents(stacked("mask"), batch["latents"].shape[-2:])
            for j, k in enumerate(group):
                features[k] = {key: value[j].detach().cpu().contiguous() for key, value in batch.items()}
        return features

    folder = cache_folder(settings.cache_dir, samples, fingerprint, components)
    processes = Processes(info.rank, info.world_size, dist.barrier if info.world_size > 1 else None)
    cache = build_cache(folder, fingerprint, len(dataset), encode, processes,
                        CacheLayout(encode_batch=settings.encode_batch_size), log)
    warn_truncated(components, info, log)
    cache.bucket_of, cache.bucket_sizes = bucket_layout(dataset, settings.resolution)  # the images' sizes, as batched
    return samples.reading(cache) if samples is not dataset else cache


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


def features_to_train_on(settings, dataset, components, prompts, info, log):
    """With the cache on (--cache, auto: with SD3 components), encode `dataset` once and train from its cache; the
    text encoders are then freed, once the sample prompts are encoded. -> what to train on, or None when
    --cache_only asked for the cache alone."""
    if not use_cache(settings, components) or not getattr(dataset, "cacheable", True):
        return dataset
    if getattr(dataset, "shuffle_tags", False):
        raise UserError("--shuffle_tags 1 changes the text at every step, and the cache holds it encoded once: pass "
                        "--cache 0 (the text encoders then stay in memory and encode each step)")
    cache = cached_dataset(settings, dataset, components, info, log)
    if settings.cache_only:
        features = getattr(cache, "source", cache)  # the cache itself, under an epoch's slots (EpochSamples)
        log(f"--cache_only: the cache of {len(features)} samples is ready in {features.folder}")
        return None
    if hasattr(components, "free_text_encoders"):  # their memory is the transformer's now (not the trained ones')
        components.free_text_encoders(prompts, None if components.trained_text else
                                      encoded_prompts(settings.cache_dir, prompts, components))
    return cache


def encoded_prompts(cache_dir, prompts, components):
    """The sample grids' prompts as the text encoders give them (components.condition: tokens, pooled), kept under
    `cache_dir`/prompts/ beside the features' caches: a run whose cache is complete encodes nothing, these included,
    and its text encoders never reach the device."""
    folder = os.path.join(cache_dir, "prompts")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{json_digest([list(prompts), components.identity()])[:16]}.safetensors")
    if os.path.isfile(path):
        try:
            kept = load_safetensors(path)
            return kept["tokens"], kept["pooled"]
        except (OSError, ValueError, KeyError, RuntimeError):  # damaged: encoded again below
            pass
    tokens, pooled = components.encode_prompts(prompts)
    write_safetensors(path, {"tokens": tokens.cpu().contiguous(), "pooled": pooled.cpu().contiguous()})
    return tokens, pooled
