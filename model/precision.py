"""Which precision a run computes in. --dtype auto (the default): bf16 autocast on a GPU, fp32 on a CPU. --dtype fast:
bf16 on a GPU, and on a CPU only where a quick check at start-up finds bf16 faster than fp32 there (CPUs with native
bf16, AVX512-BF16 or AMX, run its matrix products about twice as fast; on others bf16 is emulated and slower).
Measured, not guessed from CPU flags. It is not auto's choice on a CPU: the main job in bf16 reached the same
held-out loss but a lower held-out score (BENCHMARKS.md)."""
import functools
import time
from dataclasses import dataclass

import torch

from model.errors import UserError

CHECK_WIDTH, CHECK_ROWS, CHECK_ROUNDS = 192, 1024, 9  # a tiny block's MLP on a batch's tokens
BF16_MARGIN = 0.8  # bf16 is taken when its step takes at most this fraction of fp32's


def mlp_step(x, up, down, bf16):
    """One forward + backward of a transformer MLP (width -> 4 width -> width, GELU), in fp32 or under CPU bf16
    autocast: what a training step spends most of its time on. -> seconds."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, up)), down)
    y.float().square().mean().backward()
    return time.perf_counter() - t0


@functools.cache
def cpu_bf16_speedup(width=CHECK_WIDTH, rows=CHECK_ROWS, rounds=CHECK_ROUNDS):
    """fp32 time / bf16 time of the check on this CPU (above 1: bf16 is faster), measured once per process. The
    two alternate round by round, so a busy moment slows both alike; the medians compare."""
    generator = torch.Generator().manual_seed(0)
    up = torch.randn(4 * width, width, generator=generator).div_(width ** 0.5).requires_grad_()
    down = torch.randn(width, 4 * width, generator=generator).div_((4 * width) ** 0.5).requires_grad_()
    x = torch.randn(rows, width, generator=generator)
    mlp_step(x, up, down, False), mlp_step(x, up, down, True)  # warm-up: first calls set kernels up
    times = {False: [], True: []}
    for _ in range(rounds):
        for bf16 in (False, True):
            times[bf16].append(mlp_step(x, up, down, bf16))
    fp32, bf16 = (sorted(times[b])[rounds // 2] for b in (False, True))
    return fp32 / bf16


def native_bf16(device):
    """Whether the GPU computes bf16 natively (compute capability 8.0 on: A100, RTX 30xx and later); V100 and T4
    emulate it."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def use_tf32(device):
    """fp32 matrix products on a GPU in TF32 (10-bit mantissa, on the tensor cores of the GPUs that have native
    bf16 too): what stays fp32 under bf16 autocast, and fp32 runs unless asked for (--dtype fp32). -> the log line,
    or None where nothing changed."""
    if device.type != "cuda" or not native_bf16(device):
        return None
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return "fp32 matrix products in TF32 (this GPU's tensor cores)"


def resolve_dtype(dtype, device, several_processes=False, cpu_bf16=True):
    """--dtype as what the run computes in -> ("bf16" or "fp32", why). auto: bf16 on a GPU, fp32 on a CPU. fast:
    bf16 on a GPU; on a CPU, bf16 where the check finds it faster, for one process (several processes on one CPU
    share its cores: that is the multi-GPU code path tried out, in fp32, the same on every rank whatever each
    one's check would time), and only where the stage allows it (`cpu_bf16`; see run_precision)."""
    if dtype in ("fp32", "bf16"):
        return dtype, "as asked"
    if device.type == "cuda" and not native_bf16(device):
        return "fp32", f"{dtype}: this GPU has no native bf16 (it would be emulated, slower than fp32)"
    if device.type == "cuda":
        return "bf16", f"{dtype} on a GPU"
    if dtype == "auto":
        return "fp32", "auto on a CPU"
    if not cpu_bf16:
        return "fp32", "fast: bf16 is not taken on a CPU in this stage"
    if several_processes:
        return "fp32", "fast with several processes on a CPU"
    speedup = cpu_bf16_speedup()
    return ("bf16" if speedup >= 1 / BF16_MARGIN else "fp32"), f"fast: bf16 ran at {speedup:.2f}x fp32's speed here"



def autocast_dtype(dtype, device):
    """--dtype as the autocast dtype on `device`, or None for plain fp32 (auto, fast: resolve_dtype; a run resolves
    it once at start, run_precision)."""
    return Precision(resolve_dtype(dtype, device)[0]).autocast

# ----------------------------------------------------------------------------------------------------------------
# The networks that do not train

FROZEN_DTYPES = ("auto", "bf16", "fp32", "int8")


def resolve_frozen_dtype(frozen, dtype_asked, device, sd3_components):
    """--frozen_dtype as what the frozen networks (a LoRA base, the DPO reference, the distillation teacher, the
    VAE and text encoders) are held in -> ("bf16", "fp32" or "int8", why). auto: bf16 with --base's SD3
    components or on a GPU (half the memory, and autocast no longer casts them at every use), unless --dtype fp32
    was asked for; fp32 for the built-in components on a CPU, as before."""
    if frozen != "auto":
        return frozen, "as asked"
    if dtype_asked == "fp32":
        return "fp32", "--dtype fp32"
    if sd3_components or device.type == "cuda":
        return "bf16", "SD3 components" if sd3_components else "on a GPU"
    return "fp32", "the built-in components on a CPU"


def torch_dtype(name):
    """'bf16' / 'fp32' -> the torch dtype the weights are held in (int8 weights are read as bf16 first)."""
    return torch.float32 if name == "fp32" else torch.bfloat16


