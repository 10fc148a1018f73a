"""Rectified flow, as SD3 trains and samples it (REFERENCE section 3).

    x_t = (1 - s) * x0 + s * noise,    the velocity is v = noise - x0,    the model's timestep input is s * 1000.

The loss and the sampler work on velocities. The transformer outputs either v itself (prediction "v", SD3's own
and what published SD3 weights do) or the clean latent x0 (prediction "x"), turned into v by `to_velocity`.

This is the loss module of pretraining, full fine-tuning and LoRA, all of it in this file: `flow_matching_loss`
(one micro-batch: its caption dropout, noise, sigmas from `sample_sigmas`, the noisy latents from `add_noise`, the
model's velocity from `predict_velocity`) scored by `flow_loss` against the velocity target noise - x0, as a
FlowRecipe says. Sampling (Sampler, euler_sample) follows it.
"""
import math
from dataclasses import dataclass

import torch

from model.token_routing import TokenRouting, to_device


def shift_sigmas(s, shift):
    """SD3's resolution shift: pushes sigmas towards the noisy end for shift > 1."""
    return shift * s / (1 + (shift - 1) * s)


def sample_sigmas(n, scheme="logit_normal", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, shift=1.0,
                  generator=None):
    """Training sigmas in (0, 1), on the CPU (the generator's device): logit-normal (SD3's default), uniform, or
    'mode' (mode_scale)."""
    if scheme == "logit_normal":
        s = torch.sigmoid(torch.randn(n, generator=generator) * logit_std + logit_mean)
    elif scheme == "uniform":
        s = torch.rand(n, generator=generator)
    elif scheme == "mode":
        u = torch.rand(n, generator=generator)
        s = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    else:
        raise ValueError(f"unknown sigma scheme {scheme!r}: use logit_normal, uniform or mode")
    return shift_sigmas(s, shift) if shift != 1.0 else s


PREDICTIONS = ("x", "v")
X_PREDICTION_MIN_SIGMA = 0.05


def to_velocity(out, x_t, s, prediction):
    """The velocity a model output stands for. "v": the output is v. "x": the output is the clean latent x0, and
    v = (x_t - x0) / s. A small model learns x more easily where the latent is pixels: clean images are
    simple, while v carries the full-dimensional noise (JiT, Li & He 2025). s is clamped so the division stays
    bounded near the data end."""
    if prediction == "v":
        return out
    if prediction != "x":
        raise ValueError(f"unknown prediction {prediction!r}: use x or v")
    s = s.float().clamp(min=X_PREDICTION_MIN_SIGMA).reshape(-1, *[1] * (x_t.dim() - 1))
    return (x_t.float() - out.float()) / s


def predict_velocity(model, x_t, tokens, pooled, s, prediction, route=None):
    """The model's velocity at noisy latents x_t and sigmas s [B] (its timestep input is s * 1000); `route`: the
    image tokens a training forward routes past some blocks (model/token_routing.py), or None."""
    # unrouted: the plain call, which a diffusers model (no `route` argument) takes too
    out = model(x_t, tokens, pooled, s * 1000) if route is None else model(x_t, tokens, pooled, s * 1000, route=route)
    return to_velocity(out, x_t, s, prediction)


def add_noise(x0, noise, s):
    s = s.view(-1, *[1] * (x0.dim() - 1))
    return (1 - s) * x0 + s * noise


def mask_to_latents(mask, size):
    """A [B, 1, H, W] image mask averaged down to the latents' size (h, w): each latent's share of the weight."""
    return torch.nn.functional.adaptive_avg_pool2d(mask.float(), tuple(size))


HUBER_C = 0.03  # the pseudo-Huber loss's width: quadratic below it, linear above


def squared_error(diff):
    return diff.pow(2)


def pseudo_huber(diff):
    """Quadratic near zero, linear for large errors."""
    return torch.sqrt(diff.pow(2) + HUBER_C ** 2) - HUBER_C


