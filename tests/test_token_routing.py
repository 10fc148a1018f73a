"""Token routing (TREAD) and the FLOP count behind MFU: routed tokens skip their blocks unchanged and rejoin in
place, ratio 0 is the unrouted model, routed runs resume bitwise, sampling never routes, bad values are one line,
and the count equals a hand count and torch's FLOP counter."""
import os

import pytest
import torch
import torch.nn.functional as F

import trainer.train_pretrain as train_pretrain
import trainer.train_full_sft as train_full_sft
import trainer.train_lora as train_lora
from model.checkpoint import first_difference, read_manifest
from model.flops import FlopCount, training_flops_per_sample
from model.model_lora import apply_lora, resolve_targets
from model.model_sd3light import SD3Light, SD3LightConfig
from model.token_routing import TokenRoute, TokenRouting
from model.rectified_flow import FlowRecipe, flow_matching_loss
from tests.conftest import CONFIGS, QUIET, final_state, inputs, lora_export, randomise, run_stage, sft_export
from tests.scripts import run_script_here
from tests.test_model_sd3light import _math_attention


@pytest.fixture(scope="module")
def base(pretrained):
    return pretrained


# ---- the model


def test_routed_tokens_skip_their_blocks_unchanged_and_rejoin_in_place():
    config = CONFIGS["sd3.5-medium-like"]  # 4 blocks, dual attention in blocks 0 and 2
    model = randomise(SD3Light(config)).eval()
    x = inputs(config, (3, 4), batch=2)
    routing = TokenRouting.for_model(config, 0.5, 1, -2)  # blocks 1 and 2 see 6 of the 12 image tokens
    route = routing.draw(x[0], torch.Generator().manual_seed(0))
    assert (route.first, route.last) == (1, 2) and route.keep.shape == (2, 6)
    assert not torch.equal(route.keep[0], route.keep[1])  # each sample its own subset
    seen, blocks = {}, model.transformer_blocks
    blocks[0].register_forward_hook(lambda m, args, out: seen.__setitem__("before", out[0]))
    blocks[1].register_forward_pre_hook(lambda m, args: seen.__setitem__("first_in", args[0]))
    blocks[2].register_forward_hook(lambda m, args, out: seen.__setitem__("last_out", out[0]))
    blocks[3].register_forward_pre_hook(lambda m, args: seen.__setitem__("after", args[0]))
    with torch.no_grad():
        model(*x, route=route)
    for b in range(2):
        keep = route.keep[b]
        routed = torch.tensor([i for i in range(12) if i not in keep.tolist()])
        assert torch.equal(seen["first_in"][b], seen["before"][b, keep])  # the kept tokens, in order
        assert torch.equal(seen["after"][b, keep], seen["last_out"][b])  # back in their places
        assert torch.equal(seen["after"][b, routed], seen["before"][b, routed])  # the routed ones unchanged


def test_a_route_keeping_every_token_is_the_unrouted_model_bitwise():
    config = CONFIGS["plain-a"]
    model = randomise(SD3Light(config))
    x = inputs(config, (3, 5), batch=2)
    everything = TokenRoute(torch.arange(15).expand(2, 15), 0, config.num_layers - 1)
    outputs, grads = [], []
    for route in (None, everything):
        model.zero_grad()
        out = model(*x, route=route)
        out.pow(2).mean().backward()
        outputs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.equal(outputs[0], outputs[1])
    assert first_difference(grads[0], grads[1], "grad") is None


def test_ratio_zero_is_a_step_without_routing_and_draws_nothing():
    """A flow-matching step whose recipe has --route_ratio 0 (whatever the blocks) is the unrouted step, bitwise, and
    leaves the generator where the unrouted step leaves it."""
    config = SD3LightConfig(**{**CONFIGS["plain-a"].to_dict(), "num_layers": 2})

    class Components:  # the loss's view of the components: cached features in, their latents and text out
        text_encoders = ("text",)

        def latents(self, features, generator=None):
            return features["latents"]

        def condition(self, features, drop=None):
            return features["tokens"], features["pooled"]

    latents, tokens, pooled, _ = inputs(config, (3, 3), batch=2)
    batch = {"latents": latents, "tokens": tokens, "pooled": pooled}
    common = dict(prediction="v", sigma_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, train_shift=1.0,
                  loss="mse", weighting="none", caption_dropout=0.1)
    results = []
    for routing in (TokenRouting(), TokenRouting.for_model(config, 0.0, 5, 7)):  # off: the blocks are not checked
        model, generator = randomise(SD3Light(config)), torch.Generator().manual_seed(3)
        loss = flow_matching_loss(model, Components(), batch, generator, FlowRecipe(**common, routing=routing))
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}, torch.rand(3, generator=generator)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][2], results[1][2])
    assert first_difference(results[0][1], results[1][1], "grad") is None


