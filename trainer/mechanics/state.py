"""A run's random streams, and nested state trees (dicts and lists of tensors, a sharded run's DTensors among
them): their leaves, mapped, moved to the CPU, read back into tensors of the same layout."""
import torch


def rng_state(generator, device):
    """This process's random streams: the training generator (sigmas, noise, caption dropout) and torch's own."""
    return {"train": generator.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, generator, device):
    generator.set_state(state["train"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def leaves(tree, path=()):
    """-> {path: tensor} of every tensor in a nested dict/list state (path: the keys on the way, as a tuple)."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {p: t for key, sub in items for p, t in leaves(sub, path + (key,)).items()}


def map_leaves(tree, fn, path=()):
    """The same nested state with each tensor replaced by fn(path, tensor)."""
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(v, fn, path + (i,)) for i, v in enumerate(tree))
    return tree


def to_cpu(obj):
    """A nested state with every tensor on the CPU (what a resume file holds)."""
    return map_leaves(obj, lambda path, tensor: tensor.detach().cpu())


def fresh_like(tensor):
    """A tensor to read `tensor` back into: empty, of its type and layout. torchao's 8-bit optimizer state (a
    tensor subclass of codes, scales and a code map; a DTensor's local part under FSDP) has no empty_like: it is
    rebuilt from empty codes and scales, keeping its code map, a constant a load does not write."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(tensor, DTensor):
        return DTensor.from_local(fresh_like(tensor.to_local()), tensor.device_mesh, tensor.placements,
                                  run_check=False, shape=tensor.shape, stride=tensor.stride())
    if not is_traceable_wrapper_subclass(tensor):
        return torch.empty_like(tensor)
    names, context = tensor.__tensor_flatten__()
    inner = {name: getattr(tensor, name).clone() if name == "qmap" else fresh_like(getattr(tensor, name))
             for name in names}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.shape, tensor.stride())


def chunk_of(tensor):
    """(offsets, sizes) of the part of `tensor` this process holds: a DTensor's shard, or all of it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)
