"""diffusers folders: reading a published SD3 transformer (one file or shards, its config and its pipeline's
sampling shift), and giving our saved weights a diffusers transformer folder, or a whole pipeline folder."""
import contextlib
import json
import os
import shutil

from model.file_io import atomic_path, atomic_write_text, sha256_of

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DEFAULT_SHIFT = 3.0  # SD3's FlowMatchEulerDiscreteScheduler, when a folder has no scheduler config


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


def pipeline_shift(pipeline_dir):
    """The sampling shift of a pipeline folder's scheduler (SD3's 3.0 when it has none)."""
    scheduler = os.path.join(pipeline_dir, "scheduler", "scheduler_config.json")
    if not os.path.isfile(scheduler):
        return DEFAULT_SHIFT
    with open(scheduler, encoding="utf-8") as f:
        return json.load(f).get("shift", DEFAULT_SHIFT)


def scheduler_settings(sampling):
    """The FlowMatchEulerDiscreteScheduler settings of an exported pipeline, from our sampler's settings (a
    weights record's "sampling"). A plain sampler: its shift. A few-step generator (it re-noises): stochastic
    sampling, and a shift and a terminal sigma chosen so that diffusers' own schedule for its number of steps is
    exactly our sigmas (rectified_flow.sampling_sigmas): `pipe(prompt, num_inference_steps=steps,
    guidance_scale=1)` samples it as we do. diffusers spaces its sigmas evenly from 1 to its smallest training
    sigma, shifts them, then stretches 1 - sigma to end at the terminal; ours are evenly spaced from 1 to
    1/steps, then shifted."""
    steps, shift = sampling["steps"], sampling["shift"]
    if not sampling.get("renoise"):
        return {"shift": shift}
    if steps == 1:  # one step at sigma 1, whatever the shift
        return {"shift": shift, "stochastic_sampling": True}
    # Both schedules' 1 - sigma are proportional iff k * (S - 1) = S * steps * d * (k - 1), d = diffusers' spacing
    # (which depends on its shift k through its smallest sigma): a fixed point, found in a few iterations
    k = shift * steps / (steps + shift - 1)
    for _ in range(50):
        smallest = k * 0.001 / (1 + (k - 1) * 0.001)
        d = (1 - smallest) / (steps - 1)
        k = shift * steps * d / (shift * steps * d - (shift - 1))
    return {"shift": k, "shift_terminal": shift / (steps + shift - 1), "stochastic_sampling": True}


def export_diffusers(folder, config, weights_file, pipeline_from=None, scheduler=None):
    """Give the verified weights file of a save (its keys are diffusers' names) a diffusers transformer folder,
    folder/transformer/ (config.json + the file, hard-linked: no second copy is written); with `pipeline_from`
    (an SD3 folder) also the rest of a pipeline folder that StableDiffusion3Pipeline loads: its frozen parts
    linked (copied where links are not possible) and its scheduler with `scheduler`'s settings (scheduler_settings).
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
    config.save_json(os.path.join(transformer, "config.json"))
    if pipeline_from:
        link_pipeline_parts(folder, pipeline_from, scheduler or {"shift": DEFAULT_SHIFT})
    return written


def link_pipeline_parts(folder, base, settings):
    """The frozen parts of the pipeline folder `base` linked into `folder`, its scheduler with our settings."""
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
                      json.dumps({**scheduler, **settings}, indent=2) + "\n")
    atomic_write_text(os.path.join(folder, "model_index.json"), json.dumps(index, indent=2) + "\n")
