"""SD3-Light: the SD3 / SD3.5 MMDiT transformer, written by hand in plain PyTorch.

Every parameter and buffer has the name and shape it has in diffusers' `SD3Transformer2DModel` built from the
same arguments, so weights move between the two with `load_state_dict(strict=True)` and no conversion.

Read top to bottom: config and presets, embeddings, attention, the joint block, the model (FLOPs: model/flops.py).
Shapes: B batch, N image tokens, L text tokens, D = num_attention_heads * attention_head_dim.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.file_io import atomic_write_text
from model.recompute import Recomputed, compiled_by_compile_block, draws_random

# ----------------------------------------------------------------------------------------------------------------
# Config and presets


@dataclass
class SD3LightConfig:
    """Exactly the constructor arguments of diffusers' SD3Transformer2DModel, with the same defaults."""

    sample_size: int = 128  # latent height/width the position table is scaled for
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096  # width of the text encoder's token sequence
    caption_projection_dim: int = 1152  # must equal D: text tokens join the image tokens in attention
    pooled_projection_dim: int = 2048  # width of the pooled text vector
    out_channels: int = 16
    pos_embed_max_size: int = 96  # side of the fixed sin-cos table, in patches; inputs are centre-cropped from it
    dual_attention_layers: tuple = ()  # SD3.5-medium: blocks with a second, image-only self-attention
    qk_norm: str | None = None  # SD3.5: "rms_norm" on queries and keys

    def __post_init__(self):
        self.dual_attention_layers = tuple(int(i) for i in self.dual_attention_layers)
        if self.qk_norm not in (None, "rms_norm"):
            raise ValueError(f"qk_norm must be None or 'rms_norm' (the SD3 / SD3.5 choices), got {self.qk_norm!r}")
        if self.pos_embed_max_size is None:
            raise ValueError("pos_embed_max_size must be set: SD3 models crop their position table from it")
        if self.caption_projection_dim != self.inner_dim:
            raise ValueError(
                f"caption_projection_dim ({self.caption_projection_dim}) must equal num_attention_heads * "
                f"attention_head_dim ({self.inner_dim}): text tokens share the attention with image tokens"
            )
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dual_attention_layers {bad} are outside 0..{self.num_layers - 1}")

    @property
    def inner_dim(self):
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self):
        # diffusers treats out_channels=None as "same as in_channels"
        return self.out_channels if self.out_channels is not None else self.in_channels

    def to_dict(self):
        d = asdict(self)
        d["dual_attention_layers"] = list(self.dual_attention_layers)
        return d

    @classmethod
    def from_dict(cls, d):
        """Build from a dict such as a diffusers config.json; keys starting with '_' are metadata."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in known)
        if unknown:
            raise ValueError(f"unknown SD3Transformer2DModel config keys {unknown}: the model would not match them")
        return cls(**{k: v for k, v in d.items() if k in known})

    def save_json(self, path):
        """Write the config.json a diffusers `transformer/` folder holds (atomically)."""
        d = {"_class_name": "SD3Transformer2DModel", "_diffusers_version": DIFFUSERS_FORMAT_VERSION, **self.to_dict()}
        atomic_write_text(path, json.dumps(d, indent=2) + "\n")

    @classmethod
    def load_json(cls, path):
        """Read a config.json (ours or diffusers'); `path` may also be the folder holding it."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if d.get("_class_name", "SD3Transformer2DModel") != "SD3Transformer2DModel":
            raise ValueError(f"{path} describes a {d['_class_name']}, not an SD3Transformer2DModel")
        return cls.from_dict(d)


DIFFUSERS_FORMAT_VERSION = "0.42.1"  # the diffusers release whose config.json layout we write

# One place for every named size. tiny/small use the built-in pixel-space autoencoder (RGB space-to-depth by 2:
# 12 channels) and the built-in text encoder (width 128); base and the published shapes use the real SD3 VAE
# (16 channels) and CLIP-L/G + T5 text embeddings (4096 wide sequence, 2048 pooled).
# For tiny/small, pos_embed_max_size = sample_size // patch_size puts neighbouring patches one position unit
# apart. With the table spanning fewer units (as SD3's does), a 32px image's 8x8 grid got nearly the same
# position code everywhere (cosine 0.91 between opposite corners) and the model could not place objects.
# tiny takes images up to 64px (a 16x16 grid), small up to 128px.
_BUILTIN = dict(in_channels=12, out_channels=12, joint_attention_dim=128, pooled_projection_dim=128, patch_size=2)
_SD3 = dict(in_channels=16, out_channels=16, joint_attention_dim=4096, pooled_projection_dim=2048, patch_size=2)
PRESETS = {
    "tiny": dict(_BUILTIN, sample_size=32, pos_embed_max_size=16, num_layers=6, num_attention_heads=6,
                 attention_head_dim=32, caption_projection_dim=192),
    "small": dict(_BUILTIN, sample_size=64, pos_embed_max_size=32, num_layers=12, num_attention_heads=6,
                  attention_head_dim=64, caption_projection_dim=384),
    # The tiny transformer on real SD3 components (16-channel VAE, CLIP-L/G + T5 text): smoke runs on a laptop, and
    # the tests' tiny SD3 folder. Its table holds 64x64 latents (512px with SD3's VAE).
    "sd3-tiny": dict(_SD3, sample_size=32, pos_embed_max_size=32, num_layers=2, num_attention_heads=2,
                     attention_head_dim=32, caption_projection_dim=64),
    "base": dict(_SD3, sample_size=64, pos_embed_max_size=96, num_layers=12, num_attention_heads=12,
                 attention_head_dim=64, caption_projection_dim=768),
    "sd3-medium": dict(_SD3, sample_size=128, pos_embed_max_size=192, num_layers=24, num_attention_heads=24,
                       attention_head_dim=64, caption_projection_dim=1536),
    "sd3.5-medium": dict(_SD3, sample_size=128, pos_embed_max_size=384, num_layers=24, num_attention_heads=24,
                         attention_head_dim=64, caption_projection_dim=1536, qk_norm="rms_norm",
                         dual_attention_layers=tuple(range(13))),
    "sd3.5-large": dict(_SD3, sample_size=128, pos_embed_max_size=192, num_layers=38, num_attention_heads=38,
                        attention_head_dim=64, caption_projection_dim=2432, qk_norm="rms_norm"),
}


# The presets of published weights (Stability AI's SD3-Medium, SD3.5-Medium, SD3.5-Large): a stage whose weights are
# one of them trains with its real-model recipe (the fine-tune stages' set_real_model_defaults), not the demo's.
PUBLISHED_PRESETS = ("sd3-medium", "sd3.5-medium", "sd3.5-large")


# The sizes that connect the transformer to its components (VAE channels, text widths). A preset's own values for
# them are the components it was made for; pretraining on other components takes theirs (components.py
# transformer_widths), and the weights' config records them.
WIDTH_FIELDS = ("in_channels", "out_channels", "joint_attention_dim", "pooled_projection_dim")


def preset_config(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return SD3LightConfig(**{**PRESETS[name], **overrides})


def preset_of(config):
    """The name of the preset a config is (whatever its widths), or None."""
    widths = {name: getattr(config, name) for name in WIDTH_FIELDS}
    return next((name for name in PRESETS if preset_config(name, **widths).to_dict() == config.to_dict()), None)


def count_parameters(config):
    """Parameter count of a config, built on the meta device so even sd3.5-large allocates nothing."""
    with torch.device("meta"):
        model = SD3Light(config)
    return sum(p.numel() for p in model.parameters())


def presets_table():
    rows = ["preset        layers  heads  width  in/out ch  text width  params"]
    for name in PRESETS:
        c = preset_config(name)
        rows.append(f"{name:<13} {c.num_layers:>6} {c.num_attention_heads:>6} {c.inner_dim:>6} "
                    f"{c.in_channels:>6}/{c.output_channels:<4} {c.joint_attention_dim:>10}  "
                    f"{count_parameters(c) / 1e6:8.1f}M")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------------------
# Embeddings


def sincos_2d_table(dim, grid_size, base_size):
    """SD3's fixed 2D sin-cos position table [grid_size**2, dim], in fp32.

    Positions are scaled so the whole table spans `base_size` units. The first half of the channels encodes the
    column, the second half the row; each half is [sin, cos] over geometric frequencies (computed in fp64, on the
    CPU whatever device the model is built on: the same table everywhere). On the meta device (meta_model) only its
    shape: meta ops run torch's Python references, whose first call imports torch._dynamo (2-3 s of a start).
    """
    if torch.get_default_device().type == "meta":
        return torch.empty(grid_size ** 2, dim, dtype=torch.float32)
    pos = torch.arange(grid_size, dtype=torch.float64, device="cpu") / (grid_size / base_size)
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64, device="cpu") / (dim / 4))

    def one_axis(p):  # [grid, grid] positions -> [grid*grid, dim/2]
        out = p.reshape(-1, 1) * omega
        return torch.cat([out.sin(), out.cos()], dim=1)

    rows, cols = torch.meshgrid(pos, pos, indexing="ij")
    return torch.cat([one_axis(cols), one_axis(rows)], dim=1).float().to(torch.get_default_device())


