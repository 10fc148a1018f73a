"""Hand-written LoRA: starts as the identity, merges exactly, trains only itself, and round-trips through files."""
import json

import pytest
import torch
from safetensors import safe_open

from model.model_lora import (
    LoRALinear, apply_lora, load_lora, lora_layers, lora_parameters, merge_lora, read_lora_file, save_lora,
    unmerge_lora,
)
from model.model_sd3light import SD3Light
from model.recompute import draws_random, has_dropout
from tests.conftest import inputs, random_config, randomise


def model_and_inputs(seed=0):
    config = random_config(seed)
    model = randomise(SD3Light(config).eval(), seed)
    return model, inputs(config, None, seed=seed)


def randomise_lora(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_fresh_lora_changes_nothing_and_keeps_the_base_names():
    model, x = model_and_inputs()
    keys = set(model.state_dict())
    before = model(*x)
    names = apply_lora(model, rank=4, alpha=8)
    assert names and all(isinstance(layer, LoRALinear) for layer in lora_layers(model).values())
    assert any(n.endswith("attn.to_q") for n in names) and any(n.endswith("attn.add_k_proj") for n in names)
    assert not any(".ff." in n or "norm1" in n for n in names)  # attention only by default
    assert keys <= set(model.state_dict())  # base weights keep their names: still diffusers-compatible
    assert torch.equal(model(*x), before)  # B = 0


def test_targets_select_groups_and_unknown_targets_are_an_error():
    model, _ = model_and_inputs()
    names = apply_lora(model, ["attention", "ff", "adaln"], rank=2)
    assert any(n.endswith("ff.net.0.proj") for n in names) and any(n.endswith("norm1.linear") for n in names)
    with pytest.raises(ValueError, match="no nn.Linear"):
        apply_lora(model_and_inputs()[0], ["no_such_layer"], rank=2)


def test_merge_matches_unmerged_and_unmerge_restores_the_weights():
    model, x = model_and_inputs()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, ["attention", "ff"], rank=4, alpha=2)
    randomise_lora(model)
    unmerged = model(*x)
    assert not torch.allclose(unmerged, model_and_inputs()[0](*x))  # the adapter does change the output
    merge_lora(model)
    merged = model(*x)
    assert torch.allclose(merged, unmerged, atol=1e-5, rtol=1e-5)
    changed = [k for k, v in base.items() if not torch.equal(model.state_dict()[k], v)]
    assert changed and all(k.endswith(".weight") for k in changed)
    unmerge_lora(model)
    for k, v in base.items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6), k
    assert torch.allclose(model(*x), unmerged, atol=1e-5, rtol=1e-5)


def test_only_lora_parameters_get_gradients():
    model, x = model_and_inputs()
    apply_lora(model, rank=4)
    randomise_lora(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)}
    model(*x).square().mean().backward()
    last = f"transformer_blocks.{len(model.transformer_blocks) - 1}.attn.add_q_proj."
    for name, p in model.named_parameters():
        if p.requires_grad and not name.startswith(last):  # the last block's text queries feed nothing
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_save_and_load_round_trip_in_the_interchange_format(tmp_path):
    model, x = model_and_inputs()
    apply_lora(model, ["attention", "adaln"], rank=4, alpha=2)
    randomise_lora(model)
    expected = model(*x)
    path = tmp_path / "lora_demo.safetensors"
    save_lora(model, path, record={"base": "pretrain_tiny", "rank": 4})

    with safe_open(str(path), framework="pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
                        for k in keys)
    adapter = json.loads(metadata["lora_adapter_metadata"])
    assert adapter["transformer.r"] == 4 and adapter["transformer.lora_alpha"] == 2.0

    fresh = randomise(SD3Light(random_config(0)).eval(), 0)  # the same base weights, no adapters yet
    record = load_lora(fresh, path)
    assert record == {"base": "pretrain_tiny", "rank": 4}
    assert torch.equal(fresh(*x), expected)


def test_a_lora_file_for_other_layers_is_a_clear_error(tmp_path):
    model, _ = model_and_inputs()
    apply_lora(model, rank=4)
    path = tmp_path / "lora.safetensors"
    save_lora(model, path)
    other = randomise(SD3Light(random_config(0)).eval(), 0)
    apply_lora(other, ["ff"], rank=4)
    with pytest.raises(ValueError, match="missing: .*unexpected: "):
        load_lora(other, path)


def test_our_lora_file_loads_into_diffusers_and_matches_our_merged_model(tmp_path):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    model, x = model_and_inputs()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, ["attention", "ff", "adaln"], rank=4, alpha=2)  # alpha != rank: the scale must travel
    randomise_lora(model)
    save_lora(model, tmp_path / "pytorch_lora_weights.safetensors")
    merge_lora(model)
    with torch.no_grad():
        expected = model(*x)

    theirs = SD3Transformer2DModel(**random_config(0).to_dict()).eval()
    theirs.load_state_dict(base, strict=True)
    # what StableDiffusion3Pipeline.load_lora_weights does for the transformer
    state, metadata = StableDiffusion3Pipeline.lora_state_dict(str(tmp_path), return_lora_metadata=True)
    theirs.load_lora_adapter(state, prefix="transformer", metadata=metadata)
    with torch.no_grad():
        got = theirs(*x).sample
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    theirs.disable_lora()
    with torch.no_grad():
        assert (theirs(*x).sample - got).abs().max() > 1e-3  # the adapter was applied, not ignored


