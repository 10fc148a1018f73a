"""model/flat_adamw.FlatAdamW, what --optimizer adamw8bit and --trained_dtype bf16 step with: torchao's update (its
AdamW8bit, its _AdamW for bf16 weights) in a few calls a step instead of one compiled call a tensor, its state
torchao's, and a step skipped on the device where `found_inf` says so."""
import pytest
import torch

from model import flat_adamw
from model.flat_adamw import FlatAdamW

torchao_optim = pytest.importorskip("torchao.optim")
SHAPES = [(64, 64), (4096,), (128, 96), (7,), (33, 5), (256, 32), (64,)]  # 8-bit state for three (torchao's rule)


def weights(dtype, shapes=SHAPES):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]


def values(state):
    """A moment's values: 8-bit state dequantised."""
    return state.dequantize() if hasattr(state, "dequantize") else state.float()


def steps(optimizer, params, count, first=0, skip_at=None):
    """`count` steps of random gradients (the same for either optimizer) at a rising learning rate; at `skip_at`
    a NaN gradient, skipped: torchao's by not stepping (the loops did so before), ours on the device."""
    for i in range(first, first + count):
        generator = torch.Generator().manual_seed(i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.param_groups[0]["lr"].fill_(1e-2 * (i + 1) / 20)
        if isinstance(optimizer, FlatAdamW):
            if i == skip_at:
                params[0].grad[0, 0] = float("nan")
            optimizer.found_inf = torch.tensor(float(i == skip_at))
            optimizer.step()
        elif i != skip_at:
            optimizer.step()


def test_the_8bit_update_is_torchaos_bit_for_bit_over_20_steps_a_skip_and_a_resume_from_its_state_in_few_calls(
        monkeypatch):
    """bf16 weights rounded to nearest, 8-bit moments where torchao has them: 20 steps equal bit for bit, the
    NaN step skipped on the device; torchao's state after 10 steps loads and the next 10 are equal too. A step
    is at most 10 compiled or multi-tensor calls (here 8: two groups, each two copies in, the update, one copy
    back), where torchao made one compiled call a tensor."""
    ours, theirs = weights(torch.bfloat16), weights(torch.bfloat16)
    flat = FlatAdamW(ours, 1e-2, 0.01, eight_bit=True, bf16_stochastic_round=False)
    reference = torchao_optim.AdamW8bit(theirs, lr=1e-2, weight_decay=0.01, bf16_stochastic_round=False)
    steps(flat, ours, 10, skip_at=5)
    steps(reference, theirs, 10, skip_at=5)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))

    resumed = FlatAdamW(ours, 1e-2, 0.01, eight_bit=True, bf16_stochastic_round=False)
    resumed.load_state_dict(reference.state_dict())  # a resume file written by torchao's optimizer
    calls = []
    for name in ("_foreach_copy_", "_foreach_add_"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, _original=original, _name=name, **kwargs:
                            calls.append(_name) or _original(*args, **kwargs))
    steps(resumed, ours, 10, first=10)
    steps(reference, theirs, 10, first=10)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    compiled = len(resumed.groups)  # one compiled update a chunk, one chunk a group here
    assert len(calls) / 10 + compiled <= 10 and len(resumed.groups) == 2
    for p, q in zip(ours, theirs):  # the state it holds is torchao's, tensor by tensor
        mine, its = resumed.state[p], reference.state[q]
        assert type(mine["exp_avg"]) is type(its["exp_avg"]) and float(mine["step"]) == float(its["step"]) == 19
        assert torch.equal(values(mine["exp_avg_sq"]), values(its["exp_avg_sq"]))


def test_stochastic_rounding_lands_next_to_torchaos_value_and_chunks_split_tensors(monkeypatch):
    """bf16 weights rounded stochastically draw their own random bits (a compiled call over a chunk, not one a
    tensor), so one step lands on torchao's value or the bf16 next to it: one ulp apart at most. Chunks smaller
    than a tensor cut it in pieces, and the update is the same as in one chunk."""
    few = [(64, 64), (7,)]  # each shape is a compile of torchao's
    ours, theirs = weights(torch.bfloat16, few), weights(torch.bfloat16, few)
    steps(FlatAdamW(ours, 1e-2, 0.0, eight_bit=False, bf16_stochastic_round=True), ours, 1)
    steps(torchao_optim._AdamW(theirs, lr=1e-2, weight_decay=0.0, bf16_stochastic_round=True), theirs, 1)
    for a, b in zip(ours, theirs):
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
        assert ((a.float() - b.float()).abs() <= ulp * 1.01).all()

    whole, pieces = weights(torch.float32, few), weights(torch.float32, few)
    steps(FlatAdamW(whole, 1e-2, 0.01, eight_bit=True, bf16_stochastic_round=False), whole, 3)
    monkeypatch.setattr(flat_adamw, "CHUNK", 1024)
    cut = FlatAdamW(pieces, 1e-2, 0.01, eight_bit=True, bf16_stochastic_round=False)
    steps(cut, pieces, 3)
    assert cut.groups[0].chunk == 1024 and all(torch.equal(a, b) for a, b in zip(whole, pieces))
