"""The optimizers a stage builds: AdamW, fused or torchao's 8-bit one (adamw); Muon (SkippingMuon); and the optimizer
step fused into backward (StepInBackward, --step_in_backward 1).

The optimizer step fused into backward (--step_in_backward 1): each parameter is stepped, and its gradient freed,
as soon as backward has accumulated it, so the whole model's gradients never exist at once (PyTorch's recipe,
Tensor.register_post_accumulate_grad_hook; kohya's --fused_backward_pass). A full fine-tune then holds its weights
and optimizer state, plus a few gradients.

    fused = StepInBackward(model.parameters(), lr, weight_decay, eight_bit, bf16_rounding, grad_clip)
    loss.backward()                      # every parameter stepped, clipped alone, its gradient freed
    grad_norm = fused.grad_norm()        # the step's gradient norm before clipping, as clip_grad_norm_ reports it

What it cannot do is refused before any work (check_step_in_backward): accumulation over micro-batches (the step
would come before the last micro-batch's gradient) and several processes (DDP and FSDP reduce gradients after
the hook would have stepped). A global clip needs every gradient first: --grad_clip clips each parameter's
gradient to that norm instead. A gradient that is not finite skips its parameter's step, on the device.
"""
import torch

from model.errors import UserError
from model.flat_adamw import FlatAdamW
from model.precision import import_torchao


def adamw(params, lr, weight_decay, eight_bit=False, bf16_rounding=None):
    """AdamW over `params`: torch's, fused (one kernel for all parameters, on a CPU too), or with `eight_bit`
    torchao's 8-bit AdamW (2 bytes of state a parameter instead of 8). For bf16 weights (`bf16_rounding`:
    "stochastic" or "nearest"), torchao's, which computes each update in fp32 and rounds it to bf16 as asked.
    torchao's two run as model/flat_adamw.FlatAdamW: the same update, in a few calls a step instead of one a
    tensor. Each skips a step on the device where the loop sets `optimizer.found_inf`."""
    params = list(params)
    if bf16_rounding is None and not eight_bit:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    import_torchao("--optimizer adamw8bit" if eight_bit else "--trained_dtype bf16")
    return FlatAdamW(params, lr, weight_decay, eight_bit, bf16_rounding == "stochastic")


class SkippingMuon(torch.optim.Muon):
    """torch's Muon, which takes no skip flag as fused AdamW does: where the loop sets `found_inf` (1.0, a tensor on
    the device, for a step whose loss or gradient norm is not finite) it reads it, the one wait for the device in
    its step, and steps only where it is 0."""

    found_inf = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.found_inf is not None and self.found_inf.item():
            return None
        return super().step(closure)


def check_step_in_backward(accumulation_steps, world_size):
    """One line, before anything is loaded, for what --step_in_backward 1 does not go with."""
    if accumulation_steps > 1:
        raise UserError("--step_in_backward 1 steps each parameter in backward, before a next micro-batch could add "
                        "to its gradient: use --accumulation_steps 1 (a larger --batch_size), or --step_in_backward 0")
    if world_size > 1:
        raise UserError("--step_in_backward 1 runs on one process: DDP and FSDP reduce the gradients after it would "
                        "have stepped; use --step_in_backward 0 with several processes (FSDP shards the gradients)")


class StepInBackward:
    """One optimizer per trained parameter (adamw's, with its settings), stepped by a hook once backward has that
    parameter's gradient, after clipping it to `grad_clip` alone; the gradient is then freed. `optimizers`: the
    list, for the learning rate (set_lr) and the resume checkpoint (NamedOptimizerState)."""

    def __init__(self, params, lr, weight_decay, eight_bit, bf16_rounding, grad_clip):
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = [adamw([p], lr, weight_decay, eight_bit, bf16_rounding) for p in self.params]
        self.optimizer_of = dict(zip(self.params, self.optimizers))
        self.grad_clip, self.squares, self.loss_finite = grad_clip, [], torch.tensor(True)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.step)

    def watch(self, loss):
        """The loss the next backward starts from: where it is not finite, no parameter is stepped (decided on the
        device, as each gradient's own check)."""
        self.loss_finite = torch.isfinite(loss.detach())

    @torch.no_grad()
    def step(self, param):
        norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
        self.squares.append(norm.square())
        param.grad.mul_((self.grad_clip / (norm + 1e-6)).clamp(max=1.0).to(param.grad.dtype))
        optimizer = self.optimizer_of[param]
        # a step cannot be taken back: none where this gradient or the loss is not finite, skipped on the device
        optimizer.found_inf = (~(torch.isfinite(norm) & self.loss_finite)).float()
        optimizer.step()
        param.grad = None

    def grad_norm(self):
        """-> the norm over every parameter of this step's gradients, before clipping, a tensor on the device
        (NaN where no backward ran: the step counts as skipped); the count starts again."""
        squares, self.squares = self.squares, []
        return torch.stack(squares).sum().sqrt() if squares else torch.tensor(float("nan"))
