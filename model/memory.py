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
    text activations  with --train_text_encoders, what one micro-batch's forward through them keeps for backward,
                 measured on one caption before the run (text_activation_bytes)
    save         about two of the largest tensor, on a CPU: a save writes and reads back a tensor at a time
    runtime      the process itself (CPU: Python and torch; GPU: what the CUDA context and kernels take)

A stage calls fit_memory (auto resolved, the estimate logged). Checked against measured peaks by
bench/bench_memory.py (BENCHMARKS.md).
"""
import math
import os
from dataclasses import dataclass, replace

import torch

from model.block_swap import host_arena_bytes, swap_sizes
from model.components import module_bytes, text_tokens
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
    where (`ema_device`: --ema_device, "cpu" keeps it off a GPU), one micro-batch: its size, resolution and
    whether it recomputes each block in backward (`checkpointing`), and how many of the first network's blocks
    stream from host memory (`blocks_to_swap`: model/block_swap.py)."""
    networks: tuple
    optimizer: str
    ema: bool
    ema_device: str
    batch_size: int
    resolution: int
    checkpointing: object  # --gradient_checkpointing: True, False, "auto" (fitted_plan), or a block count
    trained_dtype: str = "fp32"  # --trained_dtype: what trained weights, gradients (and AdamW's moments) are held in
    step_in_backward: bool = False  # --step_in_backward 1: no more than one gradient at a time
    blocks_to_swap: object = 0  # --blocks_to_swap: a count, or "auto" (fitted_plan)
    text_adapters: int = 0  # trainable adapter parameters on text encoders (--train_text_encoders), held in fp32
    text_activations: int = 0  # bytes a micro-batch's forward through those encoders keeps for backward (measured)


def estimate(config, plan, frozen_dtype, shards, activations, components_bytes, device_type):
    """-> {part: bytes} of one process's peak, for `plan` (MemoryPlan) with transformers of `config`, its frozen
    networks held in `frozen_dtype`, its state sharded over `shards` processes."""
    model = meta_model(config)  # one model on the meta device: no memory
    sizes = [p.numel() for p in model.parameters()]
    params, largest = sum(sizes), max(sizes)
    trained = [params if net == "trained" else 0 if net == "frozen" else net for net in plan.networks]
    frozen = sum(params for net in plan.networks if net != "trained") * frozen_bytes(frozen_dtype)
    ema_on_device = plan.ema and (device_type == "cpu" or plan.ema_device != "cpu")
    weight = trained_weight_bytes(plan)
    parts = {"weights": weight * sum(trained) + frozen,
             "gradients": weight * (min(largest, sum(trained)) if plan.step_in_backward else sum(trained)),
             "optimizer": sum(state_bytes(config, plan, n) for n in trained),
             "EMA": 4 * sum(trained) if ema_on_device else 0}
    if shards > 1:
        parts = {k: v / shards for k, v in parts.items()}
        parts["gathered block"] = 2 * params / config.num_layers
    # the text encoders' adapters, whole on every process: their fp32 gradients, AdamW's two moments, the EMA (their
    # weights and the encoders they train on are the components', counted as held)
    text = plan.text_adapters
    parts.update(gradients=parts["gradients"] + 4 * text, optimizer=parts["optimizer"] + 8 * text,
                 EMA=parts["EMA"] + (4 * text if ema_on_device else 0))
    if plan.text_activations:  # and what their forward keeps for backward, held beside the transformer's
        parts["text activations"] = plan.text_activations
    if plan.blocks_to_swap:
        parts = with_swap(parts, plan, frozen_dtype, swap_sizes(block_shapes(model), plan.blocks_to_swap))
    save = 2 * 4 * largest if device_type == "cpu" and any(trained) else 0  # one tensor written, one read back
    parts.update(activations=activations, components=components_bytes, runtime=RUNTIME[device_type], save=save)
    return parts


def trained_weight_bytes(plan):
    """A trained weight's bytes (and its gradient's): --trained_dtype."""
    return 2 if plan.trained_dtype == "bf16" else 4


