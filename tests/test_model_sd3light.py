"""SD3Light against diffusers' SD3Transformer2DModel: same config, same state dict, same outputs."""
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel

from model.flops import training_flops_per_sample
from model.model_sd3light import (
    PRESETS,
    SD3Light,
    SD3LightConfig,
    StateDictMismatchError,
    count_parameters,
    preset_config,
    presets_table,
)
from tests.conftest import CONFIGS, inputs, random_config, randomise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Latent sizes as multiples of the patch size: the full table, a crop, a non-square crop.
GRIDS = [("full", None), ("crop", (3, 3)), ("non-square", (2, 5))]


def test_config_fields_are_diffusers_constructor_arguments():
    params = inspect.signature(SD3Transformer2DModel.__init__).parameters
    theirs = {n: p.default for n, p in params.items() if n != "self"}
    ours = {f.name: f.default for f in dataclasses.fields(SD3LightConfig)}
    assert list(ours) == list(theirs)
    assert ours == theirs


@pytest.mark.parametrize("name", CONFIGS)
def test_state_dict_keys_shapes_and_buffers_match(name):
    config = CONFIGS[name]
    ours, theirs = SD3Light(config), SD3Transformer2DModel(**config.to_dict())
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    # the fixed position table is a persistent buffer and equals diffusers' own
    assert "pos_embed.pos_embed" in a
    torch.testing.assert_close(a["pos_embed.pos_embed"], b["pos_embed.pos_embed"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("grid_name,grid", GRIDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_diffusers_weights_into_sd3light_give_same_outputs(name, grid_name, grid):
    config = CONFIGS[name]
    torch.manual_seed(0)
    theirs = randomise(SD3Transformer2DModel(**config.to_dict()), seed=1).eval()
    ours = SD3Light(config).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = inputs(config, grid)
    with torch.no_grad():
        expected, got = theirs(*x).sample, ours(*x)
    assert got.shape == (2, config.output_channels, *x[0].shape[-2:])
    assert expected.abs().mean() > 1e-2  # a real, non-trivial output
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("grid_name,grid", GRIDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_sd3light_weights_into_diffusers_give_same_outputs(name, grid_name, grid):
    config = CONFIGS[name]
    ours = randomise(SD3Light(config), seed=2).eval()
    theirs = SD3Transformer2DModel(**config.to_dict()).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = inputs(config, grid, seed=3)
    with torch.no_grad():
        expected, got = theirs(*x).sample, ours(*x)
    assert expected.abs().mean() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_gradients_match_diffusers():
    config = CONFIGS["sd3.5-medium-like"]
    ours = randomise(SD3Light(config), seed=4)
    theirs = SD3Transformer2DModel(**config.to_dict())
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = inputs(config, (3, 4))
    ours(*x).pow(2).mean().backward()
    theirs(*x).sample.pow(2).mean().backward()
    their_grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, their_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_untrained_model_starts_as_adaln_zero():
    config = CONFIGS["plain-a"]
    out = SD3Light(config)(*inputs(config, None))
    assert torch.count_nonzero(out) == 0  # zero output layer: the first prediction is exactly zero


# ---- loud failures


def _model_and_weights():
    config = CONFIGS["plain-a"]
    return SD3Light(config), randomise(SD3Light(config), seed=5).state_dict()


def test_missing_key_is_named():
    model, sd = _model_and_weights()
    del sd["transformer_blocks.0.attn.to_q.weight"]
    with pytest.raises(StateDictMismatchError, match=r"1 missing: transformer_blocks\.0\.attn\.to_q\.weight"):
        model.load_state_dict(sd)


def test_unexpected_key_is_named():
    model, sd = _model_and_weights()
    sd["transformer_blocks.0.attn.to_qq.weight"] = torch.zeros(1)
    with pytest.raises(StateDictMismatchError, match=r"1 unexpected: transformer_blocks\.0\.attn\.to_qq\.weight"):
        model.load_state_dict(sd)


def test_wrong_shape_is_named_with_both_shapes():
    model, sd = _model_and_weights()
    sd["proj_out.weight"] = sd["proj_out.weight"][:-1]
    rows, cols = model.proj_out.weight.shape
    expected = rf"proj_out\.weight \(file \[{rows - 1}, {cols}\], model \[{rows}, {cols}\]\)"
    with pytest.raises(StateDictMismatchError, match=expected):
        model.load_state_dict(sd)


def test_missing_buffer_is_named():
    model, sd = _model_and_weights()
    del sd["pos_embed.pos_embed"]
    with pytest.raises(StateDictMismatchError, match=r"pos_embed\.pos_embed"):
        model.load_state_dict(sd)


def test_prefixed_keys_get_a_hint():
    model, sd = _model_and_weights()
    with pytest.raises(StateDictMismatchError, match=r"'module\.' prefix"):
        model.load_state_dict({"module." + k: v for k, v in sd.items()})


def test_failed_load_changes_nothing():
    model, sd = _model_and_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    del sd["proj_out.bias"]
    with pytest.raises(StateDictMismatchError):
        model.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_grid_larger_than_position_table_is_a_clear_error():
    config = CONFIGS["plain-a"]
    x = inputs(config, (config.pos_embed_max_size + 1, 2))
    with pytest.raises(ValueError, match="exceeds the position table"):
        SD3Light(config)(*x)


@pytest.mark.parametrize("bad,match", [
    (dict(qk_norm="layer_norm"), "qk_norm"),
    (dict(caption_projection_dim=7), "caption_projection_dim"),
    (dict(dual_attention_layers=(9,)), "dual_attention_layers"),
])
def test_invalid_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        random_config(0, **bad)


# ---- config.json interchange


def test_config_json_round_trips_through_diffusers(tmp_path):
    config = CONFIGS["sd3.5-medium-like"]
    config.save_json(tmp_path / "config.json")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temp files left behind
    theirs = SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config(str(tmp_path)))
    for f in dataclasses.fields(SD3LightConfig):
        want = getattr(config, f.name)
        got = theirs.config[f.name]
        assert (tuple(got) if f.name == "dual_attention_layers" else got) == want, f.name
    theirs.save_config(str(tmp_path / "from_diffusers"))
    assert SD3LightConfig.load_json(str(tmp_path / "from_diffusers")) == config


def test_config_json_from_an_older_diffusers_uses_defaults(tmp_path):
    # SD3-medium's config.json predates qk_norm and dual_attention_layers
    d = {"_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.29.0.dev0", "attention_head_dim": 64,
         "caption_projection_dim": 1536, "in_channels": 16, "joint_attention_dim": 4096, "num_attention_heads": 24,
         "num_layers": 24, "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048,
         "pos_embed_max_size": 192, "sample_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert SD3LightConfig.load_json(str(tmp_path / "config.json")) == preset_config("sd3-medium")


def test_config_json_with_unknown_key_or_class_is_refused(tmp_path):
    d = {"_class_name": "SD3Transformer2DModel", **CONFIGS["plain-a"].to_dict(), "use_rope": True}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="use_rope"):
        SD3LightConfig.load_json(str(tmp_path))
    d = {"_class_name": "FluxTransformer2DModel", "num_layers": 19}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="FluxTransformer2DModel"):
        SD3LightConfig.load_json(str(tmp_path))


# ---- presets and counting


def test_published_presets_count_like_diffusers_on_meta_device():
    for name in ("sd3-medium", "sd3.5-medium", "sd3.5-large"):
        config = preset_config(name)
        with torch.device("meta"):
            theirs = SD3Transformer2DModel(**config.to_dict())
        assert count_parameters(config) == sum(p.numel() for p in theirs.parameters()), name
    assert round(count_parameters(preset_config("sd3-medium")) / 1e9, 2) == 2.03


def test_preset_sizes_and_table():
    assert 1e6 < count_parameters(preset_config("tiny")) < 10e6  # a few million: trains on a CPU
    assert 100e6 < count_parameters(preset_config("base")) < 1e9  # a few hundred million
    table = presets_table()
    assert all(name in table for name in PRESETS)
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("huge")


def test_presets_helper_prints_the_table():
    # -X importtime lists every module imported, on stderr: a model built on the meta device (the parameter counts,
    # and the memory plan of every run) imports no torch._dynamo, 2-3 s of CPU at a process's start
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "model.model_sd3light"], cwd=REPO,
                            capture_output=True, text=True, check=True)
    assert "sd3.5-large" in result.stdout and "8056.6M" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert "torch" in imported and not {"torch._dynamo", "torch.fx.experimental.symbolic_shapes"} & imported


