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

    info, metrics, checkpointer, precision = open_run(args, "distill", name, frozen_transformer=True)
    start = start_up(args, info, precision, metrics.log, {"teacher": "frozen", "generator": "trained",
                                                          "fake_score": "trained"})

open_run comes first: the processes, the run's log, which resume checkpoint continues it, and its precision.
start_weights_source reads the record of the weights a stage starts from (nothing of them loaded yet).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dataset.shapes import GRAMMAR_WORDS
from dataset.training_data import (
    DataSettings, check_image_sizes, epoch_samples, features_to_train_on, sample_prompts_for, split_validation,
    training_dataset, validation_data,
)
from eval.eval_loss import encode_heldout
from model.components import new_components, transformer_widths
from model.diffusers_io import DIFFUSERS_WEIGHTS, diffusers_transformer_dir
from model.errors import UserError
from model.loading import meta_model
from model.memory import (
    activation_bytes, describe, device_memory, estimate, module_bytes, peak_rss,
)
from model.model_lora import is_lora_file
from model.model_sd3light import SD3LightConfig, preset_config
from model.precision import int8_weights, run_precision, torch_dtype
from model.weights import (
    WEIGHT_STAGES, check_pipeline_export, check_single_file_export, diffusers_source, load_components,
    load_transformer, run_name, weights_source,
)
from trainer.checkpointer import Checkpointer
from trainer.distributed import init_distributed
from trainer.metrics import MetricsLog

ROLES = ("trained", "frozen", "adapted")


@dataclass
class Start:
    nets: dict  # name -> SD3Light on the device (or the meta device, on a sharded run's other ranks)
    components: object
    dataset: object  # what the steps read (the cache when it is on); None after --cache_only
    prompts: list
    record: dict  # the start weights' record; None for a fresh model
    config: SD3LightConfig
    prediction: str  # what the transformer predicts: the start weights', or a fresh model's
    validation: list = None  # the validation images' encoded batches (eval/eval_loss.py), or None


def open_run(args, stage, name, cpu_bf16=True, frozen_transformer=False):
    """The processes (trainer/distributed.py), the run's log and metrics (trainer/metrics.py), its checkpointer
    (which resume checkpoint continues it, if any) and its precision, decided once (model/precision.py
    run_precision: `cpu_bf16`, `frozen_transformer`). -> (info, metrics, checkpointer, precision)."""
    info = init_distributed(args.fsdp, args.fsdp_shard_size)
    metrics = MetricsLog(args, info, stage, name)
    checkpointer = Checkpointer(args, info, stage, name, metrics)
    precision = run_precision(args.dtype, args.frozen_dtype, info.device, stage, metrics.log, info.world_size > 1,
                              cpu_bf16, frozen_transformer, bool(args.base), checkpointer.resumed_dtype)
    return info, metrics, checkpointer, precision


def default_data(settings, components, config, log, extra=None):
    """--data as an epoch shows it (with `extra(settings, components, config, log)`'s parts beside it, e.g. LoRA's
    prior data), the grids' prompts (a file's, the built-in data's own, or captions of the user's data) and the
    validation images (--val_data, or --val_fraction of --data held out). `settings`: DataSettings."""
    dataset, held_out = split_validation(settings, training_dataset(settings, components, config.patch_size, log))
    prompts = sample_prompts_for(dataset, settings.sample_prompts)
    parts = [dataset] + (extra(settings, components, config, log) if extra else [])
    return epoch_samples(settings, parts, log), prompts, validation_data(settings, held_out, log)


def start_up(args, info, precision, log, roles, data=default_data, adapt=None, fresh=None, record=None,
             prediction=None):
    """The networks `roles` names ({name: "trained" | "frozen" | "adapted"}), from --from_weight (or new ones,
    `fresh(config)` predicting `prediction`, of --preset's size on the components' widths, every rank drawing the
    same), with the components, the data (`data(settings, components, config, log)`, `settings` the run's
    DataSettings -> (dataset, prompts, validation images or None)) and the cache, in the phases above, held as `precision` (model/precision.Precision) says.
    `record`: the start weights' record, if the stage has read it (start_weights_source) for its recipe. -> Start
    (its prediction: the start weights')."""
    bad = [role for role in roles.values() if role not in ROLES]
    if bad or ("adapted" in roles.values() and adapt is None):
        raise ValueError(f"roles must be {ROLES} (and 'adapted' needs adapt): got {roles}")
    if precision.frozen == "int8" and info.sharded:
        raise UserError("--frozen_dtype int8 with --fsdp 1 is not supported: shard a bf16 base (--frozen_dtype bf16), "
                        "or train the int8 base without --fsdp (DDP)")
    frozen = torch_dtype(precision.frozen)
    if fresh is not None:
        record = None
        components = new_components(args.base, args.t5_max_length, GRAMMAR_WORDS, info.device, frozen).to(info.device)
        config = preset_config(args.preset, **transformer_widths(components))
    else:
        record = record or start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir,
                                                args.base)
        prediction = record["prediction"]
        components, config = load_components(record, info.device, frozen), SD3LightConfig.from_dict(
            record["transformer"])
    settings = DataSettings.of(args)
    dataset, prompts, held_out = data(settings, components, config, log)
    check_image_sizes(args.resolution, dataset, meta_model(config), components)
    if getattr(args, "export_pipeline", False):
        check_pipeline_export(components, prediction)
    if getattr(args, "export_single_file", False):
        check_single_file_export(prediction)
    validation = None  # encoded while the text encoders are in memory, on the ranks that validate (previews.py)
    if held_out is not None and (info.is_main or info.sharded):
        validation = encode_heldout(components, held_out, args.val_samples, args.batch_size, info.device)
    dataset = features_to_train_on(settings, dataset, components, prompts, info, log)
    start = Start({}, components, dataset, prompts, record, config, prediction, validation)
    if dataset is None:  # --cache_only: the cache is built, no weights are needed
        return start
    log_estimate(args, info, precision, config, roles, adapt, components, log)
    for name, role in roles.items():
        start.nets[name] = network(args, info, precision.frozen, record, config, role, adapt, fresh)
    log_peak(info, "the weights loaded", log)
    return start


