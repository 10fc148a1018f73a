"""What a training step computes, counted from the config, and the peak it is divided by: MFU.

Each matrix product of a forward costs 2 * m * n * k FLOPs (a multiply-add is two). Per block and sample, with
width D, N image tokens and L text tokens, the forward is about

    2 * 12 * D^2 * (N + L)       the linear layers of both streams (q, k, v and out: 4 D^2; feed-forward: 8 D^2)
    + 4 * (N + L)^2 * D          the joint attention's Q K^T and P V
    + 2 * 12 * D^2               the adaLN modulation, once a sample

and the embedders and output layer add their own (counted exactly below). The backward costs two products per
forward product (the gradient of the input and of the weight), except where nothing needs one:

- every weight trains: the first layers (patchify, text and timestep embedders) need no input gradient;
- LoRA: the frozen products need only their input gradient (none in the embedders and the modulation, whose
  inputs carry no gradient, nor in the first block's q, k, v, which read the embedded tokens); each adapter
  computes its forward, both weight gradients, and its input gradients where its input needs one. This is exact
  for adapters on the attention (the default targets, tested against torch's FLOP counter); with other targets
  the first block is counted by the same rules (feed-forward adapters alone: its attention's backward is
  counted though not computed; modulation adapters: its q, k, v input gradients are computed though not
  counted).

Token routing (model/token_routing.py) runs blocks first..last on the kept image tokens. Gradient checkpointing
recomputes each block's forward in the backward: counted apart (`Flops.recompute`), not in MFU, which divides the
model's own FLOPs (forward + backward) a second by the device's peak.
"""
import functools
import time
from dataclasses import dataclass

import torch

from model.model_sd3light import blocks_recomputed
from model.token_routing import TokenRouting

