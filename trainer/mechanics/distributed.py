"""The processes of a run: torchrun's ranks (NCCL on CUDA, gloo on CPU), the device mesh FSDP shards over, the
gradient sync decision of accumulated micro-batches, the one all-reduce a step needs for its logged losses, and
leaving together.

Data parallelism, the way a stage asks for it: `data_parallel(model, info, ...)` before building the optimizer.

    one process       the model itself
    torchrun, DDP     DistributedDataParallel: every process holds all weights, gradients and AdamW state
    --fsdp 1          FSDP2 (torch.distributed.fsdp.fully_shard) over info.mesh: each joint transformer block is
                      one shard group, then the root; weights, gradients and AdamW state are split over the
                      processes (dim-0 DTensor shards), and gathered block by block for forward and backward

A sharded run's state dicts hold DTensors. What a resume checkpoint stores is the same tree in every mode (the
model's parameter names as keys, the optimizer's state too: NamedOptimizerState), so a checkpoint written by one
mode loads into another: `conform` cuts full tensors into this process's shards; trainer/mechanics/sharded_checkpoint.py
reads DCP shards into whatever layout the run has. `gathered` makes a sharded state dict whole on rank 0 for the
exported weights (trainer_utils.save_step).
"""
import ctypes
import itertools
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from model.errors import UserError
from model.recompute import compile_block
from trainer.mechanics.state import chunk_of, fresh_like, leaves, map_leaves


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    mesh: object = None  # the device mesh FSDP shards over (--fsdp 1), else None

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def sharded(self):
        return self.mesh is not None

    @property
    def load_device(self):
        """Where rank 0 loads (or draws) a network: the run's device, or under FSDP the CPU, from where each tensor
        is broadcast into every rank's shards (data_parallel, below): no GPU holds a whole network it only
        shards."""
        return torch.device("cpu") if self.sharded else self.device


def init_distributed(fsdp=0, shard_size=0, timeout_minutes=60):
    """torchrun sets RANK/WORLD_SIZE: NCCL on CUDA (bound to this process's GPU), gloo on CPU. Plain `python` runs
    as one process. With `fsdp`, a device mesh to shard over: every process holds a shard, or with `shard_size`
    the processes form groups of that size that shard within and replicate across (hybrid sharding: a group per
    node). Checked first: a bad size is one line before any work. `timeout_minutes`: how long a collective waits
    for every process (NCCL's own default, 10, is less than rank 0 may take to write and verify a large save)."""
    cuda = torch.cuda.is_available()
    env = "RANK" in os.environ
    rank, local_rank = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK")) if env else (0, 0)
    world = launched_world_size()
    if shard_size and not fsdp:
        raise UserError("--fsdp_shard_size shards the weights: it needs --fsdp 1")
    if shard_size and world % shard_size:
        raise UserError(f"--fsdp_shard_size {shard_size} does not divide the {world} process(es): use a divisor of "
                        f"{world}, e.g. the GPUs of one node, or 0 to shard over all")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")  # with its index: NCCL binds to it
    if env and cuda:
        torch.cuda.set_device(local_rank)
    timeout = timedelta(minutes=timeout_minutes)
    group = {"backend": "nccl" if cuda else "gloo", "timeout": timeout, "device_id": device if cuda else None}
    if env:
        dist.init_process_group(**group)
    elif fsdp:  # FSDP on one process: a group of one
        dist.init_process_group(**group, store=dist.HashStore(), rank=0, world_size=1)
    mesh = shard_mesh(device, world, shard_size, timeout) if fsdp else None
    if not cuda:
        map_large_allocations()
    return DistInfo(rank, local_rank, world, device, mesh)


