"""Hand-written LoRA for SD3-Light: low-rank adapters on chosen nn.Linear layers, in diffusers' file format.

    W x  ->  W x + (alpha / rank) * B (A x),   A: [rank, in] random, B: [out, rank] zeros (so training starts at W)

`apply_lora(model, targets, rank, alpha)` swaps each targeted nn.Linear for a LoRALinear *in place of* it: the
base weight and bias keep their names (`...attn.to_q.weight`), and the adapter adds `...attn.to_q.lora_A.weight`
and `.lora_B.weight`. Those are exactly the names of diffusers' LoRA interchange format once prefixed with
`transformer.`, so a saved adapter loads with `StableDiffusion3Pipeline.load_lora_weights` and ComfyUI-style
tools (../shared/REFERENCE.md section 4). The file records alpha, so the scale is exact everywhere.

`apply_lora(..., adapter=Adapter("dora"))` puts DoRA layers on instead (DoRALinear: a LoRA plus a trained
magnitude per input column, `.dora_scale`), `Adapter("lokr", factor)` LoKr layers (model/lokr.py: `.lokr_w1`,
`.lokr_w2` or its low-rank pair, `.alpha`): the keys ComfyUI reads for each. The functions below take any of them.
"""
import json
import math
import os
import re

from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors import safe_open

from model.adapter_merge import DeltaMerge
from model.checkpoint import remove_leftovers
from model.file_io import write_safetensors
from model.lokr import LoKrLinear


# Module-name suffixes, matched against the last parts of each nn.Linear's path in the model.
TARGET_GROUPS = {
    # all attention projections of both streams (image: to_*, text: add_*_proj / to_add_out); attn2 in SD3.5 too
    "attention": ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
    "ff": ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
    "adaln": ("norm1.linear", "norm1_context.linear"),
}
# each text encoder's attention and MLP projections: the layers ComfyUI maps for CLIP-L and CLIP-G (and the
# built-in encoder, shaped as CLIP), and kohya's for T5 (q, k, v, o; wi, or wi_0 and wi_1 where it is gated; wo)
CLIP_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
TEXT_TARGETS = {"text": CLIP_TARGETS, "clip_l": CLIP_TARGETS, "clip_g": CLIP_TARGETS,
                "t5": ("SelfAttention.q", "SelfAttention.k", "SelfAttention.v", "SelfAttention.o", "DenseReluDense.wi",
                       "DenseReluDense.wi_0", "DenseReluDense.wi_1", "DenseReluDense.wo")}
DEFAULT_TARGETS = ("attention",)
ADAPTER_KINDS = {"lora": "LoRA", "lokr": "LoKr", "dora": "DoRA"}  # the kinds, and their names in a log line
ADAPTER_SUFFIXES = (".dora_scale", ".lokr_w1", ".lokr_w2", ".lokr_w2_a", ".lokr_w2_b", ".alpha")
KIND_KEY = "minisd3_adapter"  # our metadata: the adapter's kind (and LoKr's factor), where it is not a plain LoRA
FILE_PREFIX = "transformer."  # diffusers' key prefix for the transformer's adapters
# the text encoders' prefixes, diffusers' for SD3's CLIP-L and CLIP-G (ComfyUI maps them too); the built-in encoder
# of the tiny model, its only one, is the first. T5's is ours inside a run (the resume file, the EMA, the metadata)
TEXT_PREFIXES = {"text": "text_encoder.", "clip_l": "text_encoder.", "clip_g": "text_encoder_2.",
                 "t5": "text_encoder_3."}
# in the file T5's adapters take kohya's names, the ones ComfyUI maps for SD3's T5 (diffusers loads no T5 LoRA):
# lora_te3_<module path, dots as underscores>.lora_down.weight (A), .lora_up.weight (B) and .alpha
KOHYA_PREFIXES = {"text_encoder_3.": "lora_te3_"}
KOHYA_NAMES = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}
METADATA_KEY = "lora_adapter_metadata"  # where diffusers reads rank, alpha and targets from


