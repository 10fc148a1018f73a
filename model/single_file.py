"""The original SD3 / SD3.5 single-file layout (`sd3.5_large.safetensors`): what ComfyUI's "Load Diffusion Model",
Forge and diffusers' `SD3Transformer2DModel.from_single_file` read. Keys sit under `model.diffusion_model.`; a
block is `joint_blocks.N.{x_block,context_block}` with q, k and v in one `attn.qkv`, and the output layer's (and
the last context block's) modulation has its shift and scale halves in the other order from diffusers'
(../shared/REFERENCE.md section 10; diffusers converts the other way in `single_file_utils.py`).

    single_file_state(state)          our (diffusers-named) state dict -> the single-file one
    single_file_metadata(path)        its metadata if `path` is in this layout, else None
    SingleFileTensors(path)           a single file read by diffusers' names, tensor by tensor (model/loading.py)
"""
import os
import re

import torch
from safetensors import SafetensorError, safe_open

from model.loading import TensorFiles

PREFIX = "model.diffusion_model."
OUTSIDE = {  # diffusers name prefix -> original, outside the blocks
    "pos_embed.proj.": "x_embedder.proj.",
    "time_text_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
    "time_text_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
    "time_text_embed.text_embedder.linear_1.": "y_embedder.mlp.0.",
    "time_text_embed.text_embedder.linear_2.": "y_embedder.mlp.2.",
    "context_embedder.": "context_embedder.",
    "proj_out.": "final_layer.linear.",
    "norm_out.linear.": "final_layer.adaLN_modulation.1.",  # halves swapped
}
IN_BLOCK = {  # within transformer_blocks.N. -> joint_blocks.N.: (original, part of a q|k|v concatenation or None)
    "attn.to_q.": ("x_block.attn.qkv.", 0), "attn.to_k.": ("x_block.attn.qkv.", 1),
    "attn.to_v.": ("x_block.attn.qkv.", 2),
    "attn.add_q_proj.": ("context_block.attn.qkv.", 0), "attn.add_k_proj.": ("context_block.attn.qkv.", 1),
    "attn.add_v_proj.": ("context_block.attn.qkv.", 2),
    "attn.norm_q.": ("x_block.attn.ln_q.", None), "attn.norm_k.": ("x_block.attn.ln_k.", None),
    "attn.norm_added_q.": ("context_block.attn.ln_q.", None), "attn.norm_added_k.": ("context_block.attn.ln_k.", None),
    "attn.to_out.0.": ("x_block.attn.proj.", None), "attn.to_add_out.": ("context_block.attn.proj.", None),
    "attn2.to_q.": ("x_block.attn2.qkv.", 0), "attn2.to_k.": ("x_block.attn2.qkv.", 1),
    "attn2.to_v.": ("x_block.attn2.qkv.", 2),
    "attn2.norm_q.": ("x_block.attn2.ln_q.", None), "attn2.norm_k.": ("x_block.attn2.ln_k.", None),
    "attn2.to_out.0.": ("x_block.attn2.proj.", None),
    "norm1.linear.": ("x_block.adaLN_modulation.1.", None),
    "norm1_context.linear.": ("context_block.adaLN_modulation.1.", None),  # halves swapped in the last block
    "ff.net.0.proj.": ("x_block.mlp.fc1.", None), "ff.net.2.": ("x_block.mlp.fc2.", None),
    "ff_context.net.0.proj.": ("context_block.mlp.fc1.", None), "ff_context.net.2.": ("context_block.mlp.fc2.", None),
}
BLOCK = re.compile(r"transformer_blocks\.(\d+)\.(.+)")


def original_name(name, num_layers):
    """A diffusers name -> (its single-file key, which third of a qkv tensor it is or None, whether its two
    halves are swapped)."""
    if name == "pos_embed.pos_embed":
        return PREFIX + "pos_embed", None, False
    match = BLOCK.fullmatch(name)
    if match:
        index, rest = match.groups()
        for ours, (theirs, part) in IN_BLOCK.items():
            if rest.startswith(ours):
                swap = ours == "norm1_context.linear." and int(index) == num_layers - 1
                return f"{PREFIX}joint_blocks.{index}.{theirs}{rest[len(ours):]}", part, swap
    for ours, theirs in OUTSIDE.items():
        if name.startswith(ours):
            return PREFIX + theirs + name[len(ours):], None, ours == "norm_out.linear."
    raise ValueError(f"{name} has no place in the SD3 single-file layout")


def swap_halves(tensor):
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def num_layers_of(names):
    return 1 + max(int(m.group(1)) for m in map(BLOCK.fullmatch, names) if m)


def single_file_state(state):
    """Our state dict (diffusers names) -> the single-file one: q, k, v concatenated, halves swapped."""
    layers, out, parts = num_layers_of(state), {}, {}
    for name, tensor in state.items():
        key, part, swap = original_name(name, layers)
        if part is None:
            out[key] = swap_halves(tensor) if swap else tensor
        else:
            parts.setdefault(key, [None] * 3)[part] = tensor
    for key, (q, k, v) in parts.items():
        if q is None or k is None or v is None:
            raise ValueError(f"{key}: q, k and v must all be there to write the single-file layout")
        out[key] = torch.cat([q, k, v])
    return out


def single_file_metadata(path):
    """A safetensors file in the single-file layout (its keys name joint_blocks) -> its metadata ({} if none);
    anything else -> None. Only the header is read."""
    if not (os.path.isfile(path) and str(path).lower().endswith(".safetensors")):
        return None
    try:
        with safe_open(path, framework="pt") as f:
            keys, metadata = list(f.keys()), f.metadata() or {}
    except (OSError, SafetensorError):
        return None
    return metadata if any(".joint_blocks." in k or k.startswith("joint_blocks.") for k in keys) else None


class SingleFileTensors:
    """A single file read by diffusers' names (as TensorFiles reads ours), one tensor at a time: a q, k or v is
    cut from its qkv, swapped halves put back. `names`: the diffusers names the model expects."""

    def __init__(self, path, names):
        self.files = TensorFiles([path])
        stored = self.files.shapes()
        prefix = PREFIX if any(n.startswith(PREFIX) for n in stored) else ""
        self.where, layers = {}, num_layers_of(names)
        for name in names:
            key, part, swap = original_name(name, layers)
            key = prefix + key[len(PREFIX):]
            if key in stored:
                self.where[name] = (key, part, swap)
        claimed = {key for key, _, _ in self.where.values()}
        self.unexpected = [key for key in stored if key not in claimed and key.startswith(prefix)]
        self.stored = stored

    def shapes(self):
        """{diffusers name: meta tensor}: what the file holds under our names (strict checks see what is missing)."""
        shapes = {}
        for name, (key, part, _) in self.where.items():
            shape = list(self.stored[key].shape)
            if part is not None:
                shape[0] //= 3
            shapes[name] = torch.empty(shape, dtype=self.stored[key].dtype, device="meta")
        return {**shapes, **{key: self.stored[key] for key in self.unexpected}}

    def read(self, name):
        key, part, swap = self.where[name]
        tensor = self.files.read(key)
        if part is not None:
            tensor = tensor.chunk(3, dim=0)[part].clone()
        return swap_halves(tensor) if swap else tensor

    def close(self):
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
