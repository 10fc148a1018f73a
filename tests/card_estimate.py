"""The memory estimates of a stage's command on one GPU, as the stage logs them (model/memory.py), for the commands
the README shows per card: while it trains (the preset's transformer built on the meta device, no file read; SD3's
VAE as the components left once the cache is built: the text encoders are freed then), and before that while the
cache is built (SD3's VAE and text encoders at their published sizes, in bf16)."""
import torch

from model.memory import GIB, activation_bytes, cache_build_plan, estimate, fitted_plan, kept_value_bytes
from model.model_sd3light import preset_config

SD3_VAE_BYTES = 83.82e6 * 2  # SD3's VAE, 83.82M parameters, held in bf16 (--frozen_dtype auto with --base)
SD3_DOWNSCALE = 8  # its latent is an eighth of the image's side
# T5-XXL's encoder: 4.76B parameters, of them 24 layers of 192.9M (attention 4 x 4096^2, the gated MLP 3 x 4096 x
# 10240) beside its 32128 x 4096 embedding
T5_LAYER = 4 * 4096 ** 2 + 3 * 4096 * 10240
# What building the cache holds, in bf16, as SD3Components.encoder_sizes gives it: (bytes whole, bytes of the layers
# that can stream, bytes of the buffers they stream through: the first layer, with the position bias, a shape alone,
# and two of the others)
SD3_ENCODERS = {"VAE": (SD3_VAE_BYTES, 0, 0), "CLIP-L": (123e6 * 2, 0, 0), "CLIP-G": (695e6 * 2, 0, 0),
                "T5": (4.76e9 * 2, 24 * T5_LAYER * 2, 3 * T5_LAYER * 2)}


def card_estimate(stage, args, card_bytes=24 * GIB):
    """Bytes one process is estimated to peak at on a CUDA GPU of `card_bytes` (what --gradient_checkpointing auto
    and --blocks_to_swap auto plan for) for `stage` (a LoRA or full fine-tune script module) parsed into `args`,
    while it trains."""
    config, plan = preset_config(args.preset), card_plan(stage, args, card_bytes)
    activations = activation_bytes(config, args.batch_size, args.resolution, SD3_DOWNSCALE, 77 + args.t5_max_length,
                                   plan.checkpointing, kept_value_bytes("bf16", "cuda"))
    return sum(estimate(config, plan, frozen_of(args), 1, activations, SD3_VAE_BYTES, "cuda").values())


def cache_estimate(args, card_bytes):
    """Bytes one process is estimated to peak at while it builds the cache on a CUDA GPU of `card_bytes`: the text
    encoders that fit whole, T5's layers streamed where they do not (model/memory.cache_build_plan)."""
    _, parts = cache_build_plan(SD3_ENCODERS, args.encode_batch_size, args.resolution, card_bytes, "cuda")
    return sum(parts.values())


def frozen_of(args):
    return "bf16" if args.frozen_dtype == "auto" else args.frozen_dtype


def card_plan(stage, args, card_bytes):
    """The stage's memory plan with --gradient_checkpointing auto and --blocks_to_swap auto resolved for a card of
    `card_bytes`, as model/memory.fit_memory resolves them on the GPU."""
    config = preset_config(args.preset)
    return fitted_plan(config, stage.memory_plan(args, config), card_bytes,
                       (frozen_of(args), 1, SD3_VAE_BYTES, "cuda"), (SD3_DOWNSCALE, 77 + args.t5_max_length),
                       kept_value_bytes("bf16", "cuda"))


class SD3ComponentsLeft:
    """What a stage's estimate reads of SD3's components once the cache is built: the VAE alone (on the meta device:
    no memory), its downscale and the text's length."""
    spec, downscale = {"kind": "sd3"}, SD3_DOWNSCALE

    def __init__(self, t5_max_length):
        self.t5_max_length = t5_max_length

    def parameters(self):
        return [torch.empty(int(SD3_VAE_BYTES / 2), dtype=torch.bfloat16, device="meta")]

    def buffers(self):
        return []


def logged_estimate(stage, args, card_bytes, monkeypatch):
    """The total of the estimate line the stage logs on a CUDA GPU of `card_bytes` (model/memory.fit_memory, on a
    device that only says it is CUDA), as text: what card_estimate must equal."""
    from model import memory
    from model.precision import Precision
    from trainer.mechanics.distributed import DistInfo

    monkeypatch.setattr(memory, "device_memory", lambda device: card_bytes)
    config, lines = preset_config(args.preset), []
    memory.fit_memory(config, stage.memory_plan(args, config), SD3ComponentsLeft(args.t5_max_length),
                      Precision("bf16", frozen_of(args)), DistInfo(device=torch.device("cuda")), lines.append)
    return next(line for line in lines if line.startswith("memory estimate per process:")).split()[4]