class LoRAMatmul(torch.autograd.Function):
    """x W^T + b + scale (x A^T) B^T in the compute dtype, its gradients written by hand, for a frozen W and b: the
    base and the update end in one addmm, backward saves x and the small x A^T, the adapters come cast and
    transposed, W and b as held (`frozen`: W, b, A^T, B^T, scale; W cast to A^T's dtype where it is another).
    Autograd through three nn.Linear calls dispatched about 60 operations a layer a step, each a launch the GPU
    waits on at batch 1; this dispatches about a third of them.
    `base`: the frozen layer's output, computed outside (W of a type mm does not take, e.g. int8), or None."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, frozen, base):
        weight, bias, (a_t, b_t, a, b), scale = frozen
        x2 = x.reshape(-1, x.shape[-1]).to(a_t.dtype)
        h = torch.mm(x2, a_t)  # [tokens, rank]
        if base is None:
            w = weight.to(a_t.dtype)
            base = torch.addmm(bias.to(a_t.dtype), x2, w.t()) if bias is not None else torch.mm(x2, w.t())
        else:
            base = base.reshape(h.shape[0], -1)
        out = torch.addmm(base, h, b_t, alpha=scale)
        ctx.save_for_backward(x2, h)  # the activations: what checkpointing frees and recomputes
        # the weights, on ctx as they are held (a cast is made again in backward): a parameter, not a copy of it,
        # so a block swapped to host memory (model/block_swap.py) keeps nothing of its weights on the device; the
        # adapters cast, and untransposed (no transpose to dispatch in backward)
        ctx.frozen, ctx.scale = (weight, a, b), scale
        ctx.x_meta, ctx.dtypes = (x.shape, x.dtype), (lora_a.dtype, lora_b.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, h = ctx.saved_tensors
        weight, a, b = ctx.frozen
        weight = None if weight is None else weight.to(a.dtype)
        g = grad.reshape(-1, grad.shape[-1]).to(a.dtype)
        gh = torch.mm(g, b)  # [tokens, rank]: the gradient of x A^T, over the scale
        if ctx.scale != 1:  # (alpha = rank, the default: nothing to multiply)
            gh.mul_(ctx.scale)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(gh, a) if weight is None else torch.addmm(torch.mm(g, weight), gh, a)
            grad_x = grad_x.view(ctx.x_meta[0]).to(ctx.x_meta[1])
        grad_a = torch.mm(gh.t(), x2).to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
        grad_b = None
        if ctx.needs_input_grad[2]:
            grad_b = torch.mm(g.t(), h)
            if ctx.scale != 1:
                grad_b.mul_(ctx.scale)
            grad_b = grad_b.to(ctx.dtypes[1])
        return grad_x, grad_a, grad_b, None, grad if ctx.needs_input_grad[4] else None


class LoRALinear(DeltaMerge, nn.Linear):
    """An nn.Linear (same weight and bias parameters, so the same state-dict names) plus a low-rank update."""

    kind = "lora"

    def __init__(self, base, rank, alpha, dropout=0.0, device=None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate and initialise a weight we do not want
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the very same tensors: nothing copied
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        device = device or base.weight.device  # (a base swapped to host memory: its adapters drawn on the device)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as nn.Linear (and peft) initialise
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self._cast = None  # the adapters cast for the forward: adapters_in
        self.cast_once = True  # False (a CUDA graph's step): cast at each forward, which a replay then repeats
        self._cast_buffers = {}  # (dtype, device) -> the buffers a plain layer's adapters are cast into, made once
        self.casts = AdapterCasts([self])  # apply_lora makes one for all the model's layers
        # a fused optimizer steps them without touching their version counters: the cast is forgotten once
        # backward has their gradients, before any step
        self._hooked = (self.lora_A.weight, self.lora_B.weight)
        for weight in self._hooked:
            weight.register_post_accumulate_grad_hook(self.forget_cast)

    def adapter_tensors(self):
        """{the file key's suffix: parameter}, in the order the optimizer holds them."""
        return {"lora_A.weight": self.lora_A.weight, "lora_B.weight": self.lora_B.weight}

    def delta_weight(self):
        """scale * B @ A in fp32: the change this adapter makes to the base weight."""
        return self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def forward(self, x):
        if self.merged:
            return super().forward(x)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        casts = self.adapters_in(dtype)
        weight, bias = self.weight, self.bias
        plain = type(weight) in (torch.Tensor, nn.Parameter) and not (weight.requires_grad or
                                                                     bias is not None and bias.requires_grad)
        if plain and isinstance(self.dropout, nn.Identity):  # one matrix product for the base and the update
            return LoRAMatmul.apply(x, self.lora_A.weight, self.lora_B.weight, (weight, bias, casts, self.scale),
                                    None)
        base = super().forward(x)  # autograd's: a trained or quantised W, or dropout on the adapter's input only
        return LoRAMatmul.apply(self.dropout(x), self.lora_A.weight, self.lora_B.weight,
                                (None, None, casts, self.scale), base.to(dtype))

    def forget_cast(self, _=None):
        self._cast = None

    def adapters_in(self, dtype):
        """(A^T, B^T, A, B) in `dtype`, cast once for a forward and its recompute, not at every call: the cast is
        forgotten when backward has their gradients (forget_cast) or something writes them (a load: their version
        counters); then the casts of every layer that forgot its own are made again at once (AdapterCasts).
        Inside a compiled graph, cast there (the compiler fuses it); in a CUDA graph's step at each forward
        (`cast_once` False: a replay runs no hook that would forget a cast, so one kept would go stale)."""
        if torch.compiler.is_compiling() or not self.cast_once:
            a, b = self.lora_A.weight.to(dtype), self.lora_B.weight.to(dtype)
            return a.t(), b.t(), a, b
        if not self.cast_current(dtype):
            self.casts.refresh(dtype, self)
        return self._cast[1]

    def cast_current(self, dtype):
        """Whether the cast held is of the adapters as they are now, in `dtype`."""
        cached, a, b = self._cast, self.lora_A.weight, self.lora_B.weight
        return cached is not None and cached[0][0] is a and cached[0][1] is b and \
            cached[0][2:] == (a._version, b._version, dtype)

    def cast_key(self, dtype):
        a, b = self.lora_A.weight, self.lora_B.weight
        return a, b, a._version, b._version, dtype

    def cast_buffers(self, dtype):
        """(A^T, B^T, A, B): buffers of `dtype` made once, refreshed in place, and their transposed views."""
        key = (dtype, self.lora_A.weight.device)
        if key not in self._cast_buffers:
            a = torch.empty(self.lora_A.weight.shape, dtype=dtype, device=key[1])
            b = torch.empty(self.lora_B.weight.shape, dtype=dtype, device=key[1])
            self._cast_buffers[key] = (a.t(), b.t(), a, b)
        return self._cast_buffers[key]

    def extra_repr(self):
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


class DoRALinear(LoRALinear):
    """A LoRA whose merged weight is renormalised per input column (DoRA, weight-decomposed):

        W' = (W + s B A) * m / (||W + s B A|| + eps),   m = dora_scale [1, in], trained

    the norm over each input column and eps fp32's: what ComfyUI's `weight_decompose` computes from the file's
    `dora_scale` (../shared/REFERENCE.md section 18). A column's factor scales that input feature, so the
    forward is the LoRA forward of x * m / (||W + s B A|| + eps). The norm is detached in backward, as the DoRA
    paper and PEFT do (a constant of each step: no gradient through it, and no product of [out, in] kept for
    backward). m starts at ||W|| + eps, so training starts at W."""

    kind = "dora"

    def __init__(self, base, rank, alpha, dropout=0.0, device=None):
        if type(base.weight) not in (torch.Tensor, nn.Parameter):
            raise ValueError(f"DoRA renormalises the base weight's columns, which a {type(base.weight).__name__} "
                             "weight (int8) does not hold exactly: use --frozen_dtype bf16, or --adapter lora")
        super().__init__(base, rank, alpha, dropout, device)
        self.eps = torch.finfo(torch.float32).eps  # ComfyUI decomposes an fp32 copy of the weight: fp32's
        with torch.no_grad():
            norm = base.weight.float().norm(dim=0, keepdim=True) + self.eps
        self.dora_scale = nn.Parameter(norm.to(self.lora_A.weight.device))
        self.strength = 1.0  # set_lora_scale's multiplier: ComfyUI's strength, W + strength (W' - W)

    def adapter_tensors(self):
        return {**super().adapter_tensors(), "dora_scale": self.dora_scale}

    def column_scale(self):
        """m / (||W + s B A|| + eps): [1, in] in fp32, the norm a constant (no gradient through it)."""
        with torch.no_grad():
            norm = (self.weight.float() + self.delta_weight()).norm(dim=0, keepdim=True) + self.eps
        return self.dora_scale / norm

    def forward(self, x):
        if self.merged:
            return nn.Linear.forward(self, x)
        out = super().forward((x * self.column_scale()).to(x.dtype))  # one rounding: of the scaled input
        if self.strength != 1.0:  # 0: the base weights exactly
            base = nn.Linear.forward(self, x)
            out = base + self.strength * (out - base)
        return out

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            weight = self.weight.float()
            merged = (weight + self.delta_weight()) * self.column_scale()
            self.weight.copy_((weight + self.strength * (merged - weight)).to(self.weight.dtype))
            self.merged = True

    def unmerge(self):
        if self.merged:
            raise ValueError("a merged DoRA layer cannot be unmerged (its renormalisation is not undone): load the "
                             "base weights again")


class AdapterCasts:
    """The adapters of a model's LoRA layers, cast to the compute dtype for a forward all at once: where a layer's
    cast is out of date, every layer whose cast is out of date too (after a step: all of them) is copied into its
    buffers by two multi-tensor copies, instead of two casts and two transposes a layer (972 operations a step for
    the attention of SD3.5-Medium). A layer whose adapters are not its own plain parameters on this device (FSDP's)
    casts its own."""

    def __init__(self, layers):
        self.layers = layers

    @staticmethod
    def plain(layer, device):
        """Whether `layer`'s adapters are the parameters it was made with (whose hooks forget its cast after
        backward), plain tensors on `device`: FSDP puts parameters of its own in their place, which it fills without
        a version counter's change, so such a layer casts its own at each forward as before."""
        a, b = layer.lora_A.weight, layer.lora_B.weight
        return a is layer._hooked[0] and b is layer._hooked[1] and type(a) is nn.Parameter and \
            type(b) is nn.Parameter and a.device == b.device == device

    @torch.no_grad()
    def refresh(self, dtype, asking):
        """The casts in `dtype` of `asking` (a layer whose cast is out of date), and of every plain layer whose
        cast is out of date too."""
        device = asking.lora_A.weight.device
        if not self.plain(asking, device):
            a, b = asking.lora_A.weight.to(dtype), asking.lora_B.weight.to(dtype)
            asking._cast = (asking.cast_key(dtype), (a.t(), b.t(), a, b))
            return
        stale = [layer for layer in self.layers if self.plain(layer, device) and not layer.cast_current(dtype)]
        buffers = [layer.cast_buffers(dtype) for layer in stale]
        torch._foreach_copy_([casts[2] for casts in buffers], [layer.lora_A.weight for layer in stale])
        torch._foreach_copy_([casts[3] for casts in buffers], [layer.lora_B.weight for layer in stale])
        for layer, casts in zip(stale, buffers):
            layer._cast = (layer.cast_key(dtype), casts)


def resolve_targets(targets):
    """Group names ("attention", "ff", "adaln") and module-name suffixes -> a tuple of suffixes."""
    if isinstance(targets, str):
        targets = [t for t in re.split(r"[,\s]+", targets) if t]
    suffixes = []
    for target in targets:
        suffixes += TARGET_GROUPS.get(target, (target,))
    return tuple(dict.fromkeys(suffixes))


def _matches(name, suffixes):
    return any(name == s or name.endswith("." + s) for s in suffixes)


@dataclass(frozen=True)
class Adapter:
    """Which update the adapted layers train: "lora", "dora" (LoRA with a magnitude per input column) or "lokr"
    (a Kronecker product; `factor`: LyCORIS's split of each dimension, -1 = the most nearly square)."""
    kind: str = "lora"
    factor: int = -1


def adapted_layer(base, rank, alpha, dropout, device, adapter):
    """`base` (an nn.Linear) with an adapter of `adapter`'s kind on it."""
    if adapter.kind == "lokr":
        return LoKrLinear(base, rank, alpha, adapter.factor, dropout, device)
    return (DoRALinear if adapter.kind == "dora" else LoRALinear)(base, rank, alpha, dropout, device)


def apply_lora(model, targets=DEFAULT_TARGETS, rank=8, alpha=None, dropout=0.0, device=None, adapter=Adapter()):
    """Freeze `model` and put an adapter (`adapter`: LoRA by default) on every nn.Linear whose name ends with a
    target suffix, on `device` (None: where each layer's weight is). -> the adapted module names. alpha defaults to
    rank (scale 1)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {rank}")
    if adapter.kind not in ADAPTER_KINDS:
        raise ValueError(f"unknown adapter {adapter.kind!r}: use {', '.join(ADAPTER_KINDS)}")
    alpha = float(rank if alpha is None else alpha)
    suffixes = resolve_targets(targets)
    model.requires_grad_(False)
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and _matches(name, suffixes)]
    if not names:
        raise ValueError(f"no nn.Linear in the model matches the LoRA targets {', '.join(suffixes)}")
    casts = AdapterCasts([])  # one for the model: its layers' adapters cast at once
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = adapted_layer(getattr(parent, child), rank, alpha, dropout, device, adapter)
        if isinstance(layer, LoRALinear):
            layer.casts = casts
            casts.layers.append(layer)
        setattr(parent, child, layer)
    return names


def lora_layers(model):
    """{name: layer} of the adapted layers (LoRA, DoRA or LoKr)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, (LoRALinear, LoKrLinear))}