# Dense bf16 peaks (no sparsity), FLOP/s, by the end of torch.cuda.get_device_name (an H100 PCIe or NVL, a 3090 Ti
# and other cards are not listed: their peak is measured)
GPU_PEAKS = {"H100 80GB HBM3": 989e12, "H200": 989e12, "A100-SXM4-40GB": 312e12, "A100-SXM4-80GB": 312e12,
             "A100 80GB PCIe": 312e12, "A100-PCIE-40GB": 312e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


@dataclass(frozen=True)
class Flops:
    """FLOPs of a forward and its backward, and what gradient checkpointing recomputes (apart)."""
    forward: float
    backward: float
    recompute: float = 0.0

    @property
    def model(self):
        return self.forward + self.backward

    def __add__(self, other):
        return Flops(self.forward + other.forward, self.backward + other.backward, self.recompute + other.recompute)


@dataclass(frozen=True)
class Product:
    """One matrix product of a forward: `tokens` rows through `fan_in` -> `fan_out`, for a layer `name` (None for
    attention's own products) of `kind`: "embed" (reads the inputs), "cond" (the conditioning vector),
    "mod" (modulation), "first" (the first block's q, k, v), "block", "out", "attention"."""
    name: str
    kind: str
    tokens: int
    fan_in: int
    fan_out: int

    @property
    def flops(self):
        return 2 * self.tokens * self.fan_in * self.fan_out


def block_products(config, i, n, text):
    """The matrix products of block `i` on `n` image and `text` text tokens (one sample)."""
    D, last, dual = config.inner_dim, i == config.num_layers - 1, i in config.dual_attention_layers
    qkv = "first" if i == 0 else "block"
    out = [Product("norm1.linear", "mod", 1, D, (9 if dual else 6) * D),
           Product("norm1_context.linear", "mod", 1, D, (2 if last else 6) * D)]
    out += [Product(f"attn.{p}", qkv, n, D, D) for p in ("to_q", "to_k", "to_v")]
    out += [Product(f"attn.{p}", qkv, text, D, D) for p in ("add_q_proj", "add_k_proj", "add_v_proj")]
    out += [Product(None, "attention", n + text, n + text, D)] * 2  # Q K^T, then P V
    out.append(Product("attn.to_out.0", "block", n, D, D))
    if dual:
        out += [Product(f"attn2.{p}", qkv, n, D, D) for p in ("to_q", "to_k", "to_v")]
        out += [Product(None, "attention", n, n, D)] * 2 + [Product("attn2.to_out.0", "block", n, D, D)]
    streams = [("ff", n)] if last else [("ff", n), ("ff_context", text)]
    if not last:
        out.append(Product("attn.to_add_out", "block", text, D, D))
    for ff, tokens in streams:
        out += [Product(f"{ff}.net.0.proj", "block", tokens, D, 4 * D), Product(f"{ff}.net.2", "block", tokens,
                                                                               4 * D, D)]
    return out


def outer_products(config, n, text):
    """The products outside the blocks: the embedders, and the output layer with its modulation (one sample)."""
    D, p = config.inner_dim, config.patch_size
    return [Product("pos_embed.proj", "embed", n, config.in_channels * p * p, D),
            Product("context_embedder", "embed", text, config.joint_attention_dim, D),
            Product("timestep_embedder.linear_1", "embed", 1, 256, D),
            Product("text_embedder.linear_1", "embed", 1, config.pooled_projection_dim, D),
            Product("timestep_embedder.linear_2", "cond", 1, D, D),
            Product("text_embedder.linear_2", "cond", 1, D, D),
            Product("norm_out.linear", "mod", 1, D, 2 * D),
            Product("proj_out", "out", n, D, p * p * config.output_channels)]


def _adapted(name, targets):
    return name is not None and any(name == t or name.endswith("." + t) for t in targets)


def backward_flops(product, lora):
    """The backward of one product: every weight training (lora None), or LoRA's (rank, target suffixes)."""
    f = product.flops
    if lora is None:
        return f if product.kind == "embed" else 2 * f
    if product.kind == "attention":  # both operands carry gradients
        return 2 * f
    needs_input = product.kind in ("block", "out")
    base = f if needs_input else 0
    rank, targets = lora
    if not _adapted(product.name, targets):
        return base
    a, b = 2 * product.tokens * product.fan_in * rank, 2 * product.tokens * rank * product.fan_out
    return base + (a + b) + b + (a if needs_input else 0)  # both weight gradients; B's input; A's where needed


def adapter_forward(product, lora):
    if lora is None or not _adapted(product.name, lora[1]):
        return 0
    return 2 * product.tokens * lora[0] * (product.fan_in + product.fan_out)


@dataclass(frozen=True)
class FlopCount:
    """How a run's training forwards compute: the transformer's config, the text tokens, the routing, LoRA's
    (rank, target suffixes) or None when every weight trains, and gradient checkpointing."""
    config: object
    text_tokens: int
    routing: TokenRouting = TokenRouting()
    lora: tuple = None
    checkpointing: object = False  # True, False, or the number of blocks recomputed (model_sd3light.blocks_recomputed)

    def forward(self, batch, height, width, grad=True, routed=None):
        """Flops of one forward of `batch` samples on latents of height x width, and its backward if `grad`; routed
        as the run routes if `routed` (default: when `grad`; DPO's reference, a no-gradient forward, is routed)."""
        config, text, lora = self.config, self.text_tokens, self.lora
        p = config.patch_size
        n = (height // p) * (width // p)
        forward = backward = recompute = 0
        recomputed = blocks_recomputed(self.checkpointing, config.num_layers)
        for i in range(config.num_layers):
            routes = (grad if routed is None else routed) and self.routing.routes(i)
            for product in block_products(config, i, self.routing.kept(n) if routes else n, text):
                f = product.flops + adapter_forward(product, lora)
                forward, recompute = forward + f, recompute + (f if i < recomputed else 0)
                backward += backward_flops(product, lora)
        for product in outer_products(config, n, text):
            forward += product.flops + adapter_forward(product, lora)
            backward += backward_flops(product, lora)
        if not grad:
            return Flops(batch * forward, 0.0)
        return Flops(batch * forward, batch * backward, batch * recompute)


def training_flops_per_sample(config, height, width, text_len):
    """Forward + backward FLOPs of one sample when every weight trains, without routing or recompute."""
    return FlopCount(config, text_len).forward(1, height, width).model


@functools.cache
def measured_peak(device, dtype, threads, repeats=3, budget=0.2):
    """FLOP/s of the best of `repeats` square matrix products in `dtype` on `threads` CPU threads: a CPU's (or an
    unlisted GPU's) peak, measured once per process. The side doubles from 512 up to 2048 (4096 on a GPU) while a
    product of the next size would take under `budget` seconds, and the products stop once `budget` is spent:
    where the dtype is emulated (bf16 on a CPU without AVX-512 BF16 runs some 50x slower than fp32) a 2048-wide
    product takes 15 s, and a 512-wide one reads the same rate. A fifth of a second: every run pays it at its
    start, and on this 2-core CPU a 1024-wide fp32 product reads within 10% of a 2048-wide one (BENCHMARKS)."""
    size, largest = 256, 4096 if device.type == "cuda" else 2048
    best = 0.0
    while size < largest and 8 * best < budget:
        size *= 2
        generator = torch.Generator(device).manual_seed(0)  # its own: the run's random streams are left alone
        a, b = (torch.randn(size, size, device=device, generator=generator).to(dtype) for _ in range(2))
        product_seconds(a, b)  # the first product at a size sets its kernels up
        best = spent = product_seconds(a, b)
    for _ in range(repeats - 1):
        if spent > budget:
            break
        seconds = product_seconds(a, b)
        best, spent = min(best, seconds), spent + seconds
    return 2 * size ** 3 / best


def product_seconds(a, b):
    """Seconds of the product of `a` and `b`."""
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    started = time.perf_counter()
    torch.mm(a, b)
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - started


def peak_flops(device, dtype):
    """(FLOP/s, where from): a listed GPU's dense bf16 peak, else a peak measured now in `dtype`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        listed = next((peak for key, peak in GPU_PEAKS.items() if name.endswith(key)), None)
        if listed is not None:
            return listed, f"{name}, dense bf16"
    peak = measured_peak(device, dtype, torch.get_num_threads())
    return peak, f"measured: {dtype} matrix products on this {device.type}"
