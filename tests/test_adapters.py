"""LoKr (model/lokr.py) and DoRA (model_lora.DoRALinear) beside LoRA: LyCORIS's factorization, a forward equal to
the merged weight's and gradients equal to autograd's through the same formula, the keys ComfyUI reads (names,
shapes, alpha's meaning), a file read back by our loader, and one error naming both kinds where a file of one
kind meets layers of another."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from model.errors import UserError
from model.lokr import LoKrLinear, factorization
from model.model_lora import (
    Adapter, DoRALinear, LoRALinear, apply_lora, attach_lora, load_lora_state_dict, lora_parameters,
    lora_state_dict, read_lora_file, save_lora,
)
from model.model_sd3light import SD3Light
from tests.conftest import CONFIGS, inputs, randomise


def test_lokr_splits_each_dimension_as_lycoris_does():
    assert factorization(1536) == (32, 48)  # SD3.5-Medium's width: the most nearly square split
    assert factorization(2432) == (38, 64)  # SD3.5-Large's
    assert factorization(1536, 16) == (16, 96) and factorization(1536, 96) == (16, 96)  # ordered small first
    assert factorization(10, 4) == (2, 5)  # 4 does not divide 10: the most square split with a side at most 4
    assert factorization(7) == (1, 7)


def adapted(kind, rank=2, factor=-1, seed=0, dtype=torch.float32):
    """A random nn.Linear(12 -> 20) with a `kind` adapter whose factors are random too (none zero)."""
    torch.manual_seed(seed)
    base = nn.Linear(12, 20).to(dtype)
    layer = {"lora": lambda: LoRALinear(base, rank, 3.0), "dora": lambda: DoRALinear(base, rank, 3.0),
             "lokr": lambda: LoKrLinear(base, rank, 3.0, factor)}[kind]()
    base.requires_grad_(False)
    with torch.no_grad():
        for p in layer.adapter_tensors().values():
            p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.shape[0] == 1 else 0.0))
    return layer


def merged_formula(layer):
    """The layer's weight as the file's reader merges it, by autograd, DoRA's norm a constant."""
    W = layer.weight.float()
    if isinstance(layer, LoKrLinear):
        w2 = layer.lokr_w2_a @ layer.lokr_w2_b if layer.low_rank else layer.lokr_w2
        return W + layer.scale * torch.kron(layer.lokr_w1, w2)
    merged = W + layer.scale * layer.lora_B.weight @ layer.lora_A.weight
    if isinstance(layer, DoRALinear):
        norm = merged.detach().norm(dim=0, keepdim=True) + torch.finfo(torch.float32).eps  # ComfyUI's
        return merged * layer.dora_scale / norm
    return merged


@pytest.mark.parametrize("kind, rank, factor", [("lora", 2, -1), ("dora", 2, -1), ("lokr", 1, -1),
                                                ("lokr", 4, -1), ("lokr", 2, 2)],
                         ids=["lora", "dora", "lokr low-rank w2", "lokr full w2", "lokr factor 2"])
def test_the_forward_is_the_merged_weights_and_the_gradients_are_autograds(kind, rank, factor):
    layer, x = adapted(kind, rank, factor), torch.randn(3, 5, 12)
    out = layer(x)
    reference = F.linear(x, merged_formula(layer), layer.bias)
    assert (out - reference).abs().max() <= 1e-6 * reference.abs().max()
    weights = torch.randn(out.shape)
    mine = torch.autograd.grad((out * weights).sum(), list(layer.adapter_tensors().values()))
    theirs = torch.autograd.grad((reference * weights).sum(), list(layer.adapter_tensors().values()))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    layer.merge()  # the merged layer computes the same
    torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5)


def test_a_fresh_adapter_starts_at_the_base_weights():
    torch.manual_seed(1)
    for make in (lambda base: DoRALinear(base, 4, 4.0), lambda base: LoKrLinear(base, 4, 4.0),
                 lambda base: LoKrLinear(base, 1, 1.0)):
        base = nn.Linear(16, 24)
        x = torch.randn(2, 16)
        expected = base(x)
        torch.testing.assert_close(make(base)(x), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["lokr", "dora"])
