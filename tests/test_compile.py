"""The compiled step computes what the eager step does (--compile 1: each transformer block compiled): LoRA's
hand-written layers, the full fine-tune, a routed run, some blocks recomputed in backward. The compiler here is
Dynamo with AOT autograd's eager backend: it captures each block and its backward as inductor gets them, at a
fraction of the compile time. Each fine-tune stage trains with --compile 1; inductor's CPU code is checked by
test_train's compiled pretraining, which also resumes a compiled run eagerly."""
import functools
import json

import pytest
import torch

import trainer.train_distill as train_distill
import trainer.train_dpo as train_dpo
import trainer.train_full_sft as train_full_sft
import trainer.train_lora as train_lora
from model.model_lora import apply_lora, lora_parameters
from model.model_sd3light import SD3Light
from model.recompute import compile_block
from model.token_routing import TokenRouting
from trainer import preference
from tests.conftest import CONFIGS, QUIET, compiled_as_captured, inputs, randomise
from tests.scripts import run_in_process
from tests.test_dpo import brightness_scores


@pytest.fixture
def compiler(monkeypatch):
    """torch.compile with the aot_eager backend for the test -> Dynamo's counters (its graphs)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.mark.slow  # compiles: seconds
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
        compile_block(block)
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


@pytest.mark.slow  # compiles: seconds
def test_a_compiled_block_is_recomputed_inside_its_compiled_region(compiler, monkeypatch):
    """--compile 1 with every block recomputed: the compiled backward recomputes each block itself, so after the
    step that compiles no torch checkpoint runs (around a compiled block it ran a Python pack and unpack hook for
    each tensor the block keeps). Forward keeps the activations the eager recompute keeps (the blocks' inputs), and
    for each attention the random-number state, which the compiler saves for any operation that may draw (here the
    CPU generator's 5,056 bytes; a CUDA generator's is its seed and offset)."""
    config = CONFIGS["sd3.5-medium-like"]
    models = [randomise(SD3Light(config, gradient_checkpointing=True), seed=3) for _ in range(2)]
    eager, compiled = models
    for block in compiled.transformer_blocks:
        compile_block(block)
    x = inputs(config, (4, 4))
    compiled(*x).square().mean().backward()  # compiles
    compiled.zero_grad()
    checkpoints = []
    generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator
    monkeypatch.setattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator",
                        lambda *a, **k: checkpoints.append(1) or generator(*a, **k))
    kept = []
    for model in models:
        weights = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved = []

        def pack(t):
            if t.data_ptr() not in weights:
                saved.append((t.dtype, t.numel() * t.element_size()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*x).square().mean()
        loss.backward()
        kept.append(saved)
    activations = [[n for dtype, n in saved if dtype.is_floating_point] for saved in kept]
    states = [n for dtype, n in kept[1] if not dtype.is_floating_point]
    attentions = sum(2 if block.attn2 is not None else 1 for block in compiled.transformer_blocks)
    assert checkpoints == [] and activations[1] == activations[0], (checkpoints, activations)
    assert len(states) == attentions and set(states) == {torch.get_rng_state().numel()}
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert not compiler["graph_break"] and compiler["stats"]["unique_graphs"] >= 3


def test_every_fine_tune_stage_trains_compiled(tmp_path, pretrained_small, monkeypatch):
    """--compile 1 in LoRA, the full fine-tune, Flow-DPO and distillation: each block through Dynamo's capture, run
    eagerly (conftest.compiled_as_captured). On the 2-block sd3-tiny preset: Dynamo captures each block of a
    model afresh, and a block is captured alike at any size."""
    compiled = compiled_as_captured(monkeypatch)
    monkeypatch.setattr(preference, "score_images", brightness_scores)
    lora = ["--num_samples", "8", "--prior_samples", "8", "--batch_size", "2", *QUIET]
    runs = [(train_lora, "lora_demo_sd3-tiny", "loss", lora),
            (train_full_sft, "sft_sd3-tiny", "loss", ["--num_samples", "8", "--batch_size", "2", *QUIET]),
            (train_dpo, "lora_dpo_sd3-tiny", "dpo", ["--batch_size", "2", "--pair_prompts", "2", "--pair_images",
                                                     "2", "--pair_sample_steps", "2", "--lora_rank", "4", *QUIET]),
            (train_distill, "distill_sd3-tiny", "fake_score", ["--gen_steps", "2", "--batch_size", "2",
                                                               "--num_samples", "8", "--warmup_steps", "2"])]
    for module, name, key, extra in runs:
        out = tmp_path / name
        run_in_process(module, ["--from_weight", pretrained_small, "--preset", "sd3-tiny", *extra, "--max_steps",
                                "1", "--sample_interval", "0", "--compile", "1", "--out_dir", str(out), "--save_dir",
                                str(out), "--cache_dir", str(tmp_path / "cache")], monkeypatch)
        assert len(losses(out / f"{name}_metrics.jsonl", key)) == 1, name
    assert compiled["stats"]["unique_graphs"] >= 4


def losses(path, key="loss"):
    with open(path) as f:
        return [json.loads(line)[key] for line in f]
