"""The networks a stage trains and holds, built from the weights it starts from: their source (start_weights_source),
each network loaded as its role says (load_network: trained in fp32 or --trained_dtype, frozen in --frozen_dtype),
a frozen base with adapters on it (adapted_frozen; adapter_count counts them before any weight is read), and LoRA
on the text encoders that train beside it (text_adapters, text_optimizer, text_modules).
"""
import torch

from model.block_swap import BlockSwap
from model.diffusers_io import DIFFUSERS_WEIGHTS, diffusers_transformer_dir
from model.errors import UserError
from model.model_lora import TEXT_PREFIXES, TEXT_TARGETS, Adapter, apply_lora, is_lora_file, lora_layers, \
    lora_parameters
from model.model_sd3light import meta_model
from model.precision import int8_weights, torch_dtype
from model.weights import WEIGHT_STAGES, diffusers_source, load_transformer, run_name, weights_source
from trainer.mechanics.optimizers import adamw


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


def load_network(source, role, frozen_dtype, info, trained_dtype="fp32", swapped=0):
    """The transformer of `source` (start_weights_source's) as `role` says: "trained" in `trained_dtype` (fp32, or
    bf16 for --trained_dtype bf16), "frozen" in `frozen_dtype` (int8: quantised block by block as it loads) with
    no weight requiring grad, on info's device, its first `swapped` blocks in host memory (block swap); in a sharded
    run on rank 0's CPU and the other ranks' meta device, for rank 0's weights to fill the shards."""
    frozen = role == "frozen"
    int8 = frozen and frozen_dtype == "int8"
    return load_transformer(source, torch_dtype(frozen_dtype if frozen else trained_dtype), info.load_device,
                            meta=info.sharded and not info.is_main, after_block=int8_weights if int8 else None,
                            frozen=frozen, host_blocks=swapped)


def adapted_frozen(source, frozen_dtype, info, swapped, adapters, log):
    """The frozen transformer of `source` (load_network's) with `adapters` (targets, rank, alpha, dropout, and
    optionally the kind: model_lora.Adapter, LoRA by default) on it; its first `swapped` blocks' weights in host
    memory, streamed to the device one block ahead of their use (model/block_swap.py), the adapters of those blocks
    drawn on the device all the same. `log`: where block swap's warning goes."""
    model = load_network(source, "frozen", frozen_dtype, info, swapped=swapped)
    targets, rank, alpha, dropout, *kind = adapters
    apply_lora(model, targets, rank, alpha, dropout, info.device if swapped else None, *kind)
    if swapped:
        model.block_swap = BlockSwap(model.transformer_blocks, swapped, info.device, log=log)
    return model


def text_adapters(components, names, rank, alpha, log):
    """LoRA of `rank` and `alpha` on the attention and MLP of the text encoders `names` (--train_text_encoders),
    which from now on encode at each step (components.train_text_encoders) -> {their file prefix
    (model_lora.TEXT_PREFIXES): encoder}, empty for none. No dropout: the encoders stay in eval mode, sampling
    included. `log`: where the line that says so goes."""
    components.train_text_encoders(names)
    models = components.text_models()
    for name in names:
        apply_lora(models[name], TEXT_TARGETS[name], rank, alpha)
        log(f"LoRA rank {rank} on {len(lora_layers(models[name]))} layers of the text encoder {name}")
    return {TEXT_PREFIXES[name]: models[name] for name in names}


def text_optimizer(text, lr, rates, weight_decay):
    """AdamW on the text encoders' adapters (`text`: text_adapters'), a parameter group each at its rate (`rates`:
    one, one per encoder, or None: `lr`), kept as a ratio to `lr` that set_lr scales -> the optimizer, or None
    without any."""
    if not text:
        return None
    rates = rates or (lr,)
    rates = rates * len(text) if len(rates) == 1 else rates
    optimizer = adamw([{"params": lora_parameters(encoder)} for encoder in text.values()], lr, weight_decay)
    optimizer.lr_ratios = [rate / lr for rate in rates]  # set_lr's (an attribute: a resume does not restore it)
    return optimizer


def text_modules(text):
    """The text encoders that train (`text`: text_adapters') as one module, whose parameter names key their
    optimizer's state in the resume checkpoint (NamedOptimizerState)."""
    return torch.nn.ModuleDict({prefix.rstrip("."): encoder for prefix, encoder in text.items()})


def adapter_count(config, targets, rank, alpha, adapter=Adapter()):
    """The trainable parameters adapters (`adapter`: LoRA by default) of `rank` (and `alpha`) on `targets` put on
    a transformer of `config`, counted on one with no memory (the meta device): a bad target is one line before
    any weight is read."""
    probe = meta_model(config).requires_grad_(False)
    try:
        apply_lora(probe, targets, rank, alpha, 0.0, None, adapter)
    except ValueError as e:
        raise UserError(f"--lora_targets {targets}: {e}") from None
    return sum(p.numel() for p in probe.parameters() if p.requires_grad)