def lora_parameters(model):
    return [p for layer in lora_layers(model).values() for p in layer.adapter_tensors().values()]


def adapter_kind(model):
    """The kind of `model`'s adapters ("lora", "dora", "lokr"), or None without any."""
    kinds = {layer.kind for layer in lora_layers(model).values()}
    return kinds.pop() if len(kinds) == 1 else None if not kinds else "mixed"


def state_kind(state):
    """The kind of adapter a state dict in interchange names holds, from its keys."""
    if any(".lokr_w" in key for key in state):
        return "lokr"
    return "dora" if any(key.endswith(".dora_scale") for key in state) else "lora"


def set_lora_scale(model, multiplier):
    """Scale every adapter's update by `multiplier` (0 = the base model, 1 = as trained): alpha/rank * multiplier.
    Set it before merging; a merged model already holds its update in the weights."""
    for name, layer in lora_layers(model).items():
        if layer.merged:
            raise ValueError(f"{name} is merged: unmerge before changing the LoRA scale")
        if isinstance(layer, DoRALinear):  # its update renormalises: blended with the base as ComfyUI does
            layer.strength = multiplier
            continue
        # (a LoKr with no low-rank factor is not scaled by alpha / rank: ComfyUI's rule)
        layer.scale = (layer.alpha / layer.rank if getattr(layer, "low_rank", True) else 1.0) * multiplier


