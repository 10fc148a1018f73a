"""The losses that distillation (trainer/train_distill.py) trains: DMD2 (Yin et al. 2024; REFERENCE section 5) on
rectified flow. Three transformers start as the teacher:

    teacher     frozen: the real score, with classifier-free guidance (at the sigmas of --guidance_interval)
    fake score  trained with the ordinary flow loss on the generator's samples (detached): the score of what the
                generator draws
    generator   a few-step sampler, trained with the distribution-matching loss: its samples move along
                x0_fake - x0_real, towards where the teacher (guided) would denoise them and away from where the
                fake score does

Every score is read as a clean-latent estimate x0 = x_t - s * v in fp32 (rectified_flow.to_velocity gives v for
x- and v-predicting weights alike), so one conversion serves both. The generator samples like the teacher's
sampler, on fixed shifted sigmas, but each step predicts x0 and re-noises it with fresh noise to the next sigma
(model/rectified_flow.py euler_sample with fresh noise); during training it starts from its own earlier steps,
drawn without gradients ("backward simulation").
"""
import contextlib
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.rectified_flow import (
    add_noise, flow_loss, predict_velocity, sampling_sigmas, shift_sigmas, to_device, with_unconditional,
)
from model.token_routing import TokenRouting


@dataclass(frozen=True, kw_only=True)
class DistillRecipe:
    """How the distillation losses train: the teacher's prediction, the autocast dtype (None: fp32), the generator's
    steps and shift, the shift and range of the sigmas the scores compare at, the teacher's guidance and where it
    applies, and the GAN terms' weights (0: off). The stage builds it from its arguments."""
    prediction: str
    autocast: torch.dtype = None
    gen_steps: int
    gen_shift: float
    score_shift: float
    real_guidance: float
    guidance_interval: tuple
    min_sigma: float
    max_sigma: float
    gan_weight: float
    gan_d_weight: float
    routing: TokenRouting = TokenRouting()

    def sigmas(self):
        """The generator's fixed sigmas (generator_sigmas), as numbers, as its log and its record list them."""
        return [round(s, 6) for s in generator_sigmas(self.gen_steps, self.gen_shift).tolist()]


@dataclass
class Networks:
    """The stage's networks: each trained one as a module (no-gradient forwards) and as what trains it (DDP or
    FSDP, trainer/mechanics/distributed.py); `head` is the GAN discriminator head, or None."""
    teacher: nn.Module
    generator: nn.Module
    generator_train: nn.Module
    fake: nn.Module
    fake_train: nn.Module
    head: nn.Module = None
    head_train: nn.Module = None


@dataclass(frozen=True)
class DistillLearner:
    """What the distillation loop trains: the networks (Networks), each trained one's optimizer by name
    ("generator", "fake_score", "gan_head"), the generator's EMA (or None), and what the losses read."""
    nets: Networks
    optimizers: dict
    ema: object
    components: object
    recipe: DistillRecipe


class GANHead(nn.Module):
    """The discriminator: a small MLP on the fake score's image tokens after its middle block, averaged over the
    tokens -> one logit per sample (DMD2 puts a small classifier on its fake UNet's bottleneck)."""

    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, tokens):
        return self.net(tokens.float().mean(1)).squeeze(1)


