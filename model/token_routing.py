"""Token routing (TREAD, Krause et al., ICCV 2025, arXiv 2501.04765), for training only.

During a training forward a random `ratio` of each sample's image tokens is set aside before block `first`; blocks
first..last run on the kept tokens (text tokens always join the joint attention), and the set-aside tokens rejoin
unchanged after block `last`. The loss still covers every token. The routed blocks then compute about `ratio` less
of their image tokens' linear layers and more than that less of the attention (its cost grows with the square of
the tokens); the text tokens cost what they did. Sampling, validation and exported weights never route: only the
training losses draw a route and pass it to the model.

The route is drawn from the run's generator (on the CPU, like the noise and the sigmas, then copied to the
latents' device without making the host wait), so a resumed run draws the same tokens as the uninterrupted one.
"""
from dataclasses import dataclass

import torch

from model.errors import UserError


def to_device(tensor, device):
    """A tensor drawn on the CPU (with a CPU generator: the same random streams on every device, so a run and its
    resume draw alike) on `device`, without making the host wait: a copy from pageable memory waits for every
    kernel queued before it, one from page-locked memory does not."""
    if tensor.device == device:
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


class RoutingError(UserError, ValueError):
    pass


@dataclass(frozen=True, eq=False)  # compared field by field, its tensor would not give one truth value
class TokenRoute:
    """One forward's route: `keep` [B, kept] the indices of the image tokens the routed blocks see (ascending),
    and the first and last routed block (non-negative)."""
    keep: torch.Tensor
    first: int
    last: int


@dataclass(frozen=True)
class TokenRouting:
    """How a run routes a model: the fraction of image tokens set aside, the first and last block they skip, and
    the model's patch size (latents -> tokens). Build it with `for_model`; TokenRouting() routes nothing."""
    ratio: float = 0.0
    first: int = 0
    last: int = -1
    patch_size: int = 2

    @classmethod
    def for_model(cls, config, ratio, first, last):
        """Checked against `config` (model_sd3light.SD3LightConfig): one line for a ratio outside [0, 1) or blocks
        out of range (negative blocks count from the end: -2 is the block before the last)."""
        if not 0.0 <= ratio < 1.0:
            raise RoutingError(f"--route_ratio {ratio} is outside [0, 1): it is the fraction of image tokens that "
                               f"skip the routed blocks (0 = off; TREAD's is 0.5)")
        if ratio == 0.0:
            return cls(patch_size=config.patch_size)
        layers = config.num_layers
        resolved = [b + layers if b < 0 else b for b in (first, last)]
        if not 0 <= resolved[0] <= resolved[1] < layers:
            raise RoutingError(f"--route_first {first} and --route_last {last} do not name blocks first <= last of "
                               f"this model's 0..{layers - 1} (negative counts from the end)")
        return cls(ratio, resolved[0], resolved[1], config.patch_size)

    def routes(self, block):
        """Whether block `block` runs on the kept tokens only."""
        return self.ratio > 0 and self.first <= block <= self.last

    def kept(self, tokens):
        """How many of `tokens` image tokens the routed blocks see."""
        return tokens - int(self.ratio * tokens)

    def draw(self, latents, generator):
        """A route for a batch of `latents` [B, C, H, W] (TokenRoute), each sample its own random subset of its
        image tokens, drawn from `generator`; None when nothing is routed (the generator is then not touched)."""
        if self.ratio == 0.0:
            return None
        tokens = (latents.shape[-2] // self.patch_size) * (latents.shape[-1] // self.patch_size)
        order = torch.rand(len(latents), tokens, generator=generator).argsort(dim=1)
        return TokenRoute(to_device(order[:, :self.kept(tokens)].sort(dim=1).values, latents.device), self.first,
                          self.last)
