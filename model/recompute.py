"""A transformer block recomputed in backward (gradient checkpointing) at the cost of one autograd node.

torch's non-reentrant checkpoint records the block's forward as autograd always does and runs a pack hook on every
tensor that forward saves, an unpack hook on each in backward (about 120 each a block a step, each a Python call
the GPU waits on at batch 1). `Recomputed` runs the block's forward without autograd and, in backward, again with
it, then backpropagates through that copy alone: torch's reentrant variant, written for the block's
(x, context, temb) -> (x, context) and for blocks whose inputs need no gradient (a LoRA's frozen first block: the
`anchor` puts the node in the graph). The parameters' gradients accumulate inside that backward.

In a model without block swap, SD3Light uses it for plain blocks only; a compiled block (`compile_block`) is
recomputed by the compiler: torch's checkpoint inside the compiled region, so the compiled backward recomputes the
block itself (torchtitan's order: checkpoint, then compile). A sharded block that is not compiled (FSDP's hooks),
and every block of a model with block swap (model/block_swap.py, whose hooks must run again for the recompute),
keep torch's non-reentrant checkpoint around the module's call.
"""
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class Recomputed(torch.autograd.Function):
    """block(x, context, temb) -> (x, context); forward keeps only the three inputs. `random`: the block draws
    random numbers (dropout), so the recompute replays the forward's random state."""

    @staticmethod
    def forward(ctx, block, random, anchor, x, context, temb):
        device = x.device.type
        ctx.block, ctx.device = block, device
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.rng = random_state(x.device) if random else None
        ctx.save_for_backward(x, context, temb)
        return block(x, context, temb)

    @staticmethod
    def backward(ctx, grad_x, grad_context):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        devices = [] if ctx.rng is None or ctx.device == "cpu" else [inputs[0].device]
        with torch.enable_grad(), torch.random.fork_rng(devices, enabled=ctx.rng is not None), \
                torch.autocast(ctx.device, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
            if ctx.rng is not None:
                set_random_state(ctx.rng, inputs[0].device)
            outputs = ctx.block(*inputs)
        pairs = [(out, grad) for out, grad in zip(outputs, (grad_x, grad_context))
                 if out is not None and grad is not None and out.requires_grad]
        outs, grads = [out for out, _ in pairs], [grad for _, grad in pairs]
        if not torch.autograd._is_checkpoint_valid():
            # inside torch.autograd.grad (distillation's GAN loss wants a sample's gradient): the inputs' gradients
            # alone, no parameter's .grad touched, as that call promises
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
            return (None, None, None, *(next(found) if t.requires_grad else None for t in inputs))
        torch.autograd.backward(outs, grads)
        return (None, None, None, *(t.grad if t.requires_grad else None for t in inputs))


def random_state(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_random_state(state, device):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def has_dropout(module):
    """Whether `module` holds a dropout with p > 0 (LoRA's --lora_dropout)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


def draws_random(block):
    """Whether a block, in training, draws random numbers: a dropout in it."""
    return block.training and has_dropout(block)


def compile_block(block):
    """torch.compile `block`'s forward, which then takes `recompute=True` to be recomputed in backward inside the
    compiled region: the compiler saves the block's inputs, and its backward graph recomputes what it needs (no
    pack or unpack hook in Python, about 120 each a block a step around a compiled block, and no second call of the
    compiled forward). Called through the module, so FSDP's hooks stay outside the graph and gather the weights
    for forward and backward alike. A block recomputed and one not are two graphs of each kind of block."""
    forward = functools.partial(torch.compile(recomputed_inside), block.forward)
    forward.recomputes_inside = True
    block.forward = forward


def compiled_by_compile_block(block):
    """Whether `block`'s forward is compile_block's (it takes `recompute=True`)."""
    return getattr(block.forward, "recomputes_inside", False)


def recomputed_inside(forward, x, context, temb, recompute=False, random=False):
    """forward(x, context, temb), recomputed in backward where `recompute`; `random`: the block draws (dropout)."""
    if not recompute:
        return forward(x, context, temb)
    # compiled, the compiler keeps the random state itself: it saves the generator's state before each operation
    # that may draw (a dropout, an attention) and replays it in the recompute; `random` keeps it too where this runs
    # uncompiled (past Dynamo's recompile limit), or a dropout would draw other masks in the recompute
    return checkpoint(forward, x, context, temb, use_reentrant=False, preserve_rng_state=random)
