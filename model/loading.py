"""Filling a transformer from safetensors files without copies: the model is built on the meta device (no random
initialisation of weights about to be overwritten), then each tensor is read from its file straight into a tensor
of the target dtype on the target device and put in its place. The files are read, not memory-mapped, so the
process never holds their pages beside the model: the peak is the loaded model plus one tensor (plus, for int8,
one block in bf16 before it is quantised).

    reader = TensorFiles([shard_1, shard_2])        # the headers only
    model = fill(meta_model(config), reader, torch.bfloat16, "cuda", after_block=quantise)
"""
import ctypes
import json
import struct

import torch
import torch.nn as nn

from model.model_sd3light import check_state_dict

# safetensors' dtype names (https://github.com/huggingface/safetensors, format.md)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class TensorFiles:
    """The tensors of one or more safetensors files, by name: their headers read at once, each tensor's bytes
    read only when asked (`read`), into a fresh tensor of the stored dtype."""

    def __init__(self, paths):
        self.where = {}  # name -> (path, dtype, shape, start, end)
        for path in paths:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in DTYPES:
                    raise ValueError(f"{path}: {name} has dtype {entry['dtype']}, which MiniSD3 does not read")
                begin, end = entry["data_offsets"]
                self.where[name] = (path, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + size + begin,
                                    8 + size + end)
        self.handles = {}

    def shapes(self):
        """{name: a meta tensor of the stored shape and dtype}: enough to check keys and shapes strictly."""
        return {name: torch.empty(shape, dtype=dtype, device="meta")
                for name, (_, dtype, shape, _, _) in self.where.items()}

    def read(self, name):
        path, dtype, shape, begin, end = self.where[name]
        tensor = torch.empty(shape, dtype=dtype)
        if end > begin:
            f = self.handles.get(path) or self.handles.setdefault(path, open(path, "rb"))
            f.seek(begin)
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            if f.readinto(view) != end - begin:
                raise ValueError(f"{path} ends inside {name}: the file is truncated")
        return tensor

    def close(self):
        for f in self.handles.values():
            f.close()
        self.handles = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def put(model, name, tensor):
    """Put `tensor` in the place of the parameter or buffer `name` (a parameter keeps its requires_grad)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = tensor


def block_of(name):
    """'transformer_blocks.7.attn.to_q.weight' -> 'transformer_blocks.7'; None outside the blocks."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "transformer_blocks" else None


def block_index(name):
    """'transformer_blocks.7.attn.to_q.weight' -> 7; None outside the blocks."""
    block = block_of(name)
    return None if block is None else int(block.split(".")[1])


@torch.no_grad()
def fill(model, files, dtype, device, after_block=None, host_blocks=0):
    """Fill the meta `model` from `files` (TensorFiles), strictly (every key, right shapes: a StateDictMismatchError
    names the ones that differ), each floating-point tensor in `dtype` on `device`, in the model's own order; the
    first `host_blocks` transformer blocks in host memory instead (block swap: model/block_swap.py streams them to
    the device around each use, so they are never on it whole). `after_block(module)` runs on each transformer
    block, and on the model once for what is outside the blocks, as soon as it is filled (int8: quantise it before
    the next is read). -> the model."""
    check_state_dict(model, files.shapes())
    names = list(model.state_dict())
    for i, name in enumerate(names):
        tensor = files.read(name)
        index = block_index(name)
        where = "cpu" if index is not None and index < host_blocks else device
        put(model, name, tensor.to(where, dtype if tensor.is_floating_point() else tensor.dtype))
        del tensor
        block = block_of(name)
        if block is not None and (i + 1 == len(names) or block_of(names[i + 1]) != block):
            if after_block is not None:
                after_block(model.get_submodule(block))
            release_freed_memory()
    if after_block is not None:
        after_block(model)  # the embedders and the output layer (blocks already done are passed over)
        release_freed_memory()
    return model


def release_freed_memory():
    """Give the memory of the tensors freed since (each block's bf16 weights once quantised, the conversions'
    temporaries) back to the system: glibc keeps freed blocks under 32 MB in its heap, where the int8 weights
    that stay fragment it (measured on the SD3.5-Large stand-in: 11.4 GiB after an int8 load instead of 8.5)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
