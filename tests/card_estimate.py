"""The memory estimate of a stage's command on one GPU, as the stage logs it before the weights load
(model/memory.py), for the commands the README shows per card: the preset's transformer built on the meta device (no
file read), SD3's VAE as the components left once the cache is built (the text encoders are freed then)."""
from model.memory import GIB, RUNTIME, activation_bytes, estimate, fitted_checkpointing, kept_value_bytes
from model.model_sd3light import preset_config

SD3_VAE_BYTES = 83.82e6 * 2  # SD3's VAE, 83.82M parameters, held in bf16 (--frozen_dtype auto with --base)
SD3_DOWNSCALE = 8  # its latent is an eighth of the image's side
# What building the cache holds before the transformer loads: the text encoders (T5-XXL's encoder 4.76B, CLIP-G
# 695M, CLIP-L 123M parameters) and the VAE, in bf16, and the runtime
CACHE_BUILD_BYTES = (4.76e9 + 695e6 + 123e6) * 2 + SD3_VAE_BYTES + RUNTIME["cuda"]


def card_estimate(stage, args, card_bytes=24 * GIB):
    """Bytes one process is estimated to peak at on a CUDA GPU of `card_bytes` (what --gradient_checkpointing auto
    plans for) for `stage` (a LoRA or full fine-tune script module) parsed into `args`, while it trains."""
    config, plan = preset_config(args.preset), recomputed_plan(stage, args, card_bytes)
    activations = activation_bytes(config, args.batch_size, args.resolution, SD3_DOWNSCALE, 77 + args.t5_max_length,
                                   plan.checkpointing, kept_value_bytes("bf16", "cuda"))
    return sum(estimate(config, plan, frozen_of(args), 1, activations, SD3_VAE_BYTES, "cuda").values())


def frozen_of(args):
    return "bf16" if args.frozen_dtype == "auto" else args.frozen_dtype


def recomputed_plan(stage, args, card_bytes):
    """The stage's memory plan with --gradient_checkpointing auto resolved for a card of `card_bytes`, as
    model/memory.auto_checkpointing resolves it on the GPU."""
    config = preset_config(args.preset)
    plan = stage.memory_plan(args, config) if stage.__name__.endswith("lora") else stage.memory_plan(args)
    return fitted_checkpointing(config, plan, card_bytes, (frozen_of(args), 1, SD3_VAE_BYTES, "cuda"),
                                (SD3_DOWNSCALE, 77 + args.t5_max_length), kept_value_bytes("bf16", "cuda"))
