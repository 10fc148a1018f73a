"""The compiled step computes what the eager step does (--compile 1: each transformer block compiled): LoRA's
hand-written layers, the full fine-tune, a routed run, some blocks recomputed in backward. The compiler here is
Dynamo with AOT autograd's eager backend: it captures each block and its backward as inductor gets them, at a
fraction of the compile time. Every stage's bitwise resume test resumes with --compile 1 (test_finetune,
test_dpo, test_distill: Dynamo's capture run eagerly); inductor's CPU code is checked by test_train's compiled
pretraining, which resumes eagerly."""
import functools

import pytest
import torch

from model.model_lora import apply_lora, lora_parameters
from model.model_sd3light import SD3Light
from model.token_routing import TokenRouting
from tests.conftest import CONFIGS, inputs, randomise


@pytest.fixture
def compiler(monkeypatch):
    """torch.compile with the aot_eager backend for the test -> Dynamo's counters (its graphs)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["full", "routed lora"])
def test_a_compiled_step_computes_what_the_eager_step_does(kind, compiler):
    config = CONFIGS["sd3.5-medium-like"]  # dual attention, qk norms, the last block's own shape
    models = []
    for _ in range(2):
        model = randomise(SD3Light(config), seed=3)
        if "lora" in kind:
            apply_lora(model, rank=4)
            with torch.no_grad():
                for p in lora_parameters(model):  # B != 0: every adapter gets a gradient
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        model.gradient_checkpointing = 1  # the first block recomputed, the others not
        models.append(model)
    eager, compiled = models
    for block in compiled.transformer_blocks:
        block.forward = torch.compile(block.forward)
    x = inputs(config, (4, 4))
    route = TokenRouting.for_model(config, 0.5, 1, -2).draw(x[0], torch.Generator().manual_seed(0)) \
        if "routed" in kind else None
    losses = []
    for model in models:
        loss = model(*x, route=route).square().mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    trained = [(n, p) for n, p in eager.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for _, p in trained)
    for (name, p), q in zip(trained, [q for q in compiled.parameters() if q.requires_grad]):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert compiler["stats"]["unique_graphs"] >= 3  # a block, the dual-attention one, the last: compiled