def merge_lora(model):
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge_lora(model):
    for layer in lora_layers(model).values():
        layer.unmerge()


def lora_state_dict(model, prefix=FILE_PREFIX):
    """The adapters in diffusers' interchange names: transformer.<module>.lora_A.weight / .lora_B.weight (a text
    encoder's: under its own `prefix`, TEXT_PREFIXES)."""
    return {f"{prefix}{name}.{suffix}": tensor.detach() for name, layer in lora_layers(model).items()
            for suffix, tensor in layer.adapter_tensors().items()}


def under(state, prefix):
    """The entries of `state` whose key starts with `prefix`."""
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def kohya_stem(prefix, module):
    """Kohya's name of `module`'s adapters under our `prefix` (one of KOHYA_PREFIXES): its path, dots as
    underscores, after kohya's prefix."""
    return KOHYA_PREFIXES[prefix] + module.replace(".", "_")


def to_kohya_names(state, prefix, alphas):
    """`state` with the adapters under `prefix` (one of KOHYA_PREFIXES) renamed to kohya's names, and an `.alpha`
    tensor (`alphas`: {module name: alpha}) beside each pair."""
    renamed = {}
    for key, value in state.items():
        if key.startswith(prefix):  # <prefix><module>.lora_A.weight (the text encoders' adapters are LoRA)
            module, matrix, weight = key[len(prefix):].rsplit(".", 2)
            key = f"{kohya_stem(prefix, module)}.{KOHYA_NAMES[matrix + '.' + weight]}"
        renamed[key] = value
    return {**renamed, **{f"{kohya_stem(prefix, m)}.alpha": torch.tensor(float(a)) for m, a in alphas.items()}}


