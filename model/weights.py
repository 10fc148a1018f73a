"""Trained weights on disk: what runs' files are called, writing them (verified, committed by a manifest, plus a
diffusers transformer folder for v-prediction), and reading them back strictly for sampling and fine-tuning,
from our manifests or from diffusers folders. LoRA files are found here by name too.

    out/pretrain_tiny.json                                the weights' manifest (model/checkpoint.py)
    out/pretrain_tiny.stepNNNNNNNN.safetensors            the transformer, diffusers' key names
    out/pretrain_tiny.stepNNNNNNNN.components.safetensors the trained parts of the components (built-in text encoder)
    out/pretrain_tiny/transformer/                        the same transformer as a diffusers folder (v-prediction)
    out/pretrain_tiny_single_file.safetensors             with --export_single_file: the original SD3 layout, bf16
    out/lora/lora_demo_tiny.safetensors                   a LoRA, in diffusers' LoRA format
"""
import json
import os
import re

import torch

from model.checkpoint import (
    checkpoint_file, load_safetensors, manifest_path, read_manifest, save_checkpoint, stem_of, step_file,
)
from model.components import ComponentsError, build_components, check_widths
from model.diffusers_io import (
    diffusers_transformer_dir, diffusers_weight_files, export_diffusers, pipeline_shift,
    scheduler_settings,
)
from model.errors import UserError
from model.file_io import json_digest, sha256_of, write_safetensors
from model.loading import TensorFiles, fill
from model.single_file import SingleFileTensors, single_file_metadata, single_file_state
from model.model_sd3light import (
    PRESETS, SD3LightConfig, StateDictMismatchError, check_state_dict, meta_model, preset_of,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "out")
# Stages whose weights another stage can start from: `--from_weight pretrain` means out/pretrain_<preset>.
WEIGHT_STAGES = ("pretrain", "sft")


# ----------------------------------------------------------------------------------------------------------------
# Names


def run_name(stage, preset):
    """What a run's files are called: pretrain_tiny.json, pretrain_tiny_metrics.jsonl, pretrain_tiny_resume.json."""
    return f"{stage}_{preset}"


