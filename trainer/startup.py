"""The pieces of a stage's start, each a plain call in the stage's set-up, in the order that keeps one large thing in
memory at a time: the components, the data and its cache (the text encoders then freed), the estimate
(model/memory.py), then the weights:

    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    components = load_components(source, info.device, torch_dtype(precision.frozen))
    data = stage_data(settings, components, config, info, args.batch_size, metrics.log)
    ...
    model = load_network(source, "trained", precision.frozen, info)   # or "frozen": a LoRA base, a teacher
    log_peak(info, "the weights loaded", metrics.log)

start_weights_source reads the record of the weights a stage starts from (nothing of them loaded yet);
stage_data builds what the steps read (dataset/training_data.py's pieces) and the validation images;
load_network fills a network from the files in its dtype on the device (model/loading.py): what trains in fp32,
what is frozen in --frozen_dtype (int8: block by block). In a sharded run rank 0 loads on the CPU and the other
ranks keep theirs on the meta device: rank 0's weights fill every rank's shards (trainer/parallel.py).
"""
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dataset.training_data import (
    check_image_sizes, epoch_samples, features_to_train_on, sample_prompts_for, split_validation, training_dataset,
    validation_data,
)
from eval.eval_loss import encode_heldout
from model.diffusers_io import DIFFUSERS_WEIGHTS, diffusers_transformer_dir
from model.errors import UserError
from model.loading import meta_model
from model.memory import peak_rss
from model.model_lora import apply_lora, is_lora_file
from model.precision import int8_weights, torch_dtype
from model.weights import WEIGHT_STAGES, diffusers_source, load_transformer, run_name, weights_source


@dataclass(frozen=True)
class StageData:
    """What a stage's steps read (the cache when it is on; None after --cache_only), the grids' prompts, and the
    validation images: held out (a dataset, or None), and encoded on the ranks that score them (`validation`:
    eval/eval_loss.encode_heldout's batches, else None)."""
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
    """`data` (StageData) made ready for the steps: every image size checked against the model (one with no
    memory, on the meta device), the validation images encoded in batches of `batch_size` while the text encoders
    are in memory, on the ranks that score them, and the cache built (the text encoders then freed)."""
    check_image_sizes(settings.resolution, data.dataset, meta_model(config), components)
    validation = None
    if data.held_out is not None and (info.is_main or info.sharded):
        validation = encode_heldout(components, data.held_out, settings.val_samples, batch_size, info.device)
    dataset = features_to_train_on(settings, data.dataset, components, data.prompts, info, log)
    return replace(data, dataset=dataset, validation=validation)


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
        source = diffusers_source(base, base)
    else:
        name = run_name(from_weight, preset) if from_weight in WEIGHT_STAGES else from_weight
        source = weights_source(name, out_dir, base=base)
    where = source["manifest"]
    if source["preset"] != preset:
        raise UserError(f"--from_weight {where} holds '{source['preset']}' weights, not --preset {preset}: "
                        f"pass --preset {source['preset']} or weights of preset {preset}")
    if prediction not in (None, source["prediction"]):
        raise UserError(f"--from_weight {where} predicts {source['prediction']}, not --prediction {prediction}: "
                        "a fine-tune keeps its weights' prediction (leave --prediction unset)")
    return source


def load_network(source, role, frozen_dtype, info, trained_dtype="fp32"):
    """The transformer of `source` (start_weights_source's) as `role` says: "trained" in `trained_dtype` (fp32, or
    bf16 for --trained_dtype bf16), "frozen" in `frozen_dtype` (int8: quantised block by block as it loads) with
    no weight requiring grad, on info's device; in a sharded run on rank 0's CPU and the other ranks' meta device,
    for rank 0's weights to fill the shards."""
    frozen = role == "frozen"
    int8 = frozen and frozen_dtype == "int8"
    return load_transformer(source, torch_dtype(frozen_dtype if frozen else trained_dtype), info.load_device,
                            meta=info.sharded and not info.is_main, after_block=int8_weights if int8 else None,
                            frozen=frozen)


def adapter_count(config, targets, rank, alpha):
    """The trainable parameters LoRA adapters of `rank` (and `alpha`) on `targets` put on a transformer of
    `config`, counted on one with no memory (the meta device): a bad target is one line before any weight is
    read."""
    probe = meta_model(config).requires_grad_(False)
    try:
        apply_lora(probe, targets, rank, alpha)
    except ValueError as e:
        raise UserError(f"--lora_targets {targets}: {e}") from None
    return sum(p.numel() for p in probe.parameters() if p.requires_grad)


def log_peak(info, what, log):
    """Each process's peak memory so far, measured, beside the estimate: on a GPU what torch allocated and what its
    allocator reserved (what the GPU lost to the run: allocated plus what it keeps cached); on a CPU resident."""
    if info.device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(info.device), torch.cuda.max_memory_reserved(info.device))
    else:
        peak = (peak_rss(),)
    peaks = [peak]
    if info.world_size > 1:
        peaks = [None] * info.world_size
        dist.all_gather_object(peaks, peak)
    shown = ", ".join(" / ".join(f"{p / 2 ** 30:.2f}" for p in each) for each in peaks)
    how = " (allocated / reserved)" if info.device.type == "cuda" else ""
    log(f"peak memory after {what}: {shown} GiB{how} (by rank)")