def no_weight(s):
    return torch.ones_like(s)


def sigma_sqrt_weight(s):
    return s.clamp(min=1e-3) ** -2


def cosmap_weight(s):
    return 2 / (math.pi * (1 - 2 * s + 2 * s ** 2))


# --loss and --weighting (their choices are these keys): a new loss or weighting is one entry here, a function of
# the prediction's error (fp32, elementwise) or of the sigmas [B]
LOSSES = {"mse": squared_error, "huber": pseudo_huber}
WEIGHTINGS = {"none": no_weight, "sigma_sqrt": sigma_sqrt_weight, "cosmap": cosmap_weight}


def flow_loss(pred, x0, noise, s, loss_type="mse", weighting="none", mask=None):
    """Per-batch loss in fp32: LOSSES[loss_type] of the error, each sample's mean weighted by WEIGHTINGS[weighting]
    of its sigma. `mask` [B, 1, H, W] (any size: averaged to the latents'): each sample's loss is its mask-weighted
    mean, so a zero region gives no loss and no gradient."""
    for kind, value, table in (("loss", loss_type, LOSSES), ("weighting", weighting, WEIGHTINGS)):
        if value not in table:
            raise ValueError(f"unknown {kind} {value!r}: use {', '.join(table)}")
    target = (noise - x0).float()
    error = LOSSES[loss_type](pred.float() - target)
    if mask is None:
        per_sample = error.flatten(1).mean(1)
    else:
        weight = mask_to_latents(mask.to(error.device, non_blocking=True), error.shape[-2:]).expand_as(error)
        per_sample = (error * weight).flatten(1).sum(1) / weight.flatten(1).sum(1).clamp(min=1e-8)
    return (WEIGHTINGS[weighting](s.float()) * per_sample).mean()


# ----------------------------------------------------------------------------------------------------------------
# The loss a flow-matching stage trains (pretraining, full fine-tuning, LoRA)


@dataclass(frozen=True, kw_only=True)
class FlowSettings:
    """What the flow-matching losses share (FlowRecipe, and Flow-DPO's DPORecipe): what the model predicts, how the
    sigmas are drawn (scheme, logit-normal mean and std, shift), the autocast dtype (None: fp32), and `routing`:
    the image tokens that skip some blocks (model/token_routing.py; off by default)."""
    prediction: str
    sigma_scheme: str
    logit_mean: float
    logit_std: float
    train_shift: float
    autocast: torch.dtype = None
    routing: TokenRouting = TokenRouting()


@dataclass(frozen=True, kw_only=True)
class FlowRecipe(FlowSettings):
    """How the flow loss trains: FlowSettings, and the loss and its weighting (LOSSES, WEIGHTINGS) and the caption
    dropout. A stage builds it from its arguments, whose values are its recipe."""
    loss: str
    weighting: str
    caption_dropout: float


def flow_matching_loss(model, components, batch, generator, recipe):
    """Encode (or read) the batch, drop captions, noise the latents at sampled sigmas and score the model's
    velocity (weighted by the batch's masks, if it has them), as `recipe` (FlowRecipe) says: flow_inputs, then
    flow_loss_of."""
    return flow_loss_of(model, flow_inputs(model, components, batch, generator, recipe), recipe)


def flow_inputs(model, components, batch, generator, recipe):
    """A batch's part of the flow loss that is not the model's: its latents, text and masks on the model's device,
    the captions dropped and the noise, sigmas and routed tokens drawn -> {name: tensor or None} for flow_loss_of.
    `generator` draws the dropout, the latent sample, the noise, the sigmas and the routed tokens, in that order,
    so a resumed run draws the same; they are drawn on the host, so a captured step (--cuda_graph) replays the
    same random streams as an eager one."""
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
    # the text: read from the features, or where text encoders train (their ids), their forward, with gradients
    tokens, pooled = components.condition(features, to_device(drop, device))
    with torch.no_grad():
        latents = components.latents(features, generator)
    noise = to_device(torch.randn(latents.shape, generator=generator), device)
    s = to_device(sample_sigmas(len(latents), recipe.sigma_scheme, recipe.logit_mean, recipe.logit_std,
                                shift=recipe.train_shift, generator=generator), device)
    mask = batch.get("mask")
    return {"latents": latents, "tokens": tokens, "pooled": pooled, "noise": noise, "sigmas": s,
            "mask": None if mask is None else mask.to(device, non_blocking=True),
            "route": recipe.routing.draw(latents, generator)}