def timestep_sinusoids(timestep, dim=256, max_period=10000):
    """[B] timesteps in [0, 1000] -> [B, dim] features, cosines first (diffusers' flip_sin_to_cos=True)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    args = timestep.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


def check_patch_grid(h, w, max_size):
    """A latent grid of h x w patches must fit the position table (`max_size` patches a side): ValueError if not."""
    if h > max_size or w > max_size:
        raise ValueError(f"latent grid {h}x{w} patches exceeds the position table ({max_size}x{max_size}): use a "
                         "smaller resolution or a model with a larger pos_embed_max_size")


class PatchEmbed(nn.Module):
    """Conv patchify plus the centre-cropped fixed position table (persistent: it is in the state dict)."""

    def __init__(self, config):
        super().__init__()
        D, p = config.inner_dim, config.patch_size
        self.patch_size, self.max_size = p, config.pos_embed_max_size
        self.proj = nn.Conv2d(config.in_channels, D, kernel_size=p, stride=p)
        table = sincos_2d_table(D, self.max_size, base_size=config.sample_size // p)
        self.register_buffer("pos_embed", table.unsqueeze(0), persistent=True)

    def cropped_table(self, h, w):
        check_patch_grid(h, w, self.max_size)
        top, left = (self.max_size - h) // 2, (self.max_size - w) // 2
        table = self.pos_embed.view(self.max_size, self.max_size, -1)[top:top + h, left:left + w]
        return table.reshape(1, h * w, -1)

    def forward(self, x):  # [B, C, H, W] -> [B, N, D]
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        # contiguous once here, or the strided layout is inherited by the whole residual stream (copies everywhere)
        x = self.proj(x).flatten(2).transpose(1, 2).contiguous()
        return x + self.cropped_table(h, w).to(x.dtype)


class MLPEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding and PixArtAlphaTextProjection alike)."""

    def __init__(self, in_dim, dim):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    """The conditioning vector: embedded timestep + embedded pooled text, [B, D]."""

    def __init__(self, config):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, config.inner_dim)
        self.text_embedder = MLPEmbedder(config.pooled_projection_dim, config.inner_dim)

    def forward(self, timestep, pooled):
        t = self.timestep_embedder(timestep_sinusoids(timestep).to(pooled.dtype))
        return t + self.text_embedder(pooled)