@contextlib.contextmanager
def middle_features(model):
    """While the block runs, `found["tokens"]` holds the image tokens that `model`'s middle block put out last."""
    found = {}
    block = model.transformer_blocks[len(model.transformer_blocks) // 2]
    handle = block.register_forward_hook(lambda module, args, out: found.__setitem__("tokens", out[0]))
    try:
        yield found
    finally:
        handle.remove()


def generator_sigmas(steps, shift):
    """The generator's fixed sigmas, from 1: the teacher sampler's `steps` + 1 shifted sigmas without the final 0
    (4 steps, shift 3: 1, 0.9, 0.75, 0.5)."""
    return sampling_sigmas(steps, shift)[:-1]


def score_sigmas(n, shift, lowest, highest, rng):
    """Sigmas at which the scores are compared and the fake score trains: uniform, shifted like sampling, clamped
    away from the ends (CausVid's rectified-flow DMD)."""
    return shift_sigmas(torch.rand(n, generator=rng), shift).clamp(lowest, highest)


def generator_step(step, gen_steps, seed):
    """Which of its steps the generator trains at `step`: drawn from (seed, step) alone, so every rank and a resumed
    run pick the same."""
    return random.Random(seed * 1_000_003 + step).randrange(gen_steps)


def velocity(model, x_t, tokens, pooled, s, recipe, route=None):
    """predict_velocity of the recipe's prediction in its autocast dtype (None = fp32), routed as `route` says
    (None: every token)."""
    dtype = recipe.autocast
    with torch.autocast(x_t.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        return predict_velocity(model, x_t, tokens, pooled, s, recipe.prediction, route)


def predict_x0(model, x_t, tokens, pooled, s, recipe, route=None):
    """A score's clean-latent estimate x0 = x_t - s * v, in fp32."""
    v = velocity(model, x_t, tokens, pooled, s, recipe, route)
    return x_t.float() - s.float().view(-1, 1, 1, 1) * v.float()


def guided_x0(teacher, x_t, tokens, pooled, sigmas, recipe):
    """The teacher's x0 with classifier-free guidance (recipe.real_guidance) against the zero (unconditional) text
    for the samples whose sigma lies in recipe.guidance_interval (lowest, highest], its plain conditional x0
    elsewhere (guidance in a limited interval, Kynkaanniemi et al. 2024); guidance acts on x0 as on v, since x0 is
    affine in v. `sigmas`: as drawn, on the host, where whether any lies inside is decided (no read of the
    device)."""
    guidance, interval = recipe.real_guidance, recipe.guidance_interval
    inside = (sigmas > interval[0]) & (sigmas <= interval[1])
    s = to_device(sigmas, x_t.device)
    if guidance == 1.0 or not bool(inside.any()):
        return predict_x0(teacher, x_t, tokens, pooled, s, recipe)
    both = predict_x0(teacher, torch.cat([x_t, x_t]), *with_unconditional(tokens, pooled), torch.cat([s, s]),
                      recipe)
    cond, uncond = both.chunk(2)
    scale = to_device(torch.where(inside, guidance, 1.0), x_t.device).view(-1, 1, 1, 1).to(cond)
    return uncond + scale * (cond - uncond)


def generate(nets, noise, text, k, rng, recipe, grad):
    """Backward simulation: the generator's steps 0..k-1 from `noise` without gradients (each x0 re-noised to the
    next sigma with fresh noise), then its step k, with gradients if `grad` (then its tokens routed as the recipe
    says, drawn last) -> x0 of step k (fp32). `text`: the (tokens, pooled) it is conditioned on."""
    x, (tokens, pooled) = noise, text
    sigmas = to_device(generator_sigmas(recipe.gen_steps, recipe.gen_shift), noise.device)
    with torch.no_grad():
        for j in range(k):
            x0 = predict_x0(nets.generator, x, tokens, pooled, sigmas[j].expand(len(x)), recipe)
            x = add_noise(x0, to_device(torch.randn(x.shape, generator=rng), x.device), sigmas[j + 1].expand(len(x)))
    route = recipe.routing.draw(x, rng) if grad else None
    with torch.set_grad_enabled(grad):
        return predict_x0(nets.generator_train if grad else nets.generator, x, tokens, pooled,
                          sigmas[k].expand(len(x)), recipe, route)


def dmd_direction(x0_gen, x0_real, x0_fake):
    """DMD2's gradient for the generator's sample: (p_real - p_fake) / mean|p_real| per sample, with
    p = x0_gen - x0_score; that is x0_fake - x0_real, normalised by how far the teacher would move the sample."""
    p_real, p_fake = x0_gen - x0_real, x0_gen - x0_fake
    return torch.nan_to_num((p_real - p_fake) / p_real.abs().mean(dim=(1, 2, 3), keepdim=True))


def dmd_loss(nets, x0_gen, tokens, pooled, sigmas, noise, recipe):
    """The distribution-matching loss: 0.5 * mse(x, x - grad) with grad fixed, whose gradient in x is `grad`
    (dmd_direction) over the number of elements. Both scores see the noised sample without gradients. `sigmas`: on
    the host, as drawn (the teacher's guidance is decided there)."""
    s = to_device(sigmas, noise.device)
    with torch.no_grad():
        x_t = add_noise(x0_gen.detach(), noise, s)
        x0_real = guided_x0(nets.teacher, x_t, tokens, pooled, sigmas, recipe)
        x0_fake = predict_x0(nets.fake, x_t, tokens, pooled, s, recipe)
        grad = dmd_direction(x0_gen.detach(), x0_real, x0_fake)
    return 0.5 * F.mse_loss(x0_gen, (x0_gen - grad).detach())


def gan_generator_loss(nets, x0_gen, tokens, pooled, s, noise, recipe):
    """The generator's GAN term, gan_weight * softplus(-D(sample)), whose gradient reaches the generator alone: its
    gradient in the sample is taken through the fake score and the head (their weights untouched), then applied
    to x0_gen by a surrogate whose value is the term and whose gradient in x0_gen is that gradient."""
    sample = x0_gen.detach().requires_grad_(True)
    with torch.enable_grad(), middle_features(nets.fake) as found:
        velocity(nets.fake, add_noise(sample, noise, s), tokens, pooled, s, recipe)
        loss = recipe.gan_weight * F.softplus(-nets.head(found["tokens"])).mean()
        (grad,) = torch.autograd.grad(loss, sample)
    pull = (x0_gen * grad.detach()).sum()
    return pull - pull.detach() + loss.detach()


def fake_score_loss(nets, x0_gen, real, text, s, noise, recipe):
    """The fake score's flow loss on the detached generator sample at sigmas `s`, conditioned on `text` (tokens,
    pooled). With the GAN on, the head learns on the same forward, real latents noised alike: gan_d_weight *
    (softplus(D(generated)) + softplus(-D(real))). -> (flow loss, GAN loss or None)."""
    tokens, pooled = text
    x0 = x0_gen.detach()
    if nets.head is None:
        v = velocity(nets.fake_train, add_noise(x0, noise, s), tokens, pooled, s, recipe)
        return flow_loss(v, x0, noise, s), None
    with middle_features(nets.fake) as found:
        x_t = torch.cat([add_noise(x0, noise, s), add_noise(real, noise, s)])
        v = velocity(nets.fake_train, x_t, torch.cat([tokens, tokens]), torch.cat([pooled, pooled]),
                     torch.cat([s, s]), recipe)
        logits_fake, logits_real = nets.head_train(found["tokens"]).chunk(2)
    gan = F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()
    return flow_loss(v[:len(x0)], x0, noise, s), recipe.gan_d_weight * gan


def distillation_flops(throughput, batch, k, update_generator, recipe, gan):
    """FLOPs of distillation_losses on `batch` (trainer/mechanics/metrics.Throughput): the generator's k steps without
    gradients and its step k (trained on update steps, routed then); on update steps the teacher (twice with
    guidance above 1, counted as if every sigma were inside its interval), the fake score, and with the GAN
    (`gan`) the fake score's forward and its input gradients to the sample (counted as two forwards; the head's
    few FLOPs left out); the fake score's training forward and backward (real latents too with the GAN)."""
    scores = throughput.unrouted()
    flops = throughput.flops(batch, samples=k, grad=False) + throughput.flops(batch, grad=update_generator)
    if update_generator:
        flops += scores.flops(batch, samples=2 if recipe.real_guidance != 1.0 else 1, grad=False)
        flops += scores.flops(batch, grad=False)
        if gan:
            flops += scores.flops(batch, samples=2, grad=False)
    return (flops + scores.flops(batch, samples=2 if gan else 1)).model


def distillation_losses(nets, components, batch, rng, k, update_generator, recipe):
    """One micro-batch: encode (or read) it, let the generator draw from noise (its step k; with gradients on
    generator-update steps), then the losses -> {"fake_score", "gan_d" (GAN on), and on update steps "dmd",
    "gan_g" (GAN on)}, weighted: backward takes their sum, and each reaches its own network only. `rng` draws,
    in order: the latents, the noise, the re-noising, the student's route (routing on, update steps), the sigmas
    and noise of the losses."""
    device = next(nets.generator.parameters()).device
    with torch.no_grad():
        features = {key: value.to(device, non_blocking=True) for key, value in batch.items()} if "latents" in \
            batch else components.encode(batch["image"].to(device, non_blocking=True), list(batch["caption"]))
        tokens, pooled = components.condition(features)
        real = components.latents(features, rng)
    n = len(real)
    noise = to_device(torch.randn(real.shape, generator=rng), device)
    x0_gen = generate(nets, noise, (tokens, pooled), k, rng, recipe, grad=update_generator)
    losses = {}
    if update_generator:
        sigmas = score_sigmas(n, recipe.score_shift, recipe.min_sigma, recipe.max_sigma, rng)  # (on the host)
        noise = to_device(torch.randn(real.shape, generator=rng), device)
        losses["dmd"] = dmd_loss(nets, x0_gen, tokens, pooled, sigmas, noise, recipe)
        if nets.head is not None:
            losses["gan_g"] = gan_generator_loss(nets, x0_gen, tokens, pooled, to_device(sigmas, device), noise,
                                                 recipe)
    s = to_device(score_sigmas(n, recipe.score_shift, recipe.min_sigma, recipe.max_sigma, rng), device)
    noise = to_device(torch.randn(real.shape, generator=rng), device)
    losses["fake_score"], gan_d = fake_score_loss(nets, x0_gen, real, (tokens, pooled), s, noise, recipe)
    if gan_d is not None:
        losses["gan_d"] = gan_d
    return losses