def flow_loss_of(model, inputs, recipe):
    """The flow loss of `inputs` (flow_inputs): the model's velocity at the noised latents, scored against the
    target (weighted by the masks, if any) -> a scalar in fp32. Device work alone: what a CUDA graph captures."""
    latents, noise, s = inputs["latents"], inputs["noise"], inputs["sigmas"]
    dtype = recipe.autocast
    with torch.autocast(latents.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        pred = predict_velocity(model, add_noise(latents, noise, s), inputs["tokens"], inputs["pooled"], s,
                                recipe.prediction, inputs["route"])
    return flow_loss(pred, latents, noise, s, recipe.loss, recipe.weighting, mask=inputs["mask"])


# ----------------------------------------------------------------------------------------------------------------
# Sampling


def sampling_sigmas(steps, shift=3.0, device="cpu"):
    """steps + 1 sigmas from 1 to 0, shifted like SD3's FlowMatchEulerDiscreteScheduler."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, device=device), shift)


def with_unconditional(tokens, pooled):
    """The text batched twice, conditioned then unconditional (zero text): one forward for classifier-free
    guidance, whose output splits with .chunk(2) into (cond, uncond)."""
    return torch.cat([tokens, torch.zeros_like(tokens)]), torch.cat([pooled, torch.zeros_like(pooled)])


@dataclass(frozen=True)
class Sampler:
    """How images are drawn: their size (`resolution`), the Euler steps, the classifier-free guidance scale, the
    sigmas' shift, what the model outputs (`prediction`, see to_velocity), whether each step re-noises its clean
    estimate (`renoise`: a distilled few-step generator), the dtype the transformer computes in (`autocast`,
    None: fp32), and how many prompts a forward takes (`batch`, 0: all of them; a small card draws a grid in parts).
    """
    resolution: int
    steps: int
    cfg: float
    shift: float
    prediction: str
    renoise: bool = False
    autocast: torch.dtype = None
    batch: int = 0

    def settings(self):
        """Its steps, guidance, shift and re-noising, as a weights record or a report keeps them."""
        return {"steps": self.steps, "cfg": self.cfg, "shift": self.shift, "renoise": self.renoise}


@torch.no_grad()
def euler_sample(model, noise, tokens, pooled, sampler, fresh_noise=None):
    """Integrate from noise (s=1) to data (s=0) in `sampler`'s steps, with its classifier-free guidance against the
    zero (unconditional) text. With `fresh_noise` (a function -> noise shaped like the latents), each step instead
    predicts the clean latent x0 = x - s * v and noises it afresh to the next sigma: how a few-step distilled
    generator samples (diffusers' FlowMatchEulerDiscreteScheduler with stochastic_sampling)."""
    x, cfg, prediction = noise, sampler.cfg, sampler.prediction
    sigmas = sampling_sigmas(sampler.steps, sampler.shift, device=noise.device)
    use_cfg = cfg != 1.0
    if use_cfg:
        tokens, pooled = with_unconditional(tokens, pooled)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        model_in = torch.cat([x, x]) if use_cfg else x
        v = predict_velocity(model, model_in, tokens, pooled, s.expand(model_in.shape[0]), prediction).float()
        if use_cfg:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + cfg * (v_cond - v_uncond)
        if fresh_noise is None:
            x = x + (s_next - s) * v
        else:
            x = x - s * v
            if s_next > 0:
                x = (1 - s_next) * x + s_next * fresh_noise()
    return x
