"""The loss that pretraining, full fine-tuning and LoRA train: rectified flow (model/rectified_flow.py) on one
micro-batch of images and captions, or of their cached features (dataset/cache.py); and what those stages' loops
train (FlowLearner)."""
from dataclasses import dataclass

import torch

from model.rectified_flow import add_noise, flow_loss, predict_velocity, sample_sigmas, to_device
from model.token_routing import TokenRouting


@dataclass(frozen=True, kw_only=True)
class FlowRecipe:
    """How the flow loss trains: what the model predicts, how the sigmas are drawn (scheme, logit-normal mean and
    std, shift), the loss and its weighting, the caption dropout, and the autocast dtype (None: fp32). A stage
    builds it from its arguments, whose values are its recipe. `routing`: the image tokens that skip some blocks
    (model/token_routing.py; off by default)."""
    prediction: str
    sigma_scheme: str
    logit_mean: float
    logit_std: float
    train_shift: float
    loss: str
    weighting: str
    caption_dropout: float
    autocast: torch.dtype = None
    routing: TokenRouting = TokenRouting()


@dataclass(frozen=True)
class FlowLearner:
    """What a flow-matching stage's loop trains: the model, and the model as its processes train it (`train_model`:
    DDP, or the model itself on one process and under FSDP), its optimizers, its EMA (or None), and what its loss
    reads (the components and the recipe)."""
    model: torch.nn.Module
    train_model: torch.nn.Module
    optimizers: list
    ema: object
    components: object
    recipe: FlowRecipe


def flow_matching_loss(model, components, batch, generator, recipe):
    """Encode (or read) the batch, drop captions, noise the latents at sampled sigmas and score the model's
    velocity (weighted by the batch's masks, if it has them), as `recipe` (FlowRecipe) says. `generator` draws
    the dropout, the latent sample, the noise, the sigmas and the routed tokens, in that order, so a resumed run
    draws the same."""
    device = next(model.parameters()).device
    with torch.no_grad():
        if "latents" in batch:  # from the cache
            features = {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # pinned: async
        else:
            features = components.encode(batch["image"].to(device, non_blocking=True), list(batch["caption"]))
        # Caption dropout per text encoder, independently (SD3): each is dropped with p ** (1 / encoders), so a
        # sample is fully unconditional with probability p (--caption_dropout).
        encoders = len(components.text_encoders)
        p_drop = recipe.caption_dropout ** (1 / encoders)
        drop = torch.rand(len(features["latents"]), encoders, generator=generator) < p_drop
        tokens, pooled = components.condition(features, to_device(drop, device))
        latents = components.latents(features, generator)
    noise = to_device(torch.randn(latents.shape, generator=generator), device)
    s = to_device(sample_sigmas(len(latents), recipe.sigma_scheme, recipe.logit_mean, recipe.logit_std,
                                shift=recipe.train_shift, generator=generator), device)
    route = recipe.routing.draw(latents, generator)
    dtype = recipe.autocast
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        pred = predict_velocity(model, add_noise(latents, noise, s), tokens, pooled, s, recipe.prediction, route)
    return flow_loss(pred, latents, noise, s, recipe.loss, recipe.weighting, mask=batch.get("mask"))
