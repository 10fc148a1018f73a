"""The processes of a run: torchrun's ranks (NCCL on CUDA, gloo on CPU), the device mesh FSDP shards over, the
gradient sync decision of accumulated micro-batches, the one all-reduce a step needs for its logged losses, and
leaving together."""
import ctypes
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from model.errors import UserError


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
        is broadcast into every rank's shards (trainer/parallel.py): no GPU holds a whole network it only shards."""
        return torch.device("cpu") if self.sharded else self.device


def init_distributed(fsdp=0, shard_size=0, timeout_minutes=60):
    """torchrun sets RANK/WORLD_SIZE: NCCL on CUDA (bound to this process's GPU), gloo on CPU. Plain `python` runs
    as one process. With `fsdp`, a device mesh to shard over: every process holds a shard, or with `shard_size`
    the processes form groups of that size that shard within and replicate across (hybrid sharding: a group per
    node). Checked first: a bad size is one line before any work. `timeout_minutes`: how long a collective waits
    for every process (NCCL's own default, 10, is less than rank 0 may take to write and verify a large save)."""
    cuda = torch.cuda.is_available()
    env = "RANK" in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")) if env else (0, 0, 1)
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


def mean_and_any(values, flag, info):
    """(the means over ranks of `values`, numbers or scalar tensors on the device (a step's losses, summed there),
    whether `flag` is set on any rank), in one all-reduce and one read to the host: the step's one sync."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=info.device) for v in [*values, float(flag)]])
    if info.world_size > 1:
        dist.all_reduce(t)
    *means, flagged = t.tolist()
    return [v / info.world_size for v in means], flagged > 0


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