def test_a_route_reaches_the_gpu_without_making_the_host_wait(monkeypatch):
    """Drawn on the CPU from the run's generator, then copied from page-locked memory: the copy does not wait for
    the kernels queued before it."""
    class LatentsOnAGPU:
        shape, device = (2, 4, 6, 6), torch.device("cuda")

        def __len__(self):
            return 2

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *args, **kwargs: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kwargs: calls.append((args, kwargs)) or t)
    route = TokenRouting(0.5, 1, 2).draw(LatentsOnAGPU(), torch.Generator().manual_seed(0))
    assert route.keep.shape == (2, 5) and (route.first, route.last) == (1, 2)
    assert calls == ["pin", ((torch.device("cuda"),), {"non_blocking": True})]


def test_bad_routing_values_are_one_line_each(tmp_path, capsys):
    common = ["--max_steps", "1", "--out_dir", str(tmp_path), "--save_dir", str(tmp_path)]
    for extra, said in ((["--route_ratio", "1"], "--route_ratio: must be a number from 0 up to (not including) 1"),
                        (["--route_ratio", "0.5", "--route_first", "4", "--route_last", "1"],
                         "error: --route_first 4 and --route_last 1 do not name blocks first <= last of this "
                         "model's 0..5"),
                        (["--route_ratio", "0.5", "--route_last", "6"], "--route_last 6 do not name blocks")):
        result = run_script_here(train_pretrain, common + extra, capsys)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and said in result.stderr
        assert len(result.stderr.strip().splitlines()) <= 2  # argparse's usage line, then the error


# ---- the stages


