"""The start of every stage, in one call and in phases, so that no two large things are in memory at once:

    1. what the start weights are (their manifest or config: nothing read yet), and the frozen components;
    2. the data, the sample prompts, the check that every image fits the model (on a model with no memory,
       built on the meta device) and that a pipeline export is possible;
    3. the feature cache, encoded before the transformer is in memory; once training reads it, the text encoders
       are freed (the grids' prompts are encoded first);
    4. the estimate of the run's peak memory (model/memory.py), one line, a warning where it exceeds the device;
    5. the transformer's weights, network by network, each filled from the files in its dtype on the device
       (model/loading.py): what trains in fp32, what is frozen in --frozen_dtype (int8: block by block), or
       drawn afresh. In a sharded run the other ranks keep theirs on the meta device: rank 0's weights fill
       their shards (trainer/parallel.py).

A stage names its networks and what each does: "trained" (every weight), "frozen", or "adapted" (frozen, with
the stage's `adapt(model)` putting trainable adapters on it, e.g. LoRA):

    start = start_up(args, info, run, {"teacher": "frozen", "generator": "trained", "fake_score": "trained"})
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dataset.training_data import (
    check_image_sizes, epoch_samples, features_to_train_on, make_components, sample_prompts_for, split_validation,
    training_dataset, validation_data,
)
from eval.eval_loss import encode_heldout
from model.components import transformer_widths
from model.errors import UserError
from model.loading import meta_model
from model.memory import (
    activation_bytes, describe, device_memory, estimate, module_bytes, peak_rss,
)
from model.model_sd3light import SD3LightConfig, preset_config
from model.precision import int8_weights, torch_dtype
from model.weights import (
    check_pipeline_export, check_single_file_export, load_components, load_transformer, start_weights_source,
)

ROLES = ("trained", "frozen", "adapted")


@dataclass
class Start:
    nets: dict  # name -> SD3Light on the device (or the meta device, on a sharded run's other ranks)
    components: object
    dataset: object  # what the steps read (the cache when it is on); None after --cache_only
    prompts: list
    record: dict  # the start weights' record; None for a fresh model
    config: SD3LightConfig
    validation: list = None  # the validation images' encoded batches (eval/eval_loss.py), or None


def default_data(args, components, config, log, extra=None):
    """--data as an epoch shows it (with `extra(args, components, config, log)`'s parts beside it, e.g. LoRA's
    prior data), the grids' prompts (a file's, the built-in data's own, or captions of the user's data) and the
    validation images (--val_data, or --val_fraction of --data held out)."""
    dataset, held_out = split_validation(args, training_dataset(args, components, config.patch_size, log))
    prompts = sample_prompts_for(dataset, args.sample_prompts)
    parts = [dataset] + (extra(args, components, config, log) if extra else [])
    return epoch_samples(args, parts, log), prompts, validation_data(args, held_out, log)


def start_up(args, info, run, roles, data=default_data, adapt=None, fresh=None, record=None):
    """The networks `roles` names ({name: "trained" | "frozen" | "adapted"}), from --from_weight (or new ones,
    `fresh(config)`, of --preset's size on the components' widths, every rank drawing the same), with the
    components, the data (`data(args, components, config, log)` -> (dataset, prompts, validation images or
    None)) and the cache, in the phases above. `record`: the start weights' record, if the stage has read it
    (start_weights_source) for its recipe. Sets args.prediction to what the start weights predict. -> Start."""
    bad = [role for role in roles.values() if role not in ROLES]
    if bad or ("adapted" in roles.values() and adapt is None):
        raise ValueError(f"roles must be {ROLES} (and 'adapted' needs adapt): got {roles}")
    if args.frozen_dtype == "int8" and info.sharded:
        raise UserError("--frozen_dtype int8 with --fsdp 1 is not supported: shard a bf16 base (--frozen_dtype bf16), "
                        "or train the int8 base without --fsdp (DDP)")
    frozen = torch_dtype(args.frozen_dtype)
    if fresh is not None:
        record, components = None, make_components(args, info, frozen).to(info.device)
        config = preset_config(args.preset, **transformer_widths(components))
    else:
        record = record or start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir,
                                                args.base)
        args.prediction = record["prediction"]
        components, config = load_components(record, info.device, frozen), SD3LightConfig.from_dict(
            record["transformer"])
    dataset, prompts, held_out = data(args, components, config, run.log)
    check_image_sizes(args.resolution, dataset, meta_model(config), components)
    if getattr(args, "export_pipeline", False):
        check_pipeline_export(components, args.prediction)
    if getattr(args, "export_single_file", False):
        check_single_file_export(args.prediction)
    validation = None  # encoded while the text encoders are in memory, on the ranks that validate (TrainingRun)
    if held_out is not None and (info.is_main or info.sharded):
        validation = encode_heldout(components, held_out, args.val_samples, args.batch_size, info.device)
    dataset = features_to_train_on(args, dataset, components, prompts, info, run.log)
    start = Start({}, components, dataset, prompts, record, config, validation)
    if dataset is None:  # --cache_only: the cache is built, no weights are needed
        return start
    log_estimate(args, info, config, roles, adapt, components, run.log)
    for name, role in roles.items():
        start.nets[name] = network(args, info, record, config, role, adapt, fresh)
    log_peak(info, "the weights loaded", run.log)
    return start


def network(args, info, record, config, role, adapt, fresh):
    """One network: trained ones in fp32, frozen ones (and an adapted one's base) in --frozen_dtype."""
    meta = info.sharded and not info.is_main  # rank 0's weights fill the shards (trainer/parallel.py)
    if record is None:  # a fresh model: rank 0 draws it (the stage seeded torch), the others hold nothing
        model = meta_model(config) if meta else fresh(config).to(info.device)
    else:
        frozen = role != "trained"
        int8 = frozen and args.frozen_dtype == "int8"
        dtype = torch_dtype(args.frozen_dtype) if frozen else torch.float32
        model = load_transformer(record, dtype, info.device, meta=meta,
                                 after_block=int8_weights if int8 else None, frozen=frozen)
    if role == "adapted":
        adapt(model)
    model.gradient_checkpointing = bool(args.gradient_checkpointing)
    return model.train()


def log_estimate(args, info, config, roles, adapt, components, log):
    """Phase 4: the estimate of one process's peak (model/memory.py) in one line, and a warning where it exceeds
    the device's memory; the run starts either way."""
    trainable = 0
    if "adapted" in roles.values():  # the adapters' size, from a model with no memory
        probe = meta_model(config).requires_grad_(False)
        adapt(probe)
        trainable = sum(p.numel() for p in probe.parameters() if p.requires_grad)
    text = 77 + components.t5_max_length if components.spec["kind"] == "sd3" else components.spec["text_max_length"]
    activations = activation_bytes(config, args.batch_size, args.resolution, components.downscale, text,
                                   args.gradient_checkpointing, 2 if args.dtype == "bf16" else 4)
    shards = (args.fsdp_shard_size or info.world_size) if info.sharded else 1
    ema_on_device = info.device.type == "cpu" or getattr(args, "ema_device", "auto") != "cpu"
    parts = estimate(config, roles, trainable, getattr(args, "optimizer", "adamw"), getattr(args, "ema_decay", 0) > 0,
                     ema_on_device, args.frozen_dtype, shards, activations, module_bytes(components), info.device.type)
    line, warning = describe(parts, device_memory(info.device),
                             "this GPU" if info.device.type == "cuda" else "this machine's RAM")
    log(line)
    if warning:
        log(warning)


def log_peak(info, what, log):
    """Each process's peak memory so far (GPU: allocated by torch; CPU: resident), measured, beside the estimate."""
    peak = torch.cuda.max_memory_allocated(info.device) if info.device.type == "cuda" else peak_rss()
    peaks = [peak]
    if info.world_size > 1:
        peaks = [None] * info.world_size
        dist.all_gather_object(peaks, peak)
    log(f"peak memory after {what}: " + ", ".join(f"{p / 2 ** 30:.2f}" for p in peaks) + " GiB (by rank)")
