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
    def update(self, step, skipped=None):
        """The average moved towards the weights after `step`. `skipped`: 1.0 (a float32 tensor on the device) where
        the step's update was skipped, 0.0 else: the average then stays where it is, decided on the device (no
        read)."""
        weight = 1 - min(self.decay, (1 + step) / (10 + step))
        if skipped is not None:
            weight = (1 - skipped).to(next(iter(self.shadow.values())).device) * weight
        for k, v in self.source.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].lerp_(v.to(self.device).float(), weight)
            else:
                self.shadow[k].copy_(v)

    def state_dict(self):
        return self.shadow

    @torch.no_grad()
    def load_state_dict(self, shadow):
        """The average a resume file holds, copied into the EMA's own tensors (on its device: a resume file's are
        on the CPU, memory-mapped); strict: the same names. None (the run had no EMA so far): start from the
        source's weights."""
        if shadow is None:
            self.shadow = self.copy_of_source()
            return
        if shadow.keys() != self.shadow.keys():
            missing, unexpected = sorted(self.shadow.keys() - shadow.keys()), sorted(shadow.keys() - self.shadow.keys())
            raise ValueError(f"the EMA's keys differ: missing {missing[:4]}, unexpected {unexpected[:4]}")
        for key, value in shadow.items():
            ours = self.shadow[key]
            if value.shape != ours.shape:
                raise ValueError(f"the EMA's {key} is {tuple(value.shape)} in the file, {tuple(ours.shape)} here")
            if value is not ours:  # a sharded resume reads into the EMA's own tensors
                ours.copy_(value)

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