@pytest.mark.parametrize("stage", ["sft", "lora"])
def test_a_routed_run_stops_and_resumes_bitwise(tmp_path, base, monkeypatch, stage):
    module, name, export, data = {
        "sft": (train_full_sft, "sft_tiny", sft_export, ["--num_samples", "16"]),
        "lora": (train_lora, "lora_demo_tiny", lora_export, ["--num_samples", "8", "--prior_samples", "8"])}[stage]

    def argv(run_dir, *extra):
        return ["--from_weight", base, *data, "--batch_size", "2", "--max_steps", "6", "--save_interval", "3",
                "--sample_interval", "0", "--route_ratio", "0.5", "--route_first", "1", *QUIET, "--out_dir",
                str(run_dir / "out"), "--save_dir", str(run_dir / "ckpt"), *extra]

    routes = []
    forward = SD3Light.forward

    def watched(model, *args, route=None):
        routes.append(route)
        return forward(model, *args, route=route)

    monkeypatch.setattr(SD3Light, "forward", watched)
    run_stage(module, argv(tmp_path / "whole"), monkeypatch)
    assert sum(r is not None for r in routes) == 6 and all(r.keep.shape == (2, 32) for r in routes if r is not None)
    run_stage(module, argv(tmp_path / "cut"), monkeypatch, signal_at=3 * 2 + 1)  # in step 4
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / f"{name}_resume"), "resume")["step"] == 4
    run_stage(module, argv(tmp_path / "cut", "--from_resume", "1"), monkeypatch)
    whole, cut = final_state(tmp_path / "whole", name, export), final_state(tmp_path / "cut", name, export)
    for key in ("model", "optimizer", "rng", "export", "step", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"] and len(whole["logged"]) == 6


def test_sampling_and_validation_never_route(tmp_path, base, monkeypatch):
    """A routed SFT run draws its step-0 grid, its validation loss and its last grid with every token: each
    no-gradient forward gets no route, and the step-0 grid is the unrouted run's, byte for byte."""
    calls = []
    forward = SD3Light.forward

    def watched(model, *args, route=None):
        calls.append((torch.is_grad_enabled(), route is not None))
        return forward(model, *args, route=route)

    monkeypatch.setattr(SD3Light, "forward", watched)
    grids = []
    for run_dir, extra in ((tmp_path / "plain", []), (tmp_path / "routed", ["--route_ratio", "0.5"])):
        calls.clear()
        run_stage(train_full_sft, ["--from_weight", base, "--num_samples", "16", "--batch_size", "2", "--max_steps",
                                   "2", "--val_data", "builtin", "--val_samples", "8", "--val_interval", "1", *QUIET,
                                   *extra, "--out_dir", str(run_dir / "out"), "--save_dir", str(run_dir / "ckpt")],
                  monkeypatch)
        assert any(not grad for grad, _ in calls)  # grids and validation ran
        assert not any(routed for grad, routed in calls if not grad)
        assert sum(routed for grad, routed in calls if grad) == (2 if extra else 0)
        with open(os.path.join(run_dir, "out", "samples", "sft_tiny_step000000.png"), "rb") as f:
            grids.append(f.read())
    assert grids[0] == grids[1]


# ---- the FLOP count


def test_the_flop_count_of_a_small_config_equals_a_hand_count():
    config = SD3LightConfig(sample_size=4, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                            num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=16,
                            pooled_projection_dim=8, out_channels=4, pos_embed_max_size=4)
    # width D 16, a 4 x 4 latent: N = 4 image tokens; L = 3 text tokens. Multiply-adds of one sample's forward:
    first = 4 * 16 * 16 + 3 * 8 * 16 + 256 * 16 + 8 * 16  # patchify, context embedder, the embedders' first linears
    rest = 2 * 16 * 16  # the embedders' second linears
    rest += 12 * 16 * 16 + 4 * 12 * 16 * 16 + 3 * 12 * 16 * 16 + 2 * 7 * 7 * 16  # block 0: adaLN, image, text, attn
    rest += 8 * 16 * 16 + 4 * 12 * 16 * 16 + 3 * 3 * 16 * 16 + 2 * 7 * 7 * 16  # block 1 (last): text q, k, v only
    rest += 2 * 16 * 16 + 4 * 16 * 16  # norm_out, proj_out
    # backward: two products per product, but the first layers' inputs need no gradient; 2 FLOPs a multiply-add
    assert FlopCount(config, 3).forward(1, 4, 4).model == 2 * (2 * first + 3 * rest) == 300928
    assert training_flops_per_sample(config, 4, 4, 3) == 300928
    # routing half the image tokens past block 0: it sees 2 image tokens, 5 tokens in all
    routed = 3 * 2 * (4 * 12 * 16 * 16 + 2 * 7 * 7 * 16 - 2 * 12 * 16 * 16 - 2 * 5 * 5 * 16)
    routing = TokenRouting.for_model(config, 0.5, 0, 0)
    assert FlopCount(config, 3, routing).forward(1, 4, 4).model == 300928 - routed
    assert FlopCount(config, 3, routing).forward(1, 4, 4, grad=False).forward == 2 * (first + rest)  # never routed
    # gradient checkpointing recomputes the blocks' forward, counted apart
    blocks = 12 * 16 * 16 + 4 * 12 * 16 * 16 + 3 * 12 * 16 * 16 + 2 * 7 * 7 * 16 + 8 * 16 * 16 + 4 * 12 * 16 * 16 + \
        3 * 3 * 16 * 16 + 2 * 7 * 7 * 16
    flops = FlopCount(config, 3, checkpointing=True).forward(2, 4, 4)
    assert flops.model == 2 * 300928 and flops.recompute == 2 * 2 * blocks


def counted(model, x, route=None):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(*x, route=route).pow(2).mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["plain-b", "sd3.5-medium-like"])
def test_the_flop_count_equals_torch_flop_counter_routed_with_lora_and_checkpointing(name, monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", _math_attention)
    config = CONFIGS[name]
    p, x = config.patch_size, inputs(config, (4, 4), batch=2, text_len=5)
    routing = TokenRouting.for_model(config, 0.3, 1, -1)  # 16 image tokens, 12 kept in blocks 1 to the last
    route = routing.draw(x[0], torch.Generator().manual_seed(0))
    model = randomise(SD3Light(config))
    assert FlopCount(config, 5, routing).forward(2, 4 * p, 4 * p).model == counted(model, x, route)
    targets = resolve_targets("attention")
    apply_lora(model, targets, rank=3)
    lora = FlopCount(config, 5, routing, (3, targets))
    assert lora.forward(2, 4 * p, 4 * p).model == counted(model, x, route)
    model.gradient_checkpointing = True
    flops = FlopCount(config, 5, routing, (3, targets), checkpointing=True).forward(2, 4 * p, 4 * p)
    assert flops.model + flops.recompute == counted(model, x, route)