def state_bytes(config, plan, trained):
    """The optimizer state of `trained` parameters: AdamW's moments in bf16 for bf16 weights (torchao), else
    optimizer_bytes."""
    if plan.trained_dtype == "bf16" and plan.optimizer == "adamw":
        return 4 * trained
    return optimizer_bytes(config, plan.optimizer, trained)


# ----------------------------------------------------------------------------------------------------------------
# Block swap: the first blocks' weights in host memory, streamed through buffers on the device


def block_shapes(model):
    """Each transformer block of `model` (on the meta device) as (its parameter count, its shape: blocks of one
    shape share the swap's buffers)."""
    return [(sum(p.numel() for p in block.parameters()), tuple(tuple(p.shape) for p in block.parameters()))
            for block in model.transformer_blocks]


def swapped_parameter_bytes(plan, frozen_dtype):
    """What a swapped parameter takes, in host memory and in a buffer: (its weight's bytes, its optimizer state's):
    a frozen base's weight; a trained one's weight and state (a full fine-tune stepped in backward: both stream)."""
    if plan.networks[0] != "trained":
        return frozen_bytes(frozen_dtype), 0
    return trained_weight_bytes(plan), state_bytes(None, plan, 1)


def with_swap(parts, plan, frozen_dtype, swapped):
    """`parts` (estimate's, nothing swapped) with plan.blocks_to_swap of the first network's blocks streamed: their
    weights (trained: and their optimizer state and EMA) off the device, the buffers they stream through on it.
    `swapped`: model/block_swap.swap_sizes' (in parameters)."""
    moved, buffered = swapped
    weight, state = swapped_parameter_bytes(plan, frozen_dtype)
    parts = dict(parts)
    parts["weights"] -= moved * weight
    parts["optimizer"] -= moved * state
    if plan.networks[0] == "trained" and parts["EMA"]:
        parts["EMA"] -= 4 * moved  # the EMA of weights at home is kept in host memory beside them
    parts["swap buffers"] = (weight + state) * buffered
    return parts


def swap_host_bytes(config, plan, frozen_dtype):
    """Host memory the swapped blocks take -> (what is pinned on a GPU: their weights in arenas, a trained block's
    optimizer state in one of its own; the EMA of trained weights, pageable)."""
    moved = [size for size, _ in block_shapes(meta_model(config))[:plan.blocks_to_swap or 0]]
    weight, state = swapped_parameter_bytes(plan, frozen_dtype)
    pinned = host_arena_bytes([weight * n for n in moved]) + sum(host_arena_bytes([state * n]) for n in moved
                                                                   if state)
    return pinned, 4 * sum(moved) if plan.ema and plan.networks[0] == "trained" else 0


# ----------------------------------------------------------------------------------------------------------------
# Planning: what is recomputed and what is swapped, for the estimate to fit the device


def run_holding(components, precision, info):
    """What the estimate reads of a run besides its plan -> (holding: the frozen dtype, the shards, the components'
    bytes, the device type; latent: the components' downscale and text tokens; the bytes of a value backward
    keeps)."""
    device = info.device
    holding = (precision.frozen, info.mesh.shape[-1] if info.sharded else 1, module_bytes(components), device.type)
    return holding, (components.downscale, text_tokens(components)), kept_value_bytes(precision.compute, device.type)


def fit_memory(config, plan, components, precision, info, log):
    """What a stage calls: the run's memory plan (MemoryPlan) with --gradient_checkpointing auto and --blocks_to_swap
    auto resolved for the device (fitted_plan), and its estimate logged -> the plan (`plan.checkpointing`: what the
    model recomputes in backward; `plan.blocks_to_swap`: how many blocks stream from host memory)."""
    # the adapters on the text encoders that train (--train_text_encoders) are the components' trainable parameters
    plan = replace(plan, text_adapters=sum(p.numel() for p in components.parameters() if p.requires_grad),
                   text_activations=plan.batch_size * text_activation_bytes(components))
    plan = fitted_plan(config, plan, device_memory(info.device), *run_holding(components, precision, info))
    for line in estimate_lines(config, plan, components, precision, info):
        log(line)
    return plan