def launched_world_size():
    """The processes torchrun launched (its WORLD_SIZE), 1 under plain python: known before any process group."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else 1


def map_large_allocations(threshold=1 << 20):
    """On a CPU (glibc): allocations of `threshold` bytes and more are mapped on their own and go back to the
    system when freed. Left to itself glibc raises that threshold as large blocks are freed (up to 32 MB) and
    keeps later ones in its heap, where a step's gradients and temporaries fragment it: the full fine-tune of the
    `base` stand-in in bf16 peaked at 2.89 GiB, 2.15 with this. (A GPU's allocator is torch's own.)"""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD, which also stops its adjustment
    except (OSError, AttributeError):  # not glibc
        pass


def shard_mesh(device, world, shard_size, timeout):
    """The device mesh FSDP shards over: ("shard",) over every process, or with `shard_size` ("replicate",
    "shard") groups. Hybrid sharding's subgroups are new NCCL communicators, which would wait NCCL's default
    10 minutes: they are given the run's `timeout` too."""
    from torch.distributed.device_mesh import init_device_mesh

    groups = world // shard_size if shard_size else 1
    if groups == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    override = None
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        override = {"replicate": ("nccl", options), "shard": ("nccl", options)}
    return init_device_mesh(device.type, (groups, world // groups), mesh_dim_names=("replicate", "shard"),
                            backend_override=override)


def mean_over_processes(value, info):
    """The mean over processes of `value`, a scalar tensor on the device (a step's loss, summed there), in float64,
    all-reduced on the device: nothing waits for it (the loop reads it at its log step)."""
    value = value.double()
    if info.world_size > 1:
        value = value.clone()
        dist.all_reduce(value)
        value = value / info.world_size
    return value


def average_gradients(params, info):
    """The gradients of `params` that no DDP wrapper reduces (the text encoders' adapters) averaged over processes,
    flattened into one all-reduce on the device; nothing on one process. Every process holds the same ones."""
    grads = [p.grad for p in params if p.grad is not None]
    if info.world_size == 1 or not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= info.world_size
    for grad, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(mean)


def clip_grad_norm_mixed(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ over `params` that may mix FSDP's sharded parameters (DTensors) with whole
    ones (the text encoders' adapters, the same on every process), which torch's cannot take in one list: torch's
    own where they are of one kind; else each kind's norm alone, the sharded one made whole, and both kinds clipped
    by their joint norm -> that norm (on the device, not read)."""
    with_grads = [p for p in params if p.grad is not None]  # (the text encoders' have none once they stop)
    sharded = [p for p in with_grads if is_dtensor(p)]
    if len(sharded) in (0, len(with_grads)):
        return whole(torch.nn.utils.clip_grad_norm_(params, max_norm))
    kinds = (sharded, [p for p in with_grads if not is_dtensor(p)])
    total = torch.nn.utils.get_total_norm([whole(torch.nn.utils.get_total_norm([p.grad for p in kind]))
                                           for kind in kinds])
    for kind in kinds:
        torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total)
    return total


def any_process(flag, info):
    """Whether `flag` is set on any process: one all-reduce and one read where there are several, none on one."""
    if info.world_size == 1:
        return bool(flag)
    t = torch.tensor(float(flag), device=info.device)
    dist.all_reduce(t)
    return t.item() > 0


def sync_gradients(model, sync):
    """Whether the next forward and backward of `model` all-reduce its gradients: DDP's, on the last of a step's
    micro-batches only, so the others accumulate locally (nanoGPT's require_backward_grad_sync). FSDP
    reduce-scatters every micro-batch (its gradients stay sharded in between); one process has nothing to sync."""
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = sync


def leave_together(info):
    """Wait for every process at the end of a run: rank 0 may still be writing the last save or sample grid."""
    if info.world_size > 1:
        dist.barrier()


def data_parallel(model, info, compile_blocks=False, mixed_precision=None):
    """-> the module to train: `model` itself (one process, or sharded in place with info.mesh), or DDP around it.
    `compile_blocks`: torch.compile each block's forward with its recompute inside (model/recompute.compile_block;
    FSDP's hooks stay outside the graph). `mixed_precision`: the dtype FSDP computes in (bf16 on GPUs), gradients
    still reduced in fp32. A frozen model (a teacher) needs no DDP; under FSDP it is sharded like the rest. A model
    without transformer blocks is one shard group."""
    blocks = getattr(model, "transformer_blocks", ())
    if compile_blocks:
        recompiles_said()
        for block in blocks:
            compile_block(block)
    if info.mesh is None:
        from torch.nn.parallel import DistributedDataParallel

        trains = any(p.requires_grad for p in model.parameters())
        if not (info.world_size > 1 and trains):
            return model
        # frozen weights (a LoRA base) are read alike by every rank: DDP neither broadcasts them at the start nor
        # reduces them (int8 weights could not be broadcast)
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
        # the buffers (the position table) never change: no broadcast of them before every forward
        return DistributedDataParallel(model, broadcast_buffers=False)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Every rank starts from rank 0's weights (what DDP does when it wraps): FSDP keeps each rank's own slice, so a
    # rank that drew other initial weights would silently train a patchwork. Rank 0 holds them on the CPU
    # (info.load_device), the other ranks hold nothing (the meta device, trainer/trainer_utils.py): every rank shards a
    # model with no memory, then rank 0's tensors are broadcast one at a time into the shards, so no GPU ever
    # holds a whole network it only shards.
    whole = model.state_dict() if info.is_main else None
    model.to("meta")
    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    # reshard_after_forward on the root too: after a no-grad forward (sample grids) no whole copy lingers
    for block in blocks:
        fully_shard(block, mesh=info.mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=info.mesh, mp_policy=policy, reshard_after_forward=True)
    from_rank_0(model, whole, info)
    return model


RECOMPILE_LIMIT = 64


def recompiles_said():
    """The blocks share one compiled forward, recompiled for each kind of block (normal, last, dual attention),
    recomputed in backward or not, weight dtype and bucket shape, and for routed blocks' fewer tokens. Past
    Dynamo's limit (8) the rest would run uncompiled without a word: the limit is raised to what a run meets, and
    each recompile is logged with its reason (Dynamo's 'Recompiling' lines)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._logging.set_logs(recompiles=True)


@torch.no_grad()
def from_rank_0(model, whole, info):
    """Fill a sharded model's shards (and its buffers) from rank 0's whole state dict `whole` (None elsewhere; on
    the CPU), tensor by tensor: no process holds more on its device than its shards and one whole tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        model.to_empty(device=info.device)
    set_model_state_dict(model, whole or {}, options=StateDictOptions(full_state_dict=True,
                                                                      broadcast_from_rank0=True))


def gathered(state, info):
    """A state dict made whole, on the CPU of rank 0 (None on the others): each sharded tensor is all-gathered in
    turn, so no process holds more than one whole tensor on its device at a time."""
    whole = {}
    for key, value in state.items():
        value = value.full_tensor() if is_dtensor(value) else value
        if info.is_main:
            whole[key] = value.detach().cpu()
    return whole if info.is_main else None


def is_dtensor(value):
    """Whether `value` is a DTensor, a sharded run's tensor. torch.distributed.tensor (a second of imports) is
    loaded by the runs that shard: where it never was, no tensor is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def whole(value):
    """A scalar tensor made whole if it is a DTensor (e.g. a norm of sharded gradients), else itself: on the
    device, no read."""
    return value.full_tensor() if is_dtensor(value) else value


# ----------------------------------------------------------------------------------------------------------------
# State trees that load into any layout


def conform(saved, current):
    """`saved` (a state as one process holds it: whole tensors) laid out as `current` is: where the run holds a
    DTensor shard, the saved tensor is cut to this process's shard (no communication: every rank has it all)."""
    layout = leaves(current)

    def fit(path, tensor):
        target = layout.get(path)
        return shard_of(tensor, target) if is_dtensor(target) and not is_dtensor(tensor) else tensor

    return map_leaves(saved, fit)


def shard_of(whole, target):
    """This process's part of the whole tensor `whole`, as a DTensor laid out as `target`: FSDP's dim-0 rows cut
    out and copied into a tensor of the type of target's local part. The copy converts: torchao's 8-bit optimizer
    state is cut by rows (on its blocks, else dequantised first) and requantised where the saved state was not
    8-bit (its state is fp32 below 4096 values a process), which distribute_tensor cannot do."""
    from torch.distributed.tensor import DTensor

    offset, shape = chunk_of(target)
    if tuple(whole.shape) != tuple(target.shape):
        raise ValueError(f"a saved tensor of shape {tuple(whole.shape)} is of shape {tuple(target.shape)} here")
    local, rows = fresh_like(target.to_local()), slice(offset[0], offset[0] + shape[0])
    try:
        piece = whole[rows]
    except ValueError:  # torchao cuts 8-bit state on its 256-value blocks only: elsewhere, the fp32 it stands for
        piece = whole.dequantize()[rows]
    local.copy_(piece.to(local.device))
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False, shape=target.shape,
                              stride=target.stride())


class NamedOptimizerState:
    """An optimizer's state keyed by its model's parameter names instead of their positions, with sharded tensors
    under FSDP and whole ones otherwise (torch.distributed.checkpoint.state_dict): the same tree in every mode, so
    a resume may change processes or sharding. `optimizer` may be a list (each over its own parameters): their
    states merge into one tree. What a stage tracks for its resume checkpoint."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        """{"state": {name: its state}, "param_groups": [{..., "params": [names]}]}: what DCP's
        get_optimizer_state_dict returns, made here from the model's own parameter names (nothing wraps the model
        it is given, so they are DCP's names too). DCP resolves each name through the module tree again, for each
        optimizer: 1.3 s a save of the tiny model, 8 s with an optimizer a parameter (--step_in_backward). Before
        any step (an optimizer without state) DCP's own call builds the state first, by a step with zero gradients
        and learning rate."""
        optimizers = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
        if not all(optimizer.state for optimizer in optimizers):
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, self.optimizer)
        name_of = {param: name for name, param in self.model.named_parameters()}
        merged = {"state": {}, "param_groups": []}
        for optimizer in optimizers:
            state = optimizer.state_dict()  # keyed by position: the parameters of every group, in order
            names = [name_of[param] for group in optimizer.param_groups for param in group["params"]]
            merged["state"].update((names[position], value) for position, value in state["state"].items())
            merged["param_groups"] += [{**group, "params": [names[position] for position in group["params"]]}
                                       for group in state["param_groups"]]
        return merged

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if state["state"] and all(isinstance(k, int) for k in state["state"]):  # positions: written before names
            if any(is_dtensor(p) for p in self.model.parameters()):
                raise UserError("this resume checkpoint keeps its optimizer state by position, from an older "
                                "version: resume it once without --fsdp, then the saves that follow load anywhere")
            one = self.optimizer[0] if isinstance(self.optimizer, (list, tuple)) and len(self.optimizer) == 1 else \
                self.optimizer
            one.load_state_dict(state)
            return
        set_optimizer_state_dict(self.model, self.optimizer, state)
