"""AdamW for a full fine-tune's low-precision training in a few calls a step: torchao's update (8-bit state, or bf16
weights rounded stochastically or to nearest), computed on contiguous buffers instead of one compiled call a
tensor.

torchao's AdamW8bit and _AdamW compile and launch an update for each parameter tensor: hundreds of calls a step
at SD3.5 size, the host's time. Here each group of parameters (those with 8-bit state: 4096 values and more, a
multiple of the 256-value block; the others, state in their own dtype, as torchao decides) keeps its state in one
flat buffer. A step copies the weights and gradients into work buffers (in the weights' dtype) a chunk at a time
(one multi-tensor copy each), runs torchao's own arithmetic on the chunk in fp32 (one compiled call: dequantise,
the moments, the update, requantise, the rounding), and copies the weights back (one more). Blocks of 256 values
never straddle two tensors: a quantised tensor's size divides by 256, and so do the chunks.

The state a checkpoint holds is torchao's, tensor by tensor (views of the flat buffers: the same files load in
either), and `found_inf` (a float32 device tensor, as AMP's GradScaler sets it on fused AdamW) skips the step on
the device: the weights, the state and the step count stay as they were.
"""
import bisect
import itertools

import torch
from torch.optim import Optimizer

from model.precision import import_torchao

CHUNK = 1 << 25  # values a compiled call updates: 128 MB of fp32 weights and as much of gradients to work in
BLOCK = 256  # torchao's 8-bit block


class FlatAdamW(Optimizer):
    """AdamW with torchao's arithmetic over flat buffers. `eight_bit`: 8-bit moments where torchao has them;
    `bf16_stochastic_round`: bf16 weights rounded stochastically (else to nearest)."""

    def __init__(self, params, lr, weight_decay, eight_bit, bf16_stochastic_round, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=torch.tensor(float(lr)), betas=betas, eps=eps, weight_decay=weight_decay))
        self.eight_bit, self.stochastic = eight_bit, bf16_stochastic_round
        self.groups = None  # built at the first step, where the parameters are

    def local(self, tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def build(self):
        """The flat state of every (optimizer group, 8-bit or not, dtype) group, and each parameter's views of it;
        each group's learning rate a float32 tensor on the device (set_lr fills it: nothing waits)."""
        sets = {}
        for index, group in enumerate(self.param_groups):
            device = self.local(group["params"][0]).device
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32, device=device)
            for p in group["params"]:
                n = self.local(p).numel()
                quantised = self.eight_bit and n >= 4096 and n % BLOCK == 0
                sets.setdefault((index, quantised, p.dtype), []).append(p)
        self.groups = [FlatGroup(params, self.param_groups[index], quantised, self) for (index, quantised, _), params
                       in sets.items()]

    @torch.no_grad()
    def step(self, closure=None):
        if self.groups is None:
            self.build()
        found_inf = getattr(self, "found_inf", None)
        for group in self.groups:
            group.step(found_inf)

    def state_dict(self):
        """torchao's state dict, each tensor's state a copy of its own: a view of the flat buffers would take the
        whole buffer into a file that saves it alone (a DCP shard)."""
        state = super().state_dict()
        state["state"] = {key: {name: compact(value) for name, value in entry.items()}
                          for key, entry in state["state"].items()}
        return state

    def load_state_dict(self, state_dict):
        """torchao's state (or this one's), tensor by tensor, copied into the flat buffers."""
        super().load_state_dict(state_dict)
        loaded, self.groups = {p: dict(s) for p, s in self.state.items()}, None
        self.build()
        for group in self.groups:
            group.load(loaded)