# ----------------------------------------------------------------------------------------------------------------
# Normalisation, modulation, attention, feed-forward


def layer_norm(x):
    """LayerNorm without learned parameters (diffusers' norm2 / norm2_context / the norms inside adaLN)."""
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class RMSNorm(nn.Module):
    """RMSNorm over the head dimension with a learned scale (SD3.5 qk_norm)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)


class AdaLNModulation(nn.Module):
    """SiLU -> Linear(D, n*D): n shift/scale/gate vectors from the conditioning, each [B, 1, D]."""

    def __init__(self, dim, n):
        super().__init__()
        self.linear = nn.Linear(dim, n * dim)
        self.n = n

    def forward(self, cond, dtype):
        return self.linear(F.silu(cond).to(dtype)).unsqueeze(1).chunk(self.n, dim=2)


class Attention(nn.Module):
    """Multi-head attention through F.scaled_dot_product_attention.

    With `joint=True` (the MMDiT attention) text tokens get their own projections (add_*), and image and text tokens
    attend jointly over the concatenation [image; text]. With `context_pre_only` (the last block) the text
    outputs are discarded, so there is no `to_add_out`.
    """

    def __init__(self, dim, heads, head_dim, qk_norm, joint, context_pre_only=False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        # Registered in diffusers' order, so state dicts list their keys identically.
        self.norm_q = RMSNorm(head_dim) if qk_norm else None
        self.norm_k = RMSNorm(head_dim) if qk_norm else None
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        if joint:
            self.add_k_proj, self.add_v_proj, self.add_q_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # diffusers' to_out.1 is a parameter-free dropout
        if joint:
            self.to_add_out = None if context_pre_only else nn.Linear(dim, dim)
            self.norm_added_q = RMSNorm(head_dim) if qk_norm else None
            self.norm_added_k = RMSNorm(head_dim) if qk_norm else None

    def _qkv(self, x, to_q, to_k, to_v, norm_q, norm_k):
        """Project [B, T, D] tokens to q, k, v of shape [B, T, heads, head_dim], with optional qk norm."""
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, self.heads, self.head_dim) for proj in (to_q, to_k, to_v))
        if norm_q is not None:
            q, k = norm_q(q), norm_k(k)
        return q, k, v

    def forward(self, x, context=None):
        B, N, _ = x.shape
        q, k, v = self._qkv(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
        if context is not None:
            cq, ck, cv = self._qkv(context, self.add_q_proj, self.add_k_proj, self.add_v_proj,
                                   self.norm_added_q, self.norm_added_k)
            q, k, v = torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # torch's CPU attention backward is several times slower in bf16 than in fp32 (and less accurate)
            with torch.autocast("cpu", enabled=False):
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2)  # [B, T, heads, head_dim]
        if context is None:
            return self.to_out[0](out.reshape(B, N, -1))
        # split before flattening the heads: one copy per stream, and a single cat in backward
        x_out, context_out = out.split([N, out.shape[1] - N], dim=1)
        x_out = self.to_out[0](x_out.reshape(B, N, -1))
        if self.to_add_out is None:  # context_pre_only: the text outputs are not used
            return x_out, None
        return x_out, self.to_add_out(context_out.reshape(B, -1, x_out.shape[-1]))


class GELUProjection(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """D -> 4D (GELU, tanh approximation) -> D; indices 0 and 2 of `net` carry weights, as in diffusers."""

    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(GELUProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return self.net(x)


# ----------------------------------------------------------------------------------------------------------------
# The joint (MMDiT) block


def modulate(x, shift, scale):
    return torch.addcmul(shift, x, 1 + scale)


class JointTransformerBlock(nn.Module):
    """Two token streams (image, text) with their own weights and adaLN-Zero modulation, one joint attention.

    `context_pre_only` (the last block): text tokens only supply keys/values, their stream ends here.
    `use_dual_attention` (SD3.5-medium): a second self-attention over image tokens only, with its own modulation.
    """

    def __init__(self, dim, heads, head_dim, context_pre_only, qk_norm, use_dual_attention):
        super().__init__()
        self.context_pre_only, self.use_dual_attention = context_pre_only, use_dual_attention
        self.norm1 = AdaLNModulation(dim, 9 if use_dual_attention else 6)
        self.norm1_context = AdaLNModulation(dim, 2 if context_pre_only else 6)
        self.attn = Attention(dim, heads, head_dim, qk_norm, joint=True, context_pre_only=context_pre_only)
        self.attn2 = Attention(dim, heads, head_dim, qk_norm, joint=False) if use_dual_attention else None
        self.ff = FeedForward(dim)
        self.ff_context = None if context_pre_only else FeedForward(dim)

    def forward(self, x, context, temb):
        mod = self.norm1(temb, x.dtype)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod[:6]
        x_norm = layer_norm(x)
        context_mod = self.norm1_context(temb, context.dtype)
        if self.context_pre_only:
            scale_c, shift_c = context_mod  # continuous adaLN (no gates): scale comes first
            c_norm = modulate(layer_norm(context), shift_c, scale_c)
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = context_mod
            c_norm = modulate(layer_norm(context), c_shift_msa, c_scale_msa)
        attn_out, context_attn_out = self.attn(modulate(x_norm, shift_msa, scale_msa), c_norm)
        x = torch.addcmul(x, gate_msa, attn_out)
        if self.use_dual_attention:
            shift_msa2, scale_msa2, gate_msa2 = mod[6:]
            x = torch.addcmul(x, gate_msa2, self.attn2(modulate(x_norm, shift_msa2, scale_msa2)))
        x = torch.addcmul(x, gate_mlp, self.ff(modulate(layer_norm(x), shift_mlp, scale_mlp)))
        if self.context_pre_only:
            return x, None
        context = torch.addcmul(context, c_gate_msa, context_attn_out)
        c_ff = self.ff_context(modulate(layer_norm(context), c_shift_mlp, c_scale_mlp))
        context = torch.addcmul(context, c_gate_mlp, c_ff)
        return x, context


# ----------------------------------------------------------------------------------------------------------------
# The model


class StateDictMismatchError(ValueError):
    pass


def blocks_recomputed(checkpointing, num_layers):
    """How many blocks, the first ones, gradient checkpointing recomputes in backward: `checkpointing` True = every
    block, False none, a number that many (--gradient_checkpointing auto: what the memory needs, model/memory.py)."""
    if checkpointing is True or checkpointing is False:
        return num_layers if checkpointing else 0
    return max(0, min(int(checkpointing), num_layers))


class SD3Light(nn.Module):
    def __init__(self, config, gradient_checkpointing=False):
        super().__init__()
        self.config = config
        D = config.inner_dim
        # recompute blocks in backward to save memory: True every block, False none, a number the first that many
        self.gradient_checkpointing = gradient_checkpointing
        # model/block_swap.BlockSwap streaming the first blocks' weights from host memory, or None; a swapped block is
        # recomputed in backward whatever gradient_checkpointing says (what it keeps for backward holds no weight)
        self.block_swap = None
        self.pos_embed = PatchEmbed(config)
        self.time_text_embed = TimeTextEmbed(config)
        self.context_embedder = nn.Linear(config.joint_attention_dim, config.caption_projection_dim)
        self.transformer_blocks = nn.ModuleList([
            JointTransformerBlock(D, config.num_attention_heads, config.attention_head_dim,
                                  context_pre_only=i == config.num_layers - 1, qk_norm=config.qk_norm,
                                  use_dual_attention=i in config.dual_attention_layers)
            for i in range(config.num_layers)
        ])
        self.norm_out = AdaLNModulation(D, 2)  # continuous adaLN before the output projection: scale, shift
        self.proj_out = nn.Linear(D, config.patch_size ** 2 * config.output_channels)
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self):
        """DiT's recipe: Xavier linears, zero biases, and adaLN-Zero (zero modulation and output) so that every
        block starts as the identity and the first prediction is zero."""
        if self.proj_out.weight.is_meta:  # no values to set (and normal_ there would import torch._dynamo: 2-3 s)
            return
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.xavier_uniform_(module.weight.view(module.weight.shape[0], -1))
                nn.init.zeros_(module.bias)
        for embedder in (self.time_text_embed.timestep_embedder, self.time_text_embed.text_embedder):
            nn.init.normal_(embedder.linear_1.weight, std=0.02)
            nn.init.normal_(embedder.linear_2.weight, std=0.02)
        for module in self.modules():
            if isinstance(module, AdaLNModulation):
                nn.init.zeros_(module.linear.weight)
                nn.init.zeros_(module.linear.bias)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def block_matrices_and_rest(self):
        """The parameters split in two: the transformer blocks' 2-D weights (attention and MLP projections,
        modulation), the hidden matrices Muon orthogonalises, and the rest (embeddings, the output layer, norms,
        biases)."""
        matrices, rest = [], []
        for name, p in self.named_parameters():
            (matrices if name.startswith("transformer_blocks.") and p.ndim == 2 else rest).append(p)
        return matrices, rest

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, route=None):
        """hidden_states [B, C, H, W] latents; encoder_hidden_states [B, L, joint_attention_dim];
        pooled_projections [B, pooled_projection_dim]; timestep [B] (sigma * 1000). Returns [B, out_channels, H, W].
        `route` (model/token_routing.TokenRoute, training only): blocks route.first..route.last see only the image
        tokens route.keep; the others skip them unchanged."""
        B, _, H, W = hidden_states.shape
        p = self.config.patch_size
        if H % p or W % p:
            raise ValueError(f"latent size {H}x{W} is not a multiple of the patch size {p}")
        if timestep.dim() == 0:
            timestep = timestep.expand(B)
        x = self.pos_embed(hidden_states)
        temb = self.time_text_embed(timestep, pooled_projections)
        context = self.context_embedder(encoder_hidden_states)
        recomputed = blocks_recomputed(self.gradient_checkpointing, len(self.transformer_blocks)) \
            if torch.is_grad_enabled() else 0
        if self.block_swap is not None and torch.is_grad_enabled():
            recomputed = max(recomputed, self.block_swap.count)
        # puts a recomputed block's node in the graph where none of its inputs needs a gradient (a LoRA's first)
        anchor = torch.empty(0, device=x.device, requires_grad=True) if recomputed else None
        for i, block in enumerate(self.transformer_blocks):
            if route is not None and i == route.first:  # set the routed tokens aside
                everything, index = x, route.keep[..., None].expand(-1, -1, x.shape[-1])
                x = everything.gather(1, index)
            if i < recomputed:
                x, context = self.recomputed(block, x, context, temb, anchor)
            else:
                x, context = block(x, context, temb)
            if route is not None and i == route.last:  # and put them back, unchanged, beside the kept ones
                x = everything.scatter(1, index, x)
        scale, shift = self.norm_out(temb, x.dtype)
        x = self.proj_out(modulate(layer_norm(x), shift, scale))
        # unpatchify: [B, h*w, p*p*C] -> [B, C, h*p, w*p]
        h, w, C = H // p, W // p, self.config.output_channels
        x = x.view(B, h, w, p, p, C).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(B, C, H, W)

    def recomputed(self, block, x, context, temb, anchor):
        """block(x, context, temb), recomputed in backward. Without block swap: a plain block (its own class and
        forward) by model/recompute.Recomputed, one autograd node; a compiled one by the compiler
        (model/recompute.compile_block). A sharded one not compiled, and every block of a model with block swap, by
        torch's non-reentrant checkpoint, whose hooks FSDP and block swap expect."""
        if self.block_swap is None:
            if type(block) is JointTransformerBlock and "forward" not in vars(block):
                return Recomputed.apply(block, draws_random(block), anchor, x, context, temb)
            if compiled_by_compile_block(block):
                return block(x, context, temb, recompute=True, random=draws_random(block))
        # the random state kept only where the block draws: a CUDA graph cannot capture the read of it
        return checkpoint(block, x, context, temb, use_reentrant=False, preserve_rng_state=draws_random(block))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Strict by default; a mismatch raises one error that names every missing, unexpected or misshapen key."""
        if strict:
            check_state_dict(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def check_state_dict(model, state_dict, limit=8):
    """Raise StateDictMismatchError naming the keys where `state_dict` does not fit `model` exactly."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    misshapen = [f"{k} (file {list(state_dict[k].shape)}, model {list(expected[k].shape)})"
                 for k in expected if k in state_dict and state_dict[k].shape != expected[k].shape]

    def names(kind, keys):
        shown = ", ".join(keys[:limit]) + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")
        return f"{len(keys)} {kind}: {shown}"

    problems = [names(kind, keys) for kind, keys in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen)) if keys]
    if not problems:
        return
    hint = ""
    for prefix in ("module.", "_orig_mod.", "transformer.", "model."):
        if unexpected and all(k.startswith(prefix) for k in unexpected) and len(missing) == len(unexpected):
            hint = f"; the keys carry a '{prefix}' prefix: strip it before loading"
    raise StateDictMismatchError(f"state dict does not fit {type(model).__name__}: " + "; ".join(problems) + hint)


def meta_model(config):
    """An SD3Light with every parameter and buffer on the meta device: shapes and names, no memory."""
    with torch.device("meta"):
        return SD3Light(config)


if __name__ == "__main__":
    print(presets_table())