def start_weights_source(from_weight, preset, prediction, out_dir, base=None):
    """The weights a fine-tune starts from (weights_source): `from_weight` is a stage name in out_dir ('pretrain'
    means pretrain_<preset>), a path, or 'base' (the transformer of the SD3 folder `base`). They must be of
    `preset`, and predict `prediction` if it is given (None: whatever they predict)."""
    if is_lora_file(from_weight):
        raise UserError(f"--from_weight {from_weight} is a LoRA file (adapters, not whole weights): pass the weights "
                        "it was trained on, and apply it when sampling (eval/eval_sample.py --lora)")
    if from_weight == "base":
        if not base:
            raise UserError("--from_weight base needs --base, the diffusers SD3 folder whose transformer to start from")
        if not diffusers_transformer_dir(base):
            raise UserError(f"{base} holds no diffusers transformer (transformer/config.json and "
                            f"{DIFFUSERS_WEIGHTS} or its shards)")
        record = diffusers_source(base, base)
    else:
        source = run_name(from_weight, preset) if from_weight in WEIGHT_STAGES else from_weight
        record = weights_source(source, out_dir, base=base)
    where = record["manifest"]
    if record["preset"] != preset:
        raise UserError(f"--from_weight {where} holds '{record['preset']}' weights, not --preset {preset}: "
                        f"pass --preset {record['preset']} or weights of preset {preset}")
    if prediction not in (None, record["prediction"]):
        raise UserError(f"--from_weight {where} predicts {record['prediction']}, not --prediction {prediction}: "
                        "a fine-tune keeps its weights' prediction (leave --prediction unset)")
    return record


def network(args, info, frozen_dtype, record, config, role, adapt, fresh):
    """One network: trained ones in fp32, frozen ones (and an adapted one's base) in `frozen_dtype`."""
    meta = info.sharded and not info.is_main  # rank 0's weights fill the shards (trainer/parallel.py)
    if record is None:  # a fresh model: rank 0 draws it (the stage seeded torch), the others hold nothing
        model = meta_model(config) if meta else fresh(config).to(info.device)
    else:
        frozen = role != "trained"
        int8 = frozen and frozen_dtype == "int8"
        dtype = torch_dtype(frozen_dtype) if frozen else torch.float32
        model = load_transformer(record, dtype, info.device, meta=meta,
                                 after_block=int8_weights if int8 else None, frozen=frozen)
    if role == "adapted":
        adapt(model)
    model.gradient_checkpointing = bool(args.gradient_checkpointing)
    return model.train()


def log_estimate(args, info, precision, config, roles, adapt, components, log):
    """Phase 4: the estimate of one process's peak (model/memory.py) in one line, and a warning where it exceeds
    the device's memory; the run starts either way."""
    trainable = 0
    if "adapted" in roles.values():  # the adapters' size, from a model with no memory
        probe = meta_model(config).requires_grad_(False)
        adapt(probe)
        trainable = sum(p.numel() for p in probe.parameters() if p.requires_grad)
    text = 77 + components.t5_max_length if components.spec["kind"] == "sd3" else components.spec["text_max_length"]
    activations = activation_bytes(config, args.batch_size, args.resolution, components.downscale, text,
                                   args.gradient_checkpointing, 2 if precision.compute == "bf16" else 4)
    shards = (args.fsdp_shard_size or info.world_size) if info.sharded else 1
    ema_on_device = info.device.type == "cpu" or getattr(args, "ema_device", "auto") != "cpu"
    parts = estimate(config, roles, trainable, getattr(args, "optimizer", "adamw"), getattr(args, "ema_decay", 0) > 0,
                     ema_on_device, precision.frozen, shards, activations, module_bytes(components), info.device.type)
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