def from_kohya_names(state, prefix, modules):
    """`state` with kohya's names of the adapters of `modules` (their names) back under `prefix`. A kohya key of no
    such module is left as it is (a strict load then names it)."""
    names = {f"{kohya_stem(prefix, m)}.{theirs}": f"{prefix}{m}.{ours}"
             for m in modules for ours, theirs in KOHYA_NAMES.items()}
    return {names.get(k, k): v for k, v in state.items()}


def lora_config(model):
    """rank, alpha and the adapted modules: what rebuilding the adapters needs (one rank and alpha per model)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA layers")
    settings = {(layer.rank, layer.alpha, layer.kind, getattr(layer, "factor", -1)) for layer in layers.values()}
    if len(settings) != 1:
        raise ValueError(f"LoRA layers with different rank/alpha {sorted(settings)}; one file holds one setting")
    (rank, alpha, kind, factor), = settings
    return {"rank": rank, "alpha": alpha, "target_modules": sorted(layers), "kind": kind, "factor": factor}


def file_metadata(configs, record=None):
    """safetensors metadata: diffusers' adapter config (rank, alpha, targets) of each part (`configs`: {prefix:
    lora_config}, the transformer's and any text encoder's) plus our own record."""
    adapter = {f"{prefix}{key}": value for prefix, config in configs.items() for key, value in
               (("r", config["rank"]), ("lora_alpha", config["alpha"]), ("target_modules", config["target_modules"]))}
    metadata = {METADATA_KEY: json.dumps(adapter)}
    config = configs[FILE_PREFIX]
    if config.get("kind", "lora") != "lora":
        metadata[KIND_KEY] = json.dumps({"kind": config["kind"], "factor": config.get("factor", -1)})
    if record is not None:
        metadata["minisd3"] = json.dumps(record)
    return metadata


def config_from_metadata(metadata):
    """-> {"rank", "alpha", "target_modules", "kind", "factor"} of the transformer's adapters, from a LoRA file's
    metadata written by file_metadata, and "text": {prefix: {"rank", "alpha", "target_modules"}} of the text
    encoders' (empty: none)."""
    if not metadata or METADATA_KEY not in metadata:
        raise ValueError("the LoRA file has no adapter metadata (rank, alpha, targets)")
    adapter = json.loads(metadata[METADATA_KEY])
    kind = json.loads(metadata.get(KIND_KEY, '{"kind": "lora", "factor": -1}'))

    def part(prefix):
        return {"rank": int(adapter[prefix + "r"]), "alpha": float(adapter[prefix + "lora_alpha"]),
                "target_modules": list(adapter[prefix + "target_modules"])}

    text = {prefix: part(prefix) for prefix in dict.fromkeys(TEXT_PREFIXES.values()) if prefix + "r" in adapter}
    return {**part(FILE_PREFIX), **kind, "text": text}


