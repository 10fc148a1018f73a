"""Merging an adapter into its layer's weight and back, shared by LoRA (model/model_lora.py) and LoKr
(model/lokr.py): W <- W +- delta_weight(), computed in fp32, stored in the weight's dtype."""
import torch


class DeltaMerge:
    """For an adapted nn.Linear with `delta_weight()` (its update, fp32) and a `merged` flag."""

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight.copy_((self.weight.float() + self.delta_weight()).to(self.weight.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight.copy_((self.weight.float() - self.delta_weight()).to(self.weight.dtype))
            self.merged = False