def _math_attention(q, k, v, **kwargs):
    # explicit matmuls so torch's FLOP counter sees the attention (it does not count the fused CPU kernel)
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


@pytest.mark.parametrize("name", ["plain-a", "sd3.5-medium-like"])
def test_flop_formula_equals_torch_flop_counter(name, monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    config = CONFIGS[name]
    model = SD3Light(config)
    x = inputs(config, (3, 5), batch=2, text_len=6)
    monkeypatch.setattr(F, "scaled_dot_product_attention", _math_attention)
    with FlopCounterMode(display=False) as counter:
        model(*x).pow(2).mean().backward()
    p = config.patch_size
    assert training_flops_per_sample(config, 3 * p, 5 * p, 6) * 2 == counter.get_total_flops()


# ---- training mechanics


@pytest.mark.parametrize("recomputed", [True, 2], ids=["every block", "the first two"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(recomputed):
    config = CONFIGS["sd3.5-medium-like"]
    plain = randomise(SD3Light(config), seed=6)
    ckpt = SD3Light(config, gradient_checkpointing=recomputed)
    ckpt.load_state_dict(plain.state_dict())
    x = inputs(config, (3, 3))
    for model in (plain, ckpt):
        model(*x).pow(2).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)


def test_compiles_as_one_graph():
    config = CONFIGS["sd3.5-medium-like"]
    model = randomise(SD3Light(config), seed=7).eval()
    x = inputs(config, (3, 3))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: any graph break is an error
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), model(*x), rtol=0, atol=1e-5)


def _ddp_worker(rank, world_size, init_file, result_file):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    config = CONFIGS["sd3.5-medium-like"]
    model = DDP(randomise(SD3Light(config), seed=8))  # find_unused_parameters=False: every parameter must get a grad
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = inputs(config, (3, 3), seed=10 * step + rank)  # each rank its own batch
        model(*x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        torch.save({"same": all(torch.equal(gathered[0], g) for g in gathered)}, result_file)
    # Tear down in order: a DDP wrapper freed after its process group is gone can hang in gloo.
    dist.barrier()
    del model, opt
    dist.destroy_process_group()


def test_trains_under_ddp_with_every_parameter_used(tmp_path):
    import torch.multiprocessing as mp

    result = tmp_path / "result.pt"
    workers = mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(result)), nprocs=2, join=False)
    deadline = time.monotonic() + 180  # a hung collective must fail the test, not stall CI
    while not workers.join(timeout=5):
        if time.monotonic() > deadline:
            for p in workers.processes:
                p.kill()
            pytest.fail("DDP workers did not finish within 180 s")
    assert torch.load(result, weights_only=True)["same"]


def test_bench_script_runs(tmp_path):
    out = subprocess.run([sys.executable, "bench/bench_model.py", "--preset", "tiny", "--batch_size", "1",
                          "--warmup", "0", "--iters", "1"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "ratio SD3Light/diffusers:" in out and "GFLOP/s" in out
