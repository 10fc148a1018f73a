"""The exponential moving average of the trained weights that a stage exports and samples."""
import contextlib

import torch


class EMA:
    """Exponential moving average of `source`'s state dict (a model, or anything with state_dict(), such as a
    model's LoRA adapters), in fp32, on `device` (None: where the weights are; "cpu": off the GPU, --ema_device).
    The decay warms up as (1 + step) / (10 + step), so a short run is not dominated by its random initial
    weights."""

    def __init__(self, source, decay, device=None):
        self.source, self.decay, self.device = source, decay, None if device in (None, "auto") else device
        self.shadow = self.copy_of_source()

    def copy_of_source(self):
        return {k: v.detach().to(self.device).float().clone() for k, v in self.source.state_dict().items()}

    @torch.no_grad()
    def update(self, step):
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in self.source.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].lerp_(v.to(self.device).float(), 1 - decay)
            else:
                self.shadow[k].copy_(v)

    def state_dict(self):
        return self.shadow

    def load_state_dict(self, shadow):
        """The average a resume file holds; None (the run had no EMA so far): start from the source's weights."""
        self.shadow = shadow if shadow is not None else self.copy_of_source()

    @contextlib.contextmanager
    def swapped_in(self, model):
        """`model` with the average in the source's place while the block runs (what the sample grids draw and
        the export holds), then the trained weights back, bit for bit. No copy of the model: a sharded one works
        too."""
        trained = {k: v.detach().clone() for k, v in self.source.state_dict().items()}
        self.source.load_state_dict(self.shadow)
        try:
            yield model
        finally:
            self.source.load_state_dict(trained)