def check_lora_fits(own, state):
    """Raise a ValueError naming the missing, unexpected and wrong-shape keys if `state` does not fit `own`."""
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own
             if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        parts = [f"{label}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                 for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys]
        raise ValueError("LoRA weights do not fit the model; " + "; ".join(parts))


def load_lora_state_dict(model, state, prefix=FILE_PREFIX):
    """Copy interchange-format adapters (under `prefix`) into a model that already has them; strict: every key
    must match, and the kind of adapter (a LoKr file does not load into DoRA layers)."""
    own = lora_state_dict(model, prefix)
    if state_kind(state) != state_kind(own):
        raise ValueError(f"the weights are {state_kind(state)} adapters, the model's are {state_kind(own)}: load "
                         "them with the kind they were trained as (--adapter)")
    check_lora_fits(own, state)
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value)


class LoRAWeights:
    """A model's adapters seen as one module's weights, and those of the text encoders that train (`text`: {prefix:
    encoder}, TEXT_PREFIXES): state_dict() in diffusers' names, load_state_dict() strict. What the LoRA stage
    resumes and averages (EMA) instead of the whole, frozen model."""

    def __init__(self, model, text=None):
        self.parts = {FILE_PREFIX: model, **(text or {})}

    def state_dict(self):
        return {k: v for prefix, module in self.parts.items() for k, v in lora_state_dict(module, prefix).items()}

    def load_state_dict(self, state):
        stray = sorted(k for k in state if not k.startswith(tuple(self.parts)))
        if stray:
            raise ValueError(f"LoRA weights do not fit the model; unexpected: {', '.join(stray[:4])}")
        for prefix, module in self.parts.items():
            load_lora_state_dict(module, under(state, prefix), prefix)