def int8_weights(module):
    """Weight-only int8 (torchao) for every frozen nn.Linear in `module` that is not already quantised: a LoRA's
    base layers, never its adapters. Activations stay bf16; the weight is 1 byte a parameter."""
    quantization = import_torchao("--frozen_dtype int8").quantization

    def frozen_linear(layer, name):
        return isinstance(layer, torch.nn.Linear) and type(layer.weight) is torch.nn.Parameter and \
            not layer.weight.requires_grad and not name.endswith(("lora_A", "lora_B"))

    quantization.quantize_(module, quantization.Int8WeightOnlyConfig(), filter_fn=frozen_linear)


def import_torchao(what):
    """torchao (int8 weights, 8-bit AdamW), or a one-line error naming the fix where it is not installed."""
    import importlib

    try:
        torchao = importlib.import_module("torchao")
        importlib.import_module("torchao.quantization")
        importlib.import_module("torchao.optim")
    except ImportError:
        raise UserError(f"{what} needs torchao: pip install -r requirements.txt (or pip install torchao)") from None
    return torchao


# ----------------------------------------------------------------------------------------------------------------
# A run's precision, decided once


@dataclass(frozen=True)
class Precision:
    """What a run computes in (`compute`: "bf16" under autocast, or "fp32") and holds its frozen networks in
    (`frozen`: "bf16", "fp32" or "int8"), decided once at start-up (run_precision), with the lines that say so
    (`notes`, for the run's log)."""
    compute: str = "fp32"
    frozen: str = "fp32"
    notes: tuple = ()
    trained: str = "fp32"  # what the trained weights are held in (--trained_dtype)

    @property
    def autocast(self):
        """The autocast dtype of the forwards, or None for plain fp32."""
        return torch.bfloat16 if self.compute == "bf16" else None

    def as_args(self):
        """The two as the arguments they resolve: what a resume checkpoint records and compares."""
        return {"dtype": self.compute, "frozen_dtype": self.frozen}


@dataclass(frozen=True)
class StagePrecision:
    """What a stage allows: whether --dtype fast may take bf16 on a CPU (`cpu_bf16`: not where the loss compares two
    predictions closer than bf16 resolves), and whether it holds a transformer that does not train
    (`frozen_transformer`: a LoRA base, a teacher, a reference), which --frozen_dtype applies to and which, held in
    bf16 or int8, computes under bf16 autocast."""
    stage: str
    cpu_bf16: bool = True
    frozen_transformer: bool = False


def run_precision(dtype, frozen_dtype, stage, info, sd3_components=False, resumed=None, trained="fp32"):
    """--dtype and --frozen_dtype as a run of `stage` (StagePrecision) on info's processes holds them ->
    Precision, with its lines. `resumed`: what the run it resumes computed in, which --dtype fast keeps (its
    trajectory goes on as it began, whatever today's check says). `trained`: --trained_dtype (a full fine-tune's
    weights held in bf16 compute under bf16 autocast)."""
    compute, why = resolve_dtype(dtype, info.device, info.world_size > 1, stage.cpu_bf16)
    frozen, _ = resolve_frozen_dtype(frozen_dtype, dtype, info.device, sd3_components)
    if frozen == "int8" and not stage.frozen_transformer:
        raise UserError(f"--frozen_dtype int8 quantises a frozen transformer, and the {stage.stage} stage trains "
                        "every weight of its own: use it with trainer/train_lora.py, or drop it")
    if frozen == "int8" and info.sharded:
        raise UserError("--frozen_dtype int8 with --fsdp 1 is not supported: shard a bf16 base (--frozen_dtype bf16), "
                        "or train the int8 base without --fsdp (DDP)")
    if stage.frozen_transformer and frozen != "fp32" and compute == "fp32":
        if dtype == "fp32":
            raise UserError(f"--dtype fp32 with --frozen_dtype {frozen}: a transformer held in {frozen} computes in "
                            "bf16; drop --dtype fp32, or pass --frozen_dtype fp32")
        compute, why = "bf16", f"the frozen transformer is held in {frozen}"
        if info.device.type == "cuda" and not native_bf16(info.device):
            why += "; this GPU emulates bf16: --frozen_dtype fp32 computes in fp32 where memory allows"
    if trained == "bf16" and info.sharded:  # FSDP2's sharded bf16 gradients met fp32 norms across ranks here
        raise UserError("--trained_dtype bf16 with --fsdp 1 is not supported: FSDP already divides the fp32 state "
                        "over the processes; pass --trained_dtype fp32 (published weights' recipe holds bf16 weights "
                        "for one GPU), or drop --fsdp 1")
    if trained == "bf16" and compute == "fp32":
        if dtype == "fp32":
            raise UserError("--dtype fp32 with --trained_dtype bf16: weights held in bf16 compute in bf16; drop "
                            "--dtype fp32, or pass --trained_dtype fp32")
        compute, why = "bf16", "the trained weights are held in bf16"
    notes = []
    if dtype in ("auto", "fast") or why.startswith(("the frozen", "the trained")):
        notes.append(f"computing in {compute} ({why})")
    if stage.frozen_transformer or sd3_components:
        notes.append(f"frozen networks held in {frozen}")
    tf32 = use_tf32(info.device) if dtype != "fp32" else None
    if tf32:
        notes.append(tf32)
    if dtype == "fast" and resumed in ("bf16", "fp32") and resumed != compute:
        compute = resumed
        notes.append(f"computing in {resumed}, as the run it resumes did")
    if trained == "bf16":
        notes.append("trained weights, gradients and optimizer state held in bf16")
    return Precision(compute, frozen, tuple(notes), trained)
