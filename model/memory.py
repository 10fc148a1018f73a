"""The estimate before the work: a run's peak memory per process, from parameter counts and the sizes of a step,
and where it exceeds the device (a GPU's free memory, or the RAM of a CPU run) a warning naming the levers.

    weights      trained networks 4 bytes a parameter (fp32 masters; 2 with --trained_dtype bf16); frozen ones 2
                 (bf16), 4 (fp32) or 1 (int8)
    gradients    as many bytes per trained parameter as its weight; with --step_in_backward 1 only the largest
                 parameter's (each is stepped and freed as backward makes it)
    optimizer    AdamW 8 bytes per trained parameter (4 for bf16 weights: torchao keeps the moments in bf16), 8-bit
                 AdamW about 2, Muon 4 on the blocks' matrices
    EMA          4 bytes per trained parameter, unless --ema_device cpu keeps it off the GPU
    sharded      (--fsdp 1) weights, gradients, optimizer and EMA divided over the shard group, plus one block
                 gathered whole; rank 0 holds the whole weights in host memory while it broadcasts them
    activations  what backward keeps, per block about ACTIVATION_WORDS values per token and width (for the blocks
                 --gradient_checkpointing recomputes only their inputs, and one block's at a time), in the compute
                 dtype but for the layer norms' outputs, fp32 under CUDA autocast; --gradient_checkpointing auto
                 recomputes the fewest blocks for the whole to fit AUTO_SHARE of the device
    components   the VAE and text encoders as loaded (the text encoders are freed once training reads the cache)
    save         about two of the largest tensor, on a CPU: a save writes and reads back a tensor at a time
    runtime      the process itself (CPU: Python and torch; GPU: what the CUDA context and kernels take)

A stage calls fit_memory (auto resolved, the estimate logged). Checked against measured peaks by
bench/bench_memory.py (BENCHMARKS.md).
"""
import os
from dataclasses import dataclass, replace

import torch

from model.components import text_tokens
from model.model_sd3light import blocks_recomputed, meta_model

GIB = 2 ** 30
ACTIVATION_WORDS = 24  # values kept for backward per token and unit of width in one joint block (attention + MLP)
CUDA_FP32_WORDS = 2  # of them, the two layer norms' outputs the modulation keeps: fp32 under CUDA autocast (CPU: bf16)
RUNTIME = {"cpu": 0.6 * GIB, "cuda": 0.8 * GIB}
AUTO_SHARE = 0.8  # of the device's memory, what --gradient_checkpointing auto plans to fill: room for its error
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2.06}  # per trained parameter (muon: from the matrices)


def frozen_bytes(frozen_dtype):
    return {"bf16": 2, "fp32": 4, "int8": 1.02}[frozen_dtype]  # int8: one scale a row aside


def kept_value_bytes(compute, device_type):
    """The mean bytes of a value the forward keeps for backward, computing in `compute` ("bf16" or "fp32") on
    `device_type`: under bf16 autocast 2, but CUDA autocast runs layer norms in fp32, so their outputs are 4."""
    if compute == "fp32":
        return 4
    return 2 + 2 * CUDA_FP32_WORDS / ACTIVATION_WORDS if device_type == "cuda" else 2


def activation_bytes(config, batch, resolution, downscale, text_tokens, checkpointing, compute_bytes):
    """What one micro-batch's forward keeps for backward, in bytes (`compute_bytes`: kept_value_bytes), with
    `checkpointing` blocks recomputed (True, False or a number: model_sd3light.blocks_recomputed)."""
    side = resolution // downscale // config.patch_size
    tokens = batch * (side * side + text_tokens)
    per_block = ACTIVATION_WORDS * tokens * config.inner_dim * compute_bytes
    recomputed = blocks_recomputed(checkpointing, config.num_layers)
    inputs = recomputed * 2 * tokens * config.inner_dim * 4  # a recomputed block keeps its inputs only
    return inputs + (per_block if recomputed else 0) + (config.num_layers - recomputed) * per_block


@dataclass(frozen=True)
class MemoryPlan:
    """What a run holds and computes, for the estimate: its transformers (`networks`, each "trained", "frozen",
    or the number of trainable adapter parameters on a frozen one), the optimizer, whether it keeps an EMA and
    where (`ema_device`: --ema_device, "cpu" keeps it off a GPU), and one micro-batch: its size, resolution and
    whether it recomputes each block in backward (`checkpointing`)."""
    networks: tuple
    optimizer: str
    ema: bool
    ema_device: str
    batch_size: int
    resolution: int
    checkpointing: object  # --gradient_checkpointing: True, False, "auto" (auto_checkpointing), or a block count
    trained_dtype: str = "fp32"  # --trained_dtype: what trained weights, gradients (and AdamW's moments) are held in
    step_in_backward: bool = False  # --step_in_backward 1: no more than one gradient at a time