def test_a_folded_alpha_gives_every_loader_the_trained_strength(tmp_path):
    """alpha != rank folded into B (what the stages export): loaders that read no alpha (ComfyUI reads it only
    from .alpha tensors; a bare load_lora_adapter ignores the metadata) apply the strength that trained."""
    from diffusers import SD3Transformer2DModel

    model, x = model_and_inputs()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, ["attention", "ff", "adaln"], rank=4, alpha=2)
    randomise_lora(model)
    with torch.no_grad():
        expected = model(*x)
    path = tmp_path / "folded.safetensors"
    save_lora(model, path, fold_alpha=True)
    state, config, _ = read_lora_file(str(path))
    assert config["rank"] == 4 and config["alpha"] == 4.0  # the scale is in B now

    ours = randomise(SD3Light(random_config(0)).eval(), 0)
    load_lora(ours, path)
    with torch.no_grad():
        torch.testing.assert_close(ours(*x), expected, rtol=0, atol=1e-6)  # our sampler's loader

    theirs = SD3Transformer2DModel(**random_config(0).to_dict()).eval()
    theirs.load_state_dict(base, strict=True)
    theirs.load_lora_adapter({k: v for k, v in state.items()}, prefix="transformer")  # no metadata at all
    with torch.no_grad():
        torch.testing.assert_close(theirs(*x).sample, expected, rtol=0, atol=1e-5)


def reference_lora(layer, x, dropout=None):
    """What a LoRA layer computes, through autograd's own nn.functional calls: W x + b + scale B (A x)."""
    down = torch.nn.functional.linear(x if dropout is None else dropout, layer.lora_A.weight)
    update = torch.nn.functional.linear(down, layer.lora_B.weight)
    return torch.nn.functional.linear(x, layer.weight, layer.bias) + layer.scale * update


@pytest.mark.parametrize("bias", [True, False])
def test_the_hand_written_lora_gradients_are_autograds(bias):
    """LoRAMatmul (one addmm for the base and the update, gradients by hand) gives the output and the gradients of
    input, A and B that autograd gives through three linear layers, and a trained base weight still gets its own."""
    g = torch.Generator().manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(12, 10, bias=bias), rank=3, alpha=6)
    layer.weight.requires_grad_(False)
    if bias:
        layer.bias.requires_grad_(False)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(10, 3, generator=g))
    x = torch.randn(2, 5, 12, generator=g, requires_grad=True)
    params = [x, layer.lora_A.weight, layer.lora_B.weight]
    ours = layer(x)
    ours_grads = torch.autograd.grad(ours.square().sum(), params)
    ref = reference_lora(layer, x)
    ref_grads = torch.autograd.grad(ref.square().sum(), params)
    torch.testing.assert_close(ours, ref)
    for mine, theirs in zip(ours_grads, ref_grads):
        torch.testing.assert_close(mine, theirs)
    layer.weight.requires_grad_(True)  # a base that trains: autograd's linear, the update beside it
    ours_w = torch.autograd.grad(layer(x).square().sum(), layer.weight)[0]
    torch.testing.assert_close(ours_w, torch.autograd.grad(reference_lora(layer, x).square().sum(), layer.weight)[0])


def test_lora_in_bf16_casts_its_adapters_once_and_sees_every_step():
    """Under bf16 autocast on a bf16 base, the fp32 adapters are cast once for a forward (not at every call and
    recompute) and their gradients come back in fp32; a fused optimizer's step, which leaves the version counters
    alone, and a load, which does not, are both seen by the next forward."""
    g = torch.Generator().manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(16, 8).to(torch.bfloat16).requires_grad_(False), rank=4, alpha=4)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(8, 4, generator=g))
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(lora_parameters(layer), lr=0.1, fused=True)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            first = layer(x)
            assert layer(x) is not first and layer._cast is not None  # the second call reuses the cast
            ref = reference_lora(layer, x)
        torch.testing.assert_close(first.float(), ref.float(), rtol=2e-2, atol=2e-2)
        first.float().square().sum().backward()
        assert layer.lora_A.weight.grad.dtype == torch.float32 and layer._cast is None  # forgotten after backward
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        layer.lora_A.weight.zero_()  # a load: the update is gone at once
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_lora_dropout_reaches_the_adapter_only():
    layer = LoRALinear(torch.nn.Linear(6, 6).requires_grad_(False), rank=2, alpha=2, dropout=0.5).train()
    with torch.no_grad():
        layer.lora_B.weight.fill_(1.0)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    out = layer(x)
    torch.manual_seed(3)
    torch.testing.assert_close(out, reference_lora(layer, x, dropout=layer.dropout(x)))
    # what the model's recompute and --cuda_graph's refusal read: a layer that draws in training, and one that does not
    plain = LoRALinear(torch.nn.Linear(6, 6), rank=2, alpha=2, dropout=0.0).train()
    assert has_dropout(layer) and draws_random(layer) and not draws_random(layer.eval())
    assert not has_dropout(plain) and not draws_random(plain)