def lora_run_name(name, preset):
    """A LoRA run's name: its metrics, samples and resume files are called lora_<name>_<preset>*. A name that could
    not name a file is a one-line error."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise UserError(f"--lora_name {name!r}: use letters, digits, '-' and '_' only (it names a file)")
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


# ----------------------------------------------------------------------------------------------------------------
# Writing


def save_weights(stem, step, model, state, components_state, record, dtype):
    """Export for sampling and fine-tuning: transformer weights `state` (the model's keys, diffusers names) in
    `dtype`, the trained parts of the components, and `record`, which rebuilds both. `state` must fit `model`
    exactly (every parameter and buffer, right shapes): an empty or partial state dict never reaches the disk."""
    check_state_dict(model, state)
    parts = {".safetensors": state}  # cast to `dtype` and copied off the GPU a tensor at a time, as written
    if components_state:
        parts[".components.safetensors"] = components_state
    return save_checkpoint(stem, step, {**record, "kind": "weights"}, parts, float_dtype=dtype, cast=True)


def check_export(components, prediction, pipeline, single_file):
    """What --export_pipeline and --export_single_file need: one line now if they cannot be written, not at the
    first save. A diffusers pipeline folder has neither the built-in components nor a clean-image (x) prediction;
    the tools that read the single file read the output as a velocity."""
    if pipeline and (components.spec["kind"] != "sd3" or prediction != "v"):
        raise UserError("--export_pipeline needs SD3 components (--base) and v-prediction: diffusers' pipeline has "
                        "neither the built-in components nor a clean-image (x) prediction")
    if single_file and prediction != "v":
        raise UserError("--export_single_file needs v-prediction weights: ComfyUI, Forge and diffusers read the "
                        "output as a velocity, and these weights predict the clean image (x)")


class WeightsExport:
    """What a stage's save exports: `model`'s weights (given at each save: the EMA's, or the raw ones) under `stem`
    with `record` (how to rebuild and sample them), in `dtype`, and for v-prediction a diffusers folder, with
    `pipeline` a whole pipeline, with `single_file` the original SD3 layout."""

    def __init__(self, stem, model, components, record, dtype, pipeline=False, single_file=False):
        self.stem, self.model, self.components, self.record = stem, model, components, record
        self.dtype, self.pipeline, self.single_file = dtype, pipeline, single_file
        self.output = manifest_path(stem)

    def write(self, step, state, samples_seen):
        """Our weights (save_weights), then, for v-prediction (diffusers reads the output as a velocity), the same
        file as a diffusers transformer folder <stem>/transformer/, with `pipeline` a whole pipeline folder around
        it (SD3 components only), and with `single_file` the original SD3 layout in bf16 (single_file_path).
        -> bytes written."""
        stem, record = self.stem, {**self.record, "samples_seen": samples_seen}
        written = save_weights(stem, step, self.model, state, self.components.trained_state_dict(), record,
                               self.dtype)
        if record["prediction"] == "v":
            written += export_diffusers(stem, self.model.config, step_file(stem, step, ".safetensors"),
                                        self.components.spec["path"] if self.pipeline else None,
                                        scheduler_settings(record["sampling"]))
        if self.single_file:
            written += save_single_file(single_file_path(stem), state, {**record, "kind": "weights", "step": step})
        return written


def single_file_path(stem):
    """Where --export_single_file writes: out/<run>_single_file.safetensors."""
    return f"{stem}_single_file.safetensors"


def save_single_file(path, state, record):
    """The transformer in the original SD3 single-file layout (model/single_file.py), bf16, with our record in
    its metadata (so --from_weight reads it back), written atomically and read back. -> bytes."""
    tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous().cpu()
               for k, v in single_file_state(state).items()}
    return write_safetensors(path, tensors, metadata={"minisd3": json.dumps(record)},
                             float_dtype=torch.bfloat16)["bytes"]


# ----------------------------------------------------------------------------------------------------------------
# Reading


def resolve_weights(name_or_path, out_dir):
    """A stage name ('pretrain_tiny'), or the path of the manifest, one of its files or the stem -> the stem."""
    stem = stem_of(name_or_path)
    if not os.path.dirname(stem) and not os.path.exists(manifest_path(stem)):
        stem = os.path.join(out_dir, stem)
    if not os.path.exists(manifest_path(stem)):
        raise UserError(f"no weights at {manifest_path(stem)}: train a stage first or pass the right path")
    return stem




def weights_source(name_or_path, out_dir=DEFAULT_OUT_DIR, base=None):
    """Where trained weights are and what they are, reading only their manifest or config: -> a record with
    "transformer" (the config), "components" (their spec; `base` replaces the SD3 folder), "weight_files" and
    "manifest" (where they were read from). Our weights (files checked against their manifest) or a diffusers
    folder (a pipeline, or just its transformer/). `base` replaces the SD3 folder the record names (moved, or
    another copy)."""
    if os.path.isdir(name_or_path) and diffusers_transformer_dir(name_or_path):
        return diffusers_source(name_or_path, base)
    metadata = single_file_metadata(name_or_path)
    if metadata is not None:
        return single_file_source(name_or_path, metadata, base)
    stem = resolve_weights(name_or_path, out_dir)
    record = read_manifest(stem, "weights")
    record.setdefault("prediction", "v")  # weights written before x-prediction existed predict v
    components_file = checkpoint_file(stem, record, ".components.safetensors")
    record.update(manifest=manifest_path(stem), weight_files=[checkpoint_file(stem, record, ".safetensors")],
                  components_file=components_file if os.path.basename(components_file) in record["files"] else None)
    if base:
        if record["components"]["kind"] != "sd3":
            raise UserError(f"--base {base}: {manifest_path(stem)} was trained on the built-in components, not SD3 "
                            "ones")
        record["components"] = {**record["components"], "path": os.path.abspath(base)}
    return record


def single_file_source(path, metadata, base=None):
    """weights_source for a single file in the original SD3 layout that we exported (--export_single_file): its
    record is in the file's `metadata`. The components are rebuilt from it (`base` replaces an SD3 folder)."""
    if "minisd3" not in metadata:
        raise UserError(f"{path} is an SD3 single file without MiniSD3's record (its config and components): start "
                        "from a diffusers folder of it instead (--from_weight base with --base)")
    record = json.loads(metadata["minisd3"])
    if base:
        record["components"] = {**record["components"], "path": os.path.abspath(base)}
    return {**record, "manifest": os.path.abspath(path), "weight_files": [path], "components_file": None,
            "layout": "single_file"}


def diffusers_source(folder, base=None):
    """weights_source for a diffusers SD3 transformer (its folder, or a pipeline folder holding it). The components
    come from `base`, else from the pipeline folder itself. Published SD3 transformers predict the velocity."""
    transformer_dir = diffusers_transformer_dir(folder)
    try:
        config = SD3LightConfig.load_json(transformer_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"{transformer_dir}/config.json: {e}") from None
    preset = preset_of(config)
    if preset is None:
        raise UserError(f"the transformer in {transformer_dir} matches no preset (layers {config.num_layers}, width "
                        f"{config.inner_dim}): add its config to PRESETS in model/model_sd3light.py")
    pipeline = os.path.dirname(os.path.abspath(transformer_dir))  # a transformer folder's parent may be a pipeline
    components_path = base or (pipeline if os.path.isdir(os.path.join(pipeline, "vae")) else None)
    if components_path is None:
        raise UserError(f"{folder} holds a transformer only: pass --base, the SD3 folder with its VAE and text "
                        "encoders")
    return {"kind": "weights", "stage": "diffusers", "preset": preset, "prediction": "v", "step": 0,
            "transformer": config.to_dict(),
            "components": {"kind": "sd3", "path": os.path.abspath(components_path), "t5_max_length": 77},
            "sampling": {"steps": 28, "cfg": 7.0, "shift": pipeline_shift(pipeline)},
            "manifest": os.path.abspath(transformer_dir), "weight_files": diffusers_weight_files(transformer_dir),
            "components_file": None}


def load_components(record, device="cpu", dtype=None):
    """The components a weights record names, checked against its transformer's widths, with their trained parts
    (the built-in text encoder) read back."""
    try:
        components = build_components(record["components"], device, dtype)
    except ComponentsError as e:
        raise UserError(f"{e} (the components of {record['manifest']})") from None
    config = SD3LightConfig.from_dict(record["transformer"])
    check_widths(components, config, record["manifest"])
    record.setdefault("resolution", config.sample_size * components.downscale)  # a diffusers folder's: its VAE's
    if record["components_file"]:
        try:
            components.load_trained_state_dict(load_safetensors(record["components_file"]))
        except (ValueError, RuntimeError) as e:
            raise UserError(f"{record['manifest']}: {str(e).splitlines()[0][:400]}") from None
    return components


def load_transformer(record, dtype=torch.float32, device="cpu", meta=False, after_block=None, frozen=False,
                     host_blocks=0):
    """The transformer of a weights record, built on the meta device and filled tensor by tensor from its files
    in `dtype` on `device` (model/loading.py: no random initialisation, no second copy). Strict: every key fits.
    `meta`: leave it on the meta device (a sharded run's other ranks: rank 0's weights fill their shards).
    `after_block`: see loading.fill (int8: quantise block by block). `frozen`: no parameter requires grad.
    `host_blocks`: the first blocks held in host memory (block swap, loading.fill)."""
    model = meta_model(SD3LightConfig.from_dict(record["transformer"])).requires_grad_(not frozen)
    if meta:
        return model
    try:
        with SingleFileTensors(record["weight_files"][0], list(model.state_dict())) if record.get(
                "layout") == "single_file" else TensorFiles(record["weight_files"]) as files:
            return fill(model, files, dtype, device, after_block, host_blocks)
    except (OSError, ValueError, StateDictMismatchError) as e:
        raise UserError(f"{record['manifest']}: {str(e).splitlines()[0][:400]}") from None


def load_weights(name_or_path, out_dir=DEFAULT_OUT_DIR, device="cpu", base=None, dtype=torch.float32,
                 components_dtype=None):
    """-> (SD3Light in `dtype`, components, record): weights_source, then the components (a wrong --base is one
    line before gigabytes of weights are read), then the transformer."""
    record = weights_source(name_or_path, out_dir, base)
    components = load_components(record, device, components_dtype)
    return load_transformer(record, dtype, device).eval(), components, record


def weights_identity(record, out_dir):
    """Which weights a run started from, to check later: the manifest (relative to out_dir when inside it), the
    step and the transformer file's sha256."""
    manifest = os.path.abspath(record["manifest"])
    if os.path.dirname(manifest) == os.path.abspath(out_dir):
        manifest = os.path.basename(manifest)
    if record["stage"] == "diffusers" or record.get("layout"):  # hashed only when asked (16 GB for SD3.5-large)
        return {"weights": manifest, "step": record["step"],
                "sha256": json_digest([sha256_of(path) for path in record["weight_files"]])}
    transformer_file = os.path.basename(checkpoint_file(stem_of(record["manifest"]), record, ".safetensors"))
    return {"weights": manifest, "step": record["step"], "sha256": record["files"][transformer_file]["sha256"]}


def sampling_name(record, lora_record=None):
    """What eval output is called: the weights' run name, or the LoRA's when one is applied."""
    if lora_record and "args" in lora_record:
        return lora_run_name(lora_record["args"]["lora_name"], record["preset"])
    return run_name(record["stage"], record["preset"])