def estimate(config, plan, frozen_dtype, shards, activations, components_bytes, device_type):
    """-> {part: bytes} of one process's peak, for `plan` (MemoryPlan) with transformers of `config`, its frozen
    networks held in `frozen_dtype`, its state sharded over `shards` processes."""
    sizes = [p.numel() for p in meta_model(config).parameters()]  # one model on the meta device: no memory
    params, largest = sum(sizes), max(sizes)
    trained = [params if net == "trained" else 0 if net == "frozen" else net for net in plan.networks]
    frozen = sum(params for net in plan.networks if net != "trained") * frozen_bytes(frozen_dtype)
    ema_on_device = plan.ema and (device_type == "cpu" or plan.ema_device != "cpu")
    weight = 2 if plan.trained_dtype == "bf16" else 4
    moments = 4 if plan.trained_dtype == "bf16" and plan.optimizer == "adamw" else None
    parts = {"weights": weight * sum(trained) + frozen,
             "gradients": weight * (min(largest, sum(trained)) if plan.step_in_backward else sum(trained)),
             "optimizer": sum(moments * n if moments else optimizer_bytes(config, plan.optimizer, n) for n in trained),
             "EMA": 4 * sum(trained) if ema_on_device else 0}
    if shards > 1:
        parts = {k: v / shards for k, v in parts.items()}
        parts["gathered block"] = 2 * params / config.num_layers
    save = 2 * 4 * largest if device_type == "cpu" and any(trained) else 0  # one tensor written, one read back
    parts.update(activations=activations, components=components_bytes, runtime=RUNTIME[device_type], save=save)
    return parts


def auto_checkpointing(config, plan, components, precision, info):
    """`plan` with --gradient_checkpointing auto resolved, as estimate_lines weighs it: the fewest blocks recomputed
    in backward (the first ones) for the estimate to fit AUTO_SHARE of the device's memory, every block where
    nothing less fits. Recomputing a block costs a second forward of it: at batch 1 on a large GPU, a step with
    none recomputed took half the time. A plan without auto comes back as it is."""
    device = info.device
    holding = (precision.frozen, info.mesh.shape[-1] if info.sharded else 1, module_bytes(components), device.type)
    return fitted_checkpointing(config, plan, device_memory(device), holding,
                                (components.downscale, text_tokens(components)),
                                kept_value_bytes(precision.compute, device.type))


def fit_memory(config, plan, components, precision, info, log):
    """What a stage calls: the run's memory plan (MemoryPlan) with --gradient_checkpointing auto resolved to the
    fewest blocks that fit the device, and its estimate logged -> the plan (`plan.checkpointing`: what the model
    recomputes in backward)."""
    plan = auto_checkpointing(config, plan, components, precision, info)
    for line in estimate_lines(config, plan, components, precision, info):
        log(line)
    return plan


def fitted_checkpointing(config, plan, memory_bytes, holding, latent, value_bytes):
    """`plan` with --gradient_checkpointing auto resolved for a device of `memory_bytes`: what is not activations
    (estimate, `holding` its frozen dtype, shards, components' bytes and device type) first, then the fewest blocks
    recomputed for the activations to fit in what AUTO_SHARE of the memory leaves (fewest_recomputed)."""
    if plan.checkpointing != "auto":
        return plan
    frozen_dtype, shards, components_bytes, device_type = holding
    parts = estimate(config, plan, frozen_dtype, shards, 0, components_bytes, device_type)
    return replace(plan, checkpointing=fewest_recomputed(config, plan, activation_room(parts, memory_bytes), latent,
                                                         value_bytes))


def activation_room(parts, memory_bytes):
    """What AUTO_SHARE of a device's `memory_bytes` leaves for activations beside the rest of `parts` (estimate)."""
    return AUTO_SHARE * memory_bytes - (sum(parts.values()) - parts["activations"])


def fewest_recomputed(config, plan, room, latent, value_bytes):
    """The fewest blocks recomputed for `plan`'s micro-batch to keep at most `room` bytes of activations (`latent`:
    the components' downscale and text tokens; `value_bytes`: kept_value_bytes), or True (every block)."""
    for blocks in range(config.num_layers + 1):
        if activation_bytes(config, plan.batch_size, plan.resolution, *latent, blocks, value_bytes) <= room:
            return blocks
    return True


def largest_batch(config, plan, room, latent, value_bytes, limit=64):
    """The largest micro-batch (up to `limit`) whose activations, every block recomputed, fit `room` bytes."""
    fits = [batch for batch in range(1, limit + 1)
            if activation_bytes(config, batch, plan.resolution, *latent, True, value_bytes) <= room]
    return max(fits, default=0)


