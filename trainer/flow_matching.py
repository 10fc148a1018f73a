"""The loss that pretraining, full fine-tuning and LoRA train: rectified flow (model/rectified_flow.py) on one
micro-batch of images and captions, or of their cached features (dataset/cache.py)."""
import torch

from model.rectified_flow import add_noise, flow_loss, predict_velocity, sample_sigmas
from trainer.arguments import autocast_dtype


def flow_matching_loss(model, components, batch, generator, args):
    """Encode (or read) the batch, drop captions, noise the latents at sampled sigmas and score the model's
    velocity (weighted by the batch's masks, if it has them). `generator` draws the dropout, the latent sample,
    the noise and the sigmas, in that order, so a resumed run draws the same. The recipe comes from `args`:
    caption_dropout, sigma_scheme, logit_mean, logit_std, train_shift, prediction, loss, weighting and dtype
    (autocast)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        if "latents" in batch:  # from the cache
            features = {k: v.to(device) for k, v in batch.items()}
        else:
            features = components.encode(batch["image"].to(device), list(batch["caption"]))
        # Caption dropout per text encoder, independently (SD3): each is dropped with p ** (1 / encoders), so a
        # sample is fully unconditional with probability p (--caption_dropout).
        encoders = len(components.text_encoders)
        p_drop = args.caption_dropout ** (1 / encoders)
        drop = torch.rand(len(features["latents"]), encoders, generator=generator) < p_drop
        tokens, pooled = components.condition(features, drop.to(device))
        latents = components.latents(features, generator)
    noise = torch.randn(latents.shape, generator=generator).to(device)
    s = sample_sigmas(len(latents), args.sigma_scheme, args.logit_mean, args.logit_std, shift=args.train_shift,
                      generator=generator).to(device)
    dtype = autocast_dtype(args.dtype, device)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        pred = predict_velocity(model, add_noise(latents, noise, s), tokens, pooled, s, args.prediction)
    return flow_loss(pred, latents, noise, s, args.loss, args.weighting, mask=batch.get("mask"))