def save_lora(model, path, record=None, state=None, dtype=None, fold_alpha=False, text=None):
    """Write the adapters to one safetensors file (atomic, read back and compared) with rank, alpha and targets
    in diffusers' metadata, and `record` (base weights, stage...) in ours; the text encoders' too (`text`: {prefix:
    encoder}). `state` (e.g. an EMA of the adapters, in interchange names) replaces their own and must have exactly
    their keys and shapes. `fold_alpha`: multiply the B matrices by alpha / rank and record alpha = rank, so
    loaders that read no alpha (ComfyUI takes it only from `.alpha` tensors; a bare `load_lora_adapter` ignores the
    metadata) apply the trained strength too. -> the file's size and sha256."""
    weights = LoRAWeights(model, text)
    own = weights.state_dict()
    state = own if state is None else state
    check_lora_fits(own, state)
    configs = {prefix: lora_config(module) for prefix, module in weights.parts.items()}
    for prefix, config in configs.items():
        scale = config["alpha"] / config["rank"] if fold_alpha and config["kind"] != "lokr" else 1.0
        if scale != 1.0:  # folded in fp32, before the cast to the file's dtype
            state = {k: v.float() * scale if k.startswith(prefix) and k.endswith(".lora_B.weight") else v
                     for k, v in state.items()}
            configs[prefix] = {**config, "alpha": float(config["rank"])}
    config = configs[FILE_PREFIX]
    if config["kind"] == "lokr":  # ComfyUI reads a LoKr's alpha from a tensor beside its factors
        state = {**state, **{f"{FILE_PREFIX}{name}.alpha": torch.tensor(float(config["alpha"]))
                             for name in config["target_modules"]}}
    for prefix in KOHYA_PREFIXES.keys() & configs.keys():  # T5's: in the names ComfyUI reads
        alphas = {name: configs[prefix]["alpha"] for name in configs[prefix]["target_modules"]}
        state = to_kohya_names(state, prefix, alphas)
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in state.items()}
    return write_safetensors(path, tensors, metadata=file_metadata(configs, record), float_dtype=dtype)