def estimate_lines(config, plan, components, precision, info):
    """The estimate of one process's peak for `plan` (MemoryPlan) held and computed as `precision`
    (model/precision.Precision) says, on info's processes and device (sharded over the mesh's last dimension),
    with `components` as loaded now: in one line, and a warning line where it exceeds the device's memory (the
    run starts either way)."""
    device = info.device
    text = text_tokens(components)
    activations = activation_bytes(config, plan.batch_size, plan.resolution, components.downscale, text,
                                   plan.checkpointing, kept_value_bytes(precision.compute, device.type))
    shards = info.mesh.shape[-1] if info.sharded else 1
    parts = estimate(config, plan, precision.frozen, shards, activations, module_bytes(components), device.type)
    available = device_memory(device)
    line, warning = describe(parts, available, "this GPU's free memory" if device.type == "cuda" else
                             "this machine's RAM")
    line += f"; blocks recomputed in backward: {blocks_recomputed(plan.checkpointing, config.num_layers)} of " \
        f"{config.num_layers}"
    if device.type == "cuda":  # what a faster run could take: a larger micro-batch
        largest = largest_batch(config, plan, activation_room(parts, available), (components.downscale, text),
                                kept_value_bytes(precision.compute, device.type))
        line += f"; the largest micro-batch that fits {AUTO_SHARE:.0%} of it: {largest} recomputing every block"
    options = levers(plan, shards) if warning else []
    if options:  # a full fine-tune: which of its levers would make it fit
        fitting = [lever for lever, plan_with, shards_with in options
                   if sum(estimate(config, plan_with, precision.frozen, shards_with, activations, parts["components"],
                                   device.type).values()) <= available]
        warning += f"; each of these would fit: {'; '.join(fitting)}" if fitting else \
            "; none of the full fine-tune's levers would fit alone: shard over more processes"
    lines = [line] + ([warning] if warning else [])
    if info.sharded and device.type == "cuda":  # what stays whole: rank 0's copy, in host memory, not on a GPU
        lines.append(f"rank 0 loads the whole weights ({parts['weights'] * shards / GIB:.2f} GiB) in host memory and "
                     "broadcasts them into the shards one tensor at a time")
    return lines


def optimizer_bytes(config, optimizer, trained):
    if not trained:
        return 0
    if optimizer == "muon":  # one momentum for the blocks' matrices, AdamW's two moments for the rest
        matrices = sum(p.numel() for p in meta_model(config).block_matrices_and_rest()[0])
        return 4 * matrices + 8 * (trained - matrices) if trained >= matrices else 8 * trained
    return OPTIMIZER_BYTES[optimizer] * trained


def module_bytes(module):
    """Bytes of a module's parameters and buffers as held now (None and freed parts count nothing)."""
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def device_memory(device):
    """Bytes of memory the run may use: on a GPU what is free (other processes' memory is not the run's) plus what
    torch holds reserved for this process already (the components); on a CPU the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss():
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


LEVERS = ("--gradient_checkpointing 1 (or auto)", "--batch_size", "--frozen_dtype int8", "--optimizer adamw8bit",
          "--trained_dtype bf16", "--step_in_backward 1", "--fsdp 1")


def levers(plan, shards):
    """The memory levers a full fine-tune's `plan` has not pulled yet, each alone -> (the option, the plan with it,
    the shards with it). Activations are left as they are (checkpointing is weighed in the warning's list)."""
    if "trained" not in plan.networks:
        return []
    options = [("--optimizer adamw8bit", replace(plan, optimizer="adamw8bit"), shards),
               ("--trained_dtype bf16", replace(plan, trained_dtype="bf16"), shards),
               ("--step_in_backward 1", replace(plan, step_in_backward=True), shards),
               ("--trained_dtype bf16 --optimizer adamw8bit --step_in_backward 1",
                replace(plan, optimizer="adamw8bit", trained_dtype="bf16", step_in_backward=True), shards),
               (f"--fsdp 1 over {max(2, shards * 2)} processes", plan, max(2, shards * 2))]
    return [(name, with_it, n) for name, with_it, n in options if with_it != plan or n != shards]


def describe(parts, available, where):
    """The log line, and the warning line where the total exceeds what the device has (or None)."""
    total = sum(parts.values())
    shown = ", ".join(f"{name} {value / GIB:.2f}" for name, value in parts.items() if value)
    line = f"memory estimate per process: {total / GIB:.1f} GiB ({shown} GiB) on {where} of {available / GIB:.0f} GiB"
    if total <= available:
        return line, None
    return line, (f"warning: the estimate ({total / GIB:.1f} GiB) exceeds the {available / GIB:.0f} GiB of {where}; "
                  f"levers: {', '.join(LEVERS)}")