def test_the_file_has_comfyuis_keys_and_our_loader_reads_it_back(tmp_path, kind):
    config = CONFIGS["sd3.5-medium-like"]  # attn2 (SD3.5-Medium's second attention) adapted too
    model = randomise(SD3Light(config), seed=3)
    apply_lora(model, ["attention"], rank=2, alpha=4.0, adapter=Adapter(kind))
    torch.manual_seed(2)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.add_(torch.randn(p.shape) * 0.1)
    path = str(tmp_path / "adapter.safetensors")
    save_lora(model, path, fold_alpha=True)
    with safe_open(path, "pt") as f:
        keys = {k: f.get_slice(k).get_shape() for k in f.keys()}
        alphas = {k: f.get_tensor(k).item() for k in keys if k.endswith(".alpha")}
    names = {k.rsplit(".", 1)[0] if kind == "lokr" else k.rsplit(".", 2 if ".lora_" in k else 1)[0] for k in keys}
    assert any(".attn2." in n for n in names) and all(n.startswith("transformer.transformer_blocks.") for n in names)
    width = config.num_attention_heads * config.attention_head_dim
    if kind == "dora":  # the LoRA pair and a magnitude per input column, [1, in]
        assert {k.rsplit(".", 1)[1] if k.endswith("dora_scale") else k.split(".")[-2] for k in keys} == \
            {"lora_A", "lora_B", "dora_scale"}
        assert all(shape == [1, width] for k, shape in keys.items() if k.endswith(".dora_scale"))
        assert not alphas  # alpha / rank folded into B, as our LoRA files do
    else:  # w1 full, w2 low-rank (rank 2 < half its side) or full; alpha beside them, applied where w2 is low-rank
        suffixes = {k.rsplit(".", 1)[1] for k in keys}
        assert suffixes <= {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"} and "lokr_w1" in suffixes
        assert set(alphas.values()) == {4.0} and len(alphas) == len(names)
        for name in names:
            w1 = keys[f"{name}.lokr_w1"]
            w2 = keys[f"{name}.lokr_w2"] if f"{name}.lokr_w2" in keys else \
                [keys[f"{name}.lokr_w2_a"][0], keys[f"{name}.lokr_w2_b"][1]]
            assert w1[0] * w2[0] == width and w1[1] * w2[1] == width  # kron(w1, w2) is the [out, in] weight
    state, adapter_config, _ = read_lora_file(path)
    assert adapter_config["kind"] == kind
    fresh = randomise(SD3Light(config), seed=3)
    attach_lora(fresh, state, adapter_config)
    x = inputs(config, (3, 3))
    torch.testing.assert_close(fresh(*x), model(*x), rtol=1e-5, atol=1e-5)


def test_a_file_of_one_kind_does_not_load_into_layers_of_another():
    config = CONFIGS["plain-a"]
    lokr, dora = SD3Light(config), SD3Light(config)
    apply_lora(lokr, rank=2, adapter=Adapter("lokr"))
    apply_lora(dora, rank=2, adapter=Adapter("dora"))
    with pytest.raises(ValueError) as error:
        load_lora_state_dict(dora, lora_state_dict(lokr))
    assert "lokr" in str(error.value) and "dora" in str(error.value)


def test_dora_on_an_int8_base_is_refused_in_one_line():
    class Int8(torch.Tensor):  # stands for torchao's int8 weight: a tensor subclass
        pass

    base = nn.Linear(4, 4)
    base.weight = nn.Parameter(base.weight.detach().as_subclass(Int8), requires_grad=False)
    with pytest.raises(ValueError) as error:
        DoRALinear(base, 2, 2.0)
    assert "--frozen_dtype bf16" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("kind", ["lora", "dora", "lokr"])
def test_scale_0_is_the_base_model_and_scale_1_as_trained(kind):
    from model.model_lora import set_lora_scale

    config = CONFIGS["plain-a"]
    base = randomise(SD3Light(config), seed=4)
    model = randomise(SD3Light(config), seed=4)
    apply_lora(model, rank=2, adapter=Adapter(kind))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.add_(torch.randn(p.shape) * 0.2)
    x = inputs(config, (3, 3))
    trained = model(*x)
    set_lora_scale(model, 0.0)
    torch.testing.assert_close(model(*x), base(*x), rtol=0, atol=1e-5)
    set_lora_scale(model, 1.0)
    torch.testing.assert_close(model(*x), trained, rtol=0, atol=0)


def test_text_encoder_options_that_cannot_run_are_one_line_each(capsys):
    import trainer.train_lora as train_lora
    from model.components import BuiltinComponents, check_text_names

    for argv, said in ((["--train_text_encoders", "text", "--text_encoder_lr", "1e-4,2e-4"], "one per encoder"),
                       (["--train_text_encoders", "text", "--cuda_graph", "1"], "--cuda_graph 0"),
                       (["--train_text_encoders", "text,text"], "names an encoder twice"),
                       (["--text_encoder_steps", "5"], "name them")):
        with pytest.raises(SystemExit):
            train_lora.parse_args(argv)
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert said in error, error
    with pytest.raises(UserError) as error:  # an encoder the components do not have: the ones they do, named
        check_text_names(("t5",), BuiltinComponents(["circle"]).text_models())
    assert "no t5" in str(error.value) and "use text" in str(error.value)
    assert train_lora.parse_args(["--train_text_encoders", "clip_l,clip_g", "--text_encoder_lr", "1e-5"]) \
        .train_text_encoders == ("clip_l", "clip_g")
    assert train_lora.parse_args(["--train_text_encoders", "text", "--fsdp", "1"]).fsdp  # sharded beside them


def test_a_trained_encoder_run_from_ids_encodes_as_the_cached_one_before_it_trains():
    from model.components import BuiltinComponents
    from model.model_lora import TEXT_TARGETS, lora_parameters

    captions = ["a large red circle", "", "!!!"]  # a blank caption is the unconditional input (zeros), "!!!" is not
    cached, trained = BuiltinComponents(["red", "circle"]), BuiltinComponents(["red", "circle"])
    trained.train_text_encoders(("text",))
    apply_lora(trained.text_models()["text"], TEXT_TARGETS["text"], rank=2)
    features = trained.encode_text(captions)
    assert set(features) == {"text_ids", "text_blank"}
    for ours, theirs in zip(trained.condition(features), cached.encode_prompts(captions)):
        assert torch.equal(ours, theirs) and ours[1].abs().sum() == 0 and ours[2].abs().sum() > 0
    tokens, pooled = trained.condition(features)  # with gradients into the encoder's adapters
    (tokens.sum() + pooled.sum()).backward()
    assert all(p.grad is not None for p in lora_parameters(trained.text_models()["text"]))