class LoRAExport:
    """What a LoRA stage's save exports: `model`'s adapters and the text encoders' (`text`: {prefix: encoder}; given
    at each save: their EMA's, or their own) to the file `path` in diffusers' LoRA format, alpha folded into B
    (save_lora), with `record` and the step."""

    def __init__(self, path, model, record, dtype, text=None):
        self.output, self.model, self.record, self.dtype, self.text = path, model, record, dtype, text

    def write(self, step, state, samples_seen):
        """-> bytes written; then the temp files a killed write left are deleted (as a weights save's commit does)."""
        record = {**self.record, "samples_seen": samples_seen, "step": step}
        written = save_lora(self.model, self.output, record, state, self.dtype, True, self.text)["bytes"]
        remove_leftovers(self.output)
        return written


def read_lora_file(path):
    """-> (interchange state dict: the transformer's adapters and any text encoder's, adapter config
    (config_from_metadata), our record or None)."""
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(".alpha")}  # alpha: in the metadata too
    record = json.loads(metadata["minisd3"]) if "minisd3" in metadata else None
    config = config_from_metadata(metadata)
    for prefix in KOHYA_PREFIXES.keys() & config["text"].keys():  # T5's: back under our prefix
        state = from_kohya_names(state, prefix, config["text"][prefix]["target_modules"])
    return state, config, record


def is_lora_file(path):
    """Whether `path` is a safetensors file of adapters (every key a lora_A or lora_B matrix, another kind's tensor,
    or T5's under kohya's prefix)."""
    if not (os.path.isfile(path) and path.endswith(".safetensors")):
        return False
    try:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
    except (OSError, ValueError, RuntimeError):
        return False
    return bool(keys) and all(".lora_A." in k or ".lora_B." in k or k.endswith(ADAPTER_SUFFIXES) or
                              k.startswith(tuple(KOHYA_PREFIXES.values())) for k in keys)


def attach_lora(model, state, config, dropout=0.0, prefix=FILE_PREFIX):
    """Put adapters (a state dict and config as read_lora_file gives them; those under `prefix`: the
    transformer's, or a text encoder's with its part of the config) on `model`, adding the layers if it has none;
    a key under no prefix the config names is an error."""
    stray = [] if prefix != FILE_PREFIX else sorted(k for k in state if not k.startswith((prefix, *config["text"])))
    if stray:  # keys under no prefix the file's metadata names
        raise ValueError(f"LoRA weights do not fit the model; unexpected: {', '.join(stray[:4])}")
    if not lora_layers(model):
        apply_lora(model, config["target_modules"], config["rank"], config["alpha"], dropout,
                   adapter=Adapter(config.get("kind", "lora"), config.get("factor", -1)))
    load_lora_state_dict(model, under(state, prefix), prefix)


def text_encoders_for(text_models, config):
    """{prefix: encoder} of the text encoders a LoRA file adapts (`config`: read_lora_file's), taken from
    `text_models` ({name: encoder}: components.text_models()); one it adapts that they lack is an error."""
    models = {TEXT_PREFIXES[name]: module for name, module in text_models.items()}
    missing = [prefix for prefix in config["text"] if prefix not in models]
    if missing:
        raise ValueError(f"it adapts text encoders these components do not have: {', '.join(missing)}")
    return {prefix: models[prefix] for prefix in config["text"]}


def load_lora(model, path, dropout=0.0):
    """Put the adapters of a LoRA file on `model` (adding the layers if it has none) -> our record or None."""
    state, config, record = read_lora_file(path)
    if config["text"]:
        raise ValueError(f"{path} adapts text encoders too: load it with eval/sampling.py's load_for_sampling")
    attach_lora(model, state, config, dropout)
    return record