def text_activation_bytes(components):
    """What one sample's forward through the text encoders that train keeps for backward, in bytes, measured: the
    tensors autograd saves while they encode one caption as a step does (each storage once, their weights left
    out); 0 where none trains."""
    if not getattr(components, "trained_text", ()):
        return 0
    weights = {p.untyped_storage().data_ptr() for p in components.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        components.trained_outputs(["a caption"])
    return sum(saved.values())


def fitted_plan(config, plan, memory_bytes, holding, latent, value_bytes):
    """`plan` with --gradient_checkpointing auto and --blocks_to_swap auto resolved for a device of `memory_bytes`
    (`holding`, `latent`, `value_bytes`: run_holding's): the fewest blocks swapped, then the fewest recomputed, for
    the estimate to fit AUTO_SHARE of it; everything swapped and recomputed where nothing less fits.

    Recomputation is spent first, swapping only where recomputing every block does not fit: a recomputed block
    frees its activations (at 1024 px more than its weights take: SD3.5-Large's 0.52 GiB against 0.40 in bf16) at
    the cost of a second forward and nothing else, while a swapped block frees its weights but is recomputed anyway
    (what backward keeps of it must hold no weight) and crosses to the device twice a step. A swapped block is
    always among the recomputed ones (both are the first blocks). On a CPU, auto swaps nothing: host and device
    memory are one."""
    frozen_dtype, shards, components_bytes, device_type = holding
    counts = [plan.blocks_to_swap] if plan.blocks_to_swap != "auto" else \
        range(config.num_layers + 1) if device_type == "cuda" else [0]
    shapes = block_shapes(meta_model(config))
    base = estimate(config, replace(plan, blocks_to_swap=0), frozen_dtype, shards, 0, components_bytes, device_type)
    for count in counts:
        candidate = replace(plan, blocks_to_swap=count)
        parts = with_swap(base, candidate, frozen_dtype, swap_sizes(shapes, count)) if count else base
        room = activation_room(parts, memory_bytes)
        if plan.checkpointing == "auto":
            recomputed = fewest_recomputed(config, candidate, room, latent, value_bytes, at_least=count)
        else:
            recomputed = plan.checkpointing if blocks_recomputed(plan.checkpointing, config.num_layers) >= count \
                else count
        kept = activation_bytes(config, plan.batch_size, plan.resolution, *latent, recomputed, value_bytes)
        if kept <= room or count == counts[-1]:
            return replace(candidate, checkpointing=recomputed)
    raise AssertionError("unreachable: the last count returns")


def activation_room(parts, memory_bytes):
    """What AUTO_SHARE of a device's `memory_bytes` leaves for activations beside the rest of `parts` (estimate)."""
    return AUTO_SHARE * memory_bytes - (sum(parts.values()) - parts["activations"])


def fewest_recomputed(config, plan, room, latent, value_bytes, at_least=0):
    """The fewest blocks recomputed (at least `at_least`) for `plan`'s micro-batch to keep at most `room` bytes of
    activations (`latent`: the components' downscale and text tokens; `value_bytes`: kept_value_bytes), or True
    (every block)."""
    for blocks in range(at_least, config.num_layers + 1):
        if activation_bytes(config, plan.batch_size, plan.resolution, *latent, blocks, value_bytes) <= room:
            return blocks
    return True


def largest_batch(config, plan, room, latent, value_bytes, limit=64):
    """The largest micro-batch (up to `limit`) whose activations, every block recomputed, fit `room` bytes (`room`
    counts the text encoders' at `plan`'s micro-batch as spent: they grow with the micro-batch too)."""
    text = plan.text_activations / plan.batch_size  # a sample's
    fits = [batch for batch in range(1, limit + 1) if activation_bytes(config, batch, plan.resolution, *latent, True,
                                                                       value_bytes) + batch * text
            <= room + plan.text_activations]
    return max(fits, default=0)


def estimate_lines(config, plan, components, precision, info):
    """The estimate of one process's peak for `plan` (MemoryPlan) held and computed as `precision`
    (model/precision.Precision) says, on info's processes and device (sharded over the mesh's last dimension),
    with `components` as loaded now: in one line, and a warning line where it exceeds the device's memory (the
    run starts either way); with blocks swapped, what they take of host memory and whether the host has it."""
    device = info.device
    holding, latent, value_bytes = run_holding(components, precision, info)
    activations = activation_bytes(config, plan.batch_size, plan.resolution, *latent, plan.checkpointing, value_bytes)
    shards = holding[1]
    parts = estimate(config, plan, precision.frozen, shards, activations, holding[2], device.type)
    available = device_memory(device)
    line, warning = describe(parts, available, "this GPU's free memory" if device.type == "cuda" else
                             "this machine's RAM")
    line += f"; blocks recomputed in backward: {blocks_recomputed(plan.checkpointing, config.num_layers)} of " \
        f"{config.num_layers}"
    if plan.blocks_to_swap:
        line += f"; blocks swapped to host memory: {plan.blocks_to_swap} of {config.num_layers} " \
            f"({sum(swap_host_bytes(config, plan, precision.frozen)) / GIB:.2f} GiB there)"
    if device.type == "cuda":  # what a faster run could take: a larger micro-batch
        largest = largest_batch(config, plan, activation_room(parts, available), latent, value_bytes)
        line += f"; the largest micro-batch that fits {AUTO_SHARE:.0%} of it: {largest} recomputing every block"
    options = levers(plan, shards) if warning else []
    if options:  # a full fine-tune: which of its levers would make it fit
        fitting = [lever for lever, plan_with, shards_with in options
                   if sum(estimate(config, plan_with, precision.frozen, shards_with, activations, parts["components"],
                                   device.type).values()) <= available]
        warning += f"; each of these would fit: {'; '.join(fitting)}" if fitting else \
            "; none of the full fine-tune's levers would fit alone: shard over more processes"
    lines = [line] + ([warning] if warning else []) + swap_lines(config, plan, precision.frozen, device)
    if info.sharded and device.type == "cuda":  # what stays whole: rank 0's copy, in host memory, not on a GPU
        lines.append(f"rank 0 loads the whole weights ({parts['weights'] * shards / GIB:.2f} GiB) in host memory and "
                     "broadcasts them into the shards one tensor at a time")
    return lines


def swap_lines(config, plan, frozen_dtype, device):
    """With blocks swapped: on a CPU, that it saves nothing there; on a GPU, a warning where the host's free memory
    or its locked-memory limit (ulimit -l: pinned memory) is below what they take. Said before the weights load."""
    if not plan.blocks_to_swap:
        return []
    if device.type != "cuda":
        return [f"--blocks_to_swap on a CPU: the {plan.blocks_to_swap} blocks are held apart and copied in and out "
                "around each use as on a GPU, but host and device memory are one here: it saves nothing"]
    (pinned, pageable), lines = swap_host_bytes(config, plan, frozen_dtype), []
    free, locked = host_memory(), locked_memory_limit()
    if free is not None and pinned + pageable > free:
        lines.append(f"warning: the swapped blocks take {(pinned + pageable) / GIB:.1f} GiB of host memory and the "
                     f"host has {free / GIB:.1f} GiB free: close other programs, or pass --frozen_dtype int8 (half the "
                     "bytes)")
    if locked is not None and pinned > locked:
        lines.append(f"warning: the swapped blocks pin {pinned / GIB:.1f} GiB of host memory and the locked-memory "
                     f"limit is {locked / GIB:.2f} GiB (ulimit -l): where pinning is refused the copies go from "
                     "pageable memory, more slowly (ulimit -l unlimited, or a container's --ulimit memlock=-1)")
    return lines


def optimizer_bytes(config, optimizer, trained):
    if not trained:
        return 0
    if optimizer == "muon":  # one momentum for the blocks' matrices, AdamW's two moments for the rest
        matrices = sum(p.numel() for p in meta_model(config).block_matrices_and_rest()[0])
        return 4 * matrices + 8 * (trained - matrices) if trained >= matrices else 8 * trained
    return OPTIMIZER_BYTES[optimizer] * trained


def device_memory(device):
    """Bytes of memory the run may use: on a GPU what is free (other processes' memory is not the run's) plus what
    torch holds reserved for this process already (the components), within the share of the card the process may
    take (torch.cuda.set_per_process_memory_fraction: a large GPU standing in for a small card); on a CPU the
    machine's RAM (inf where the system does not say: nothing is planned to fit it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        try:
            fraction = torch.cuda.get_per_process_memory_fraction(device)
        except (RuntimeError, AttributeError, AssertionError):  # no cap set, or a torch that has no such call
            fraction = 1.0
        return min(free + torch.cuda.memory_reserved(device), fraction * total)
    return system_memory("SC_PHYS_PAGES") or math.inf


def system_memory(pages):
    """`pages` ("SC_PHYS_PAGES": all of it; "SC_AVPHYS_PAGES": what is free) of this machine's RAM in bytes, or None
    where os.sysconf does not tell (Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
    except (AttributeError, ValueError, OSError):
        return None


def host_memory():
    """Bytes of host memory free for the run now (Linux: MemAvailable, which counts the page cache it may take back),
    or None where the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return system_memory("SC_AVPHYS_PAGES")


def locked_memory_limit():
    """The locked-memory limit in bytes (ulimit -l: what pinned memory may take), or None where there is none or the
    system has no such limit (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def peak_rss():
    """This process's peak resident memory so far, in bytes (Linux reports KiB), or None where the system does not
    say (Windows: no `resource` module)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


LEVERS = ("--gradient_checkpointing 1 (or auto)", "--batch_size", "--frozen_dtype int8", "--blocks_to_swap auto",
          "--optimizer adamw8bit", "--trained_dtype bf16", "--step_in_backward 1", "--fsdp 1")


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


def describe(parts, available, where, label="memory estimate per process", levers=LEVERS):
    """The log line (`label`: what is estimated), and the warning line naming `levers` where the total exceeds
    what the device has (or None)."""
    total = sum(parts.values())
    shown = ", ".join(f"{name} {value / GIB:.2f}" for name, value in parts.items() if value)
    size = "unknown size" if math.isinf(available) else f"{available / GIB:.0f} GiB"
    line = f"{label}: {total / GIB:.1f} GiB ({shown} GiB) on {where} of {size}"
    if total <= available:
        return line, None
    return line, (f"warning: the estimate ({total / GIB:.1f} GiB) exceeds the {available / GIB:.0f} GiB of {where}; "
                  f"levers: {', '.join(levers)}")


# ----------------------------------------------------------------------------------------------------------------
# Sample grids while blocks are swapped


# What a forward without gradients holds at its peak beyond its weights (bench/bench_inference_memory.py, fp32 on a
# CPU, the larger of 512 and 1024 px, rounded up): values per token and unit of width in one transformer block
# (measured 10.7 and 11.4), and per pixel in SD3's VAE (decode 994 and 960; encode 640 at 512 px)
INFERENCE_WORDS = 12
VAE_DECODE_VALUES = 994
VAE_ENCODE_VALUES = 641


def sampling_fit(config, room, swapped, prompts, tokens, decode_bytes):
    """How a sample grid fits `room` bytes of the device beside what the run holds -> (prompts a forward, swapped
    blocks that still stream): the most prompts a forward (all of them, else halved until they fit with every
    swapped block streaming), then as few blocks streamed as the rest of the room allows, the others brought in
    once for the grid. `swapped`: (how many, bytes a block); `tokens`: a forward's tokens a sample (image and text);
    `decode_bytes`: the VAE's decode of one image (after the forwards, while the kept blocks are still in)."""
    count, block_bytes = swapped
    per_forward = prompts
    while per_forward > 1 and sampling_need(config, per_forward, tokens, decode_bytes) > room:
        per_forward = (per_forward + 1) // 2
    spare = room - sampling_need(config, per_forward, tokens, decode_bytes)
    kept = max(0, min(count, int(spare // block_bytes))) if block_bytes else count
    return per_forward, count - kept


def sampling_need(config, prompts, tokens, decode_bytes):
    """The larger of a guided forward's activations for `prompts` (two samples each: with and without the text,
    bf16) and the VAE's decode of one image."""
    return max(INFERENCE_WORDS * 2 * prompts * tokens * config.inner_dim * 2, decode_bytes)


def sampling_room(device):
    """What a sample grid may take of a GPU now: AUTO_SHARE of its memory less what the run holds, counting the
    free memory of CUDA graphs' pools (--cuda_graph: a captured step's temporaries), which only a replay reuses."""
    return AUTO_SHARE * device_memory(device) - torch.cuda.memory_allocated(device) - graph_pools_free(device)


def graph_pools_free(device):
    """Bytes free in the private memory pools of CUDA graphs on `device` (none without a captured graph)."""
    index = torch.device(device).index or 0
    return sum(segment["total_size"] - segment["allocated_size"] for segment in torch.cuda.memory_snapshot()
               if segment["device"] == index and tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0))


# ----------------------------------------------------------------------------------------------------------------
# Building the cache: the VAE and text encoders, before the transformer is loaded


def cache_build_estimate(encoders, streamed, batch, resolution, value_bytes, device_type):
    """-> {part: bytes} of the device's peak while the cache is built: the VAE and each text encoder as it runs
    (`encoders`: {name: (bytes whole, bytes of its layers, bytes of the buffers they stream through)}), whole, or for
    those in `streamed` all but their layers, which come in through their buffers (model/block_swap.py); the VAE
    encoder's activations for `batch` images of `resolution` px (VAE_ENCODE_VALUES a pixel, of `value_bytes`); and
    the runtime."""
    parts = {}
    for name, (whole, layers, buffers) in encoders.items():
        parts[name + (" streamed" if name in streamed else "")] = whole - layers + buffers \
            if name in streamed else whole
    parts["VAE activations"] = VAE_ENCODE_VALUES * value_bytes * batch * resolution ** 2
    parts["runtime"] = RUNTIME[device_type]
    return parts


def cache_build_plan(encoders, batch, resolution, memory_bytes, device_type):
    """-> (the text encoders whose layers stream, the estimate's parts: cache_build_estimate) for a device of
    `memory_bytes`: none where the whole set fits AUTO_SHARE of it, else the largest first until it does (none on a
    CPU)."""
    value_bytes = 2 if device_type == "cuda" else 4
    streamable = sorted((name for name, (_, layers, _) in encoders.items() if layers), key=lambda n: -encoders[n][1])
    streamed = []
    parts = cache_build_estimate(encoders, streamed, batch, resolution, value_bytes, device_type)
    while device_type == "cuda" and streamable and sum(parts.values()) > AUTO_SHARE * memory_bytes:
        streamed.append(streamable.pop(0))
        parts = cache_build_estimate(encoders, streamed, batch, resolution, value_bytes, device_type)
    return tuple(streamed), parts


def fit_cache_build(encoders, batch, resolution, device, log):
    """What encoding holds on `device` (the cache, the validation images, the grids' prompts), planned and logged
    -> the text encoders whose layers stream (cache_build_plan). Streaming T5-XXL copies its 9 GB in bf16 to the GPU
    for every batch it encodes (about 0.4 s at 25 GB/s) and computes what it would whole, bit for bit."""
    available = device_memory(device)
    streamed, parts = cache_build_plan(encoders, batch, resolution, available, device.type)
    line, warning = describe(parts, available, "this GPU's free memory" if device.type == "cuda" else
                             "this machine's RAM", "the VAE and text encoders at work (the cache, validation images, "
                             "prompts): memory estimate", ("--encode_batch_size 1", "a lower --resolution"))
    log(line + f"; {batch} image(s) at a time (--encode_batch_size) at {resolution} px" +
        (f"; {', '.join(streamed)} streamed by layer from host memory" if streamed else ""))
    if warning:
        log(warning)
    return streamed