class FlatGroup:
    """One flat buffer each of the two moments (8-bit codes and block scales, or plain values in the weights'
    dtype) and the step count, for `params` of one optimizer group; `owner.state[p]` holds views of them."""

    def __init__(self, params, settings, quantised, owner):
        self.params, self.settings, self.quantised, self.owner = params, settings, quantised, owner
        self.sizes = [owner.local(p).numel() for p in params]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]  # where each starts, flat
        self.total = total = sum(self.sizes)
        # where the group is one tensor (a step in backward's optimizer) the update runs on it and its gradient,
        # and on the state the optimizer holds (block swap replaces it); else on copies into work buffers
        self.alone = len(params) == 1 and total <= CHUNK
        self.chunk = max(1, total if self.alone else min(CHUNK, -(-total // BLOCK) * BLOCK))  # 1: an empty shard
        self.padded = -(-total // self.chunk) * self.chunk
        device, dtype = owner.local(params[0]).device, params[0].dtype
        step_count = torch.zeros((), device=device)
        if quantised:
            subclass = import_torchao("--optimizer adamw8bit").optim.subclass_8bit.OptimState8bit
            moments = [subclass.zeros((self.padded,), signed, BLOCK, device) for signed in (True, False)]
        else:
            moments = [torch.zeros(self.padded, device=device, dtype=dtype) for _ in range(2)]
        self.work = [] if self.alone else [torch.zeros(self.chunk, device=device, dtype=dtype) for _ in range(2)]
        self.update = torch.compile(chunk_update, fullgraph=True, dynamic=False)
        offset = 0
        for p, n in zip(params, self.sizes):
            owner.state[p] = {"step": step_count, **{name: self.view(m, offset, n, p) for name, m in
                                                     zip(("exp_avg", "exp_avg_sq"), moments)}}
            offset += n
        # a group of one tensor holds nothing of its own: block swap moves its state to host memory and back
        self.moments, self.step_count = (None, None) if self.alone else (moments, step_count)

    def view(self, moment, offset, n, p):
        """Parameter `p`'s part of a flat moment, shaped as p (as torchao's state is), a DTensor where p is one."""
        local = self.owner.local(p)
        if self.quantised:
            part = type(moment)(moment.codes[offset:offset + n].view(local.shape),
                                moment.scale[offset // BLOCK:(offset + n) // BLOCK], moment.qmap, moment.signed,
                                dtype=p.dtype)
        else:
            part = moment[offset:offset + n].view(local.shape)
        if local is p:
            return part
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(part, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def pieces(self, start):
        """(the flat pieces of the parameters with a gradient that fall in the chunk at `start`, of their
        gradients, (begin, end) of each in the chunk)."""
        weights, grads, spans = [], [], []
        first = bisect.bisect_right(self.offsets, start) - 1  # the tensors from the one the chunk starts in, not all
        for index in range(max(first, 0), len(self.params)):
            p, offset, n = self.params[index], self.offsets[index], self.sizes[index]
            if offset >= start + self.chunk:
                break
            lo, hi = max(offset, start), min(offset + n, start + self.chunk)
            if lo < hi and p.grad is not None:
                weights.append(self.owner.local(p).view(-1)[lo - offset:hi - offset])
                grads.append(self.owner.local(p.grad).view(-1)[lo - offset:hi - offset])
                spans.append((lo - start, hi - start))
        return weights, grads, spans

    def step(self, found_inf):
        """Every chunk: weights and gradients into the work buffers, the compiled update, the weights back. Where
        some values of a chunk have no gradient (a tensor outside this step's graph) they keep weight and state, as
        torchao skips such a tensor; the group's step count advances all the same (torchao's own for that tensor
        would not: the stages train no such tensor, DDP would refuse it)."""
        device, s, dtype = self.owner.local(self.params[0]).device, self.settings, self.params[0].dtype
        skip = torch.zeros((), device=device) if found_inf is None else found_inf
        step_count = self.step_count_on(device)
        scalars = (step_count + 1, self.lr_on(device), skip)
        hyper = (s["betas"][0], s["betas"][1], s["weight_decay"], s["eps"])
        rounding = self.owner.stochastic and dtype == torch.bfloat16
        with torch._dynamo.utils.disable_cache_limit():  # a compile for each chunk size, as torchao's for each shape
            for start in range(0, self.padded, self.chunk):
                weights, grads, spans = self.pieces(start)
                if not weights:
                    continue
                if self.alone:
                    self.update(weights[0], grads[0], self.moment_parts(start), scalars, None, hyper, rounding)
                    continue
                into, held = [[buffer[lo:hi] for lo, hi in spans] for buffer in self.work], None
                if sum(hi - lo for lo, hi in spans) < min(self.chunk, self.total - start):
                    held = torch.zeros(self.chunk, device=device)
                    torch._foreach_add_([held[lo:hi] for lo, hi in spans], 1.0)
                torch._foreach_copy_(into[0], weights)
                torch._foreach_copy_(into[1], grads)
                self.update(self.work[0], self.work[1], self.moment_parts(start), scalars, held, hyper, rounding)
                torch._foreach_copy_(weights, into[0])
        step_count.copy_(torch.where(skip > 0, step_count, scalars[0]))

    def step_count_on(self, device):
        """The group's step count, on `device`: where a resume built the group in host memory (a swapped block),
        moved once, not copied back each step."""
        if self.alone:
            state = self.owner.state[self.params[0]]
            if state["step"].device != device:
                state["step"] = state["step"].to(device)
            return state["step"]
        if self.step_count.device != device:
            self.step_count = self.step_count.to(device)
            for p in self.params:
                self.owner.state[p]["step"] = self.step_count
        return self.step_count

    def lr_on(self, device):
        if self.settings["lr"].device != device:
            self.settings["lr"] = self.settings["lr"].to(device)
        return self.settings["lr"]

    def moment_parts(self, start):
        """The chunk at `start` of both moments: (codes, scales, qmap) each where 8-bit, else (values,). A group of
        one tensor reads them from the optimizer's state, where block swap (model/block_swap.py) puts the copies
        it brings to the device."""
        end, moments = start + self.chunk, self.moments
        if self.alone:
            state = self.owner.state[self.params[0]]
            moments = [self.owner.local(state[name]) for name in ("exp_avg", "exp_avg_sq")]
        if not self.quantised:
            return tuple((m.view(-1)[start:end],) for m in moments)
        return tuple((m.codes.view(-1)[start:end], m.scale[start // BLOCK:end // BLOCK], m.qmap) for m in moments)

    def load(self, loaded):
        """Copy each parameter's loaded state into its views; the step count from the first."""
        for p in self.params:
            saved, ours = loaded.get(p, {}), self.owner.state[p]
            if not saved:
                continue
            for name in ("exp_avg", "exp_avg_sq"):
                local = self.owner.local(ours[name])
                local.copy_(self.owner.local(saved[name]).to(local.device))
            ours["step"].copy_(saved["step"])


def compact(value):
    """A DTensor's state (a sharded save writes each tensor alone) with storage of its own, an 8-bit state's codes
    and scales too: one tensor's worth. Other state as it is: torch.save writes a shared buffer once."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    if hasattr(local, "codes"):
        local = type(local)(local.codes.clone(), local.scale.clone(), local.qmap, local.signed, dtype=local.dtype)
    else:
        local = local.clone()
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                              stride=value.stride())


def chunk_update(weights, grads, moments, scalars, held, hyper, stochastic):
    """torchao's single_param_adam (AdamW) on one chunk, in place: `weights` and `grads` (flat, in the weights'
    dtype), `moments` ((codes, scales, qmap) or (values,) each), computed in fp32 at `scalars` (the step count,
    the learning rate, the skip flag): nothing where the flag is 1, or where `held` (None: all of it) is 0.
    `stochastic`: bf16 weights rounded stochastically."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr, dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor

    (beta1, beta2, weight_decay, eps), (step, lr, skip) = hyper, scalars
    keep = skip > 0 if held is None else (skip > 0) | (held == 0)
    p, grads = weights.float(), grads.float()
    p = p - lr * weight_decay * p
    old = [dequant_with_qmap(m[0], m[2], m[1]) if len(m) == 3 else m[0].float() for m in moments]  # codes, map, scales
    m1 = old[0].lerp(grads, 1 - beta1)
    m2 = old[1].lerp(grads.square(), 1 - beta2)
    denom = (m2.sqrt() / (1 - beta2 ** step).sqrt()) + eps
    p = p - lr * (m1 / (1 - beta1 ** step)) / denom
    for moment, new in zip(moments, (m1, m2)):
        if len(moment) == 3:
            codes, scales, qmap = moment
            scaled, scale = scale_tensor(new, BLOCK)
            codes.copy_(torch.where(keep, codes, quantize_8bit_with_qmap(scaled, qmap)))
            scales.copy_(torch.where(keep.view(-1, BLOCK)[:, 0] if keep.dim() else keep, scales, scale))
        else:
            moment[0].copy_(torch.where(keep, moment[0], new.to(moment[0].dtype)))
    p = _fp32_to_bf16_sr(p) if stochastic else p.to(weights.dtype)
    weights.copy_(torch.where(keep, weights, p))
