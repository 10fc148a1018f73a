"""A full fine-tune's memory levers: bf16 weights updated by stochastic rounding, the optimizer step fused into
backward; each resumes bitwise, and what it does not go with is one line before any work."""
import pytest
import torch

import trainer.train_full_sft as train_full_sft
from model.checkpoint import first_difference, read_manifest
from model.errors import UserError
from trainer.mechanics.optimizers import StepInBackward, adamw

from tests.conftest import QUIET, final_state, narrow_tiny, pretrain_weights, run_stage, sft_export


def narrow_pretrain_weights(out_dir):
    with pytest.MonkeyPatch.context() as patch:
        narrow_tiny(patch)
        pretrain_weights(out_dir)


@pytest.fixture(scope="module")
def base(shared):
    """pretrain_weights of the tiny model cut to one block 64 wide (narrow_tiny): these modes compute in bf16,
    which a CPU without AVX-512 BF16 emulates some 50x slower; what they check is the same on any size of model."""
    return str(shared("pretrained_narrow", narrow_pretrain_weights) / "pretrain_tiny.json")


MODES = {
    "bf16": ["--trained_dtype", "bf16"],
    "bf16_8bit_in_backward": ["--trained_dtype", "bf16", "--optimizer", "adamw8bit", "--step_in_backward", "1"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_each_memory_mode_stops_and_resumes_bitwise(tmp_path, base, monkeypatch, mode):
    def argv(run_dir, *extra):
        return ["--from_weight", base, "--num_samples", "24", "--batch_size", "2", "--max_steps", "7",
                "--save_interval", "3", "--sample_interval", "0", *QUIET, *MODES[mode],
                "--out_dir", str(run_dir / "out"), "--save_dir", str(run_dir / "ckpt"), *extra]

    run_stage(train_full_sft, argv(tmp_path / "whole"), monkeypatch)
    # the signal comes while step 4's batch is fetched (2 samples a step): the step completes first
    run_stage(train_full_sft, argv(tmp_path / "cut"), monkeypatch, signal_at=2 * 3 + 1)
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / "sft_tiny_resume"), "resume")["step"] == 4
    run_stage(train_full_sft, argv(tmp_path / "cut", "--from_resume", "1"), monkeypatch)
    whole, cut = (final_state(tmp_path / run, "sft_tiny", sft_export) for run in ("whole", "cut"))
    assert whole["step"] == 7
    for key in ("model", "ema", "optimizer", "rng", "export", "step", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"]
    assert all(v.dtype == torch.bfloat16 for v in whole["model"].values() if v.is_floating_point())
    assert len({row["loss"] for row in whole["logged"]}) == 7  # it trained


def test_stochastic_rounding_keeps_updates_smaller_than_bf16s_gap():
    """A weight of 1.0 pushed by steps of a tenth of bf16's gap there: rounded to the nearest it never moves,
    rounded stochastically it moves by the sum of the steps on average."""
    moved = {}
    for rounding in ("nearest", "stochastic"):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = adamw([weight], 2 ** -7 / 10, 0.0, bf16_rounding=rounding)  # the gap at 1.0 is 2 ** -7
        for _ in range(20):
            weight.grad = torch.ones_like(weight)  # Adam's step is then the learning rate
            optimizer.step()
        moved[rounding] = (1 - weight.float()).mean().item()
    assert moved["nearest"] == 0.0
    assert moved["stochastic"] == pytest.approx(20 * 2 ** -7 / 10, rel=0.1)


def test_the_step_in_backward_equals_the_step_after_it():
    """A parameter stepped in its gradient's hook ends where an optimizer step after backward puts it, its
    gradient freed, the norm the same as clip_grad_norm_'s; each parameter is clipped alone."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(4, 8)
    fused = StepInBackward(layers[0].parameters(), 0.1, 0.0, False, None, grad_clip=100.0)
    layers[0](x).square().sum().backward()
    assert all(p.grad is None for p in layers[0].parameters())
    optimizer = adamw(layers[1].parameters(), 0.1, 0.0)
    layers[1](x).square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(layers[1].parameters(), 100.0).item()
    optimizer.step()
    assert fused.grad_norm() == pytest.approx(norm, rel=1e-6)
    for a, b in zip(layers[0].parameters(), layers[1].parameters()):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("extra, needle", [
    (["--step_in_backward", "1", "--accumulation_steps", "2"], "--step_in_backward 1 steps each parameter"),
    (["--trained_dtype", "bf16", "--dtype", "fp32"], "--dtype fp32 with --trained_dtype bf16"),
])
def test_what_a_memory_mode_does_not_go_with_is_one_line(tmp_path, base, monkeypatch, extra, needle):
    monkeypatch.setattr(train_full_sft, "load_network", None)  # nothing may be loaded before the refusal
    with pytest.raises(UserError, match=needle):
        train_full_sft.main(["--from_weight", base, "--max_steps", "1", "--out_dir", str(tmp_path),
                             "--save_dir", str(tmp_path), *extra])


def test_what_several_processes_do_not_go_with_is_one_line():
    """Refused before anything is loaded: the step in backward on several processes, bf16 weights under FSDP."""
    from model.precision import StagePrecision, run_precision
    from trainer.mechanics.distributed import DistInfo
    from trainer.mechanics.optimizers import check_step_in_backward

    with pytest.raises(UserError, match="--step_in_backward 1 runs on one process"):
        check_step_in_backward(1, 2)
    sharded = DistInfo(world_size=2, mesh=object())
    with pytest.raises(UserError, match="--trained_dtype bf16 with --fsdp 1 is not supported"):
        run_precision("auto", "auto", StagePrecision("sft"), sharded, trained="bf16")
    assert run_precision("auto", "auto", StagePrecision("sft"), DistInfo(world_size=2), trained="bf16").compute == \
        "bf16"  # under DDP it trains (computing in bf16)


def test_the_estimate_counts_the_modes_and_names_the_levers_that_would_fit(monkeypatch):
    import model.memory as memory
    from model.model_sd3light import count_parameters, preset_config
    from model.precision import Precision
    from trainer.mechanics.distributed import DistInfo

    config, plan = preset_config("sd3.5-medium"), memory.MemoryPlan(("trained",), "adamw", True, "auto", 1, 64, True)
    params = count_parameters(config)
    lean = memory.estimate(config, memory.replace(plan, optimizer="adamw8bit", ema=False, trained_dtype="bf16"),
                           "bf16", 1, 0, 0, "cuda")
    assert lean["weights"] == lean["gradients"] == 2 * params and lean["optimizer"] < 2.1 * params
    fused = memory.estimate(config, memory.replace(plan, trained_dtype="bf16", step_in_backward=True), "bf16", 1, 0,
                            0, "cuda")
    assert fused["gradients"] < 0.02 * 2 * params and fused["optimizer"] == 4 * params  # bf16 moments
    # text encoders' adapters (--train_text_encoders): their fp32 gradients, AdamW's moments and the EMA on top
    lora = memory.replace(plan, networks=(9_437_184,))
    alone, text = (memory.estimate(config, memory.replace(lora, text_adapters=n), "bf16", 1, 0, 0, "cuda")
                   for n in (0, 1_000_000))
    assert {k: text[k] - alone[k] for k in alone if text[k] != alone[k]} == \
        {"gradients": 4_000_000, "optimizer": 8_000_000, "EMA": 4_000_000}
    # and what their forward keeps for backward, a part of its own (not room the transformer's activations take)
    kept = memory.estimate(config, memory.replace(lora, text_activations=3_000_000), "bf16", 1, 0, 0, "cuda")
    assert kept["text activations"] == 3_000_000 and "text activations" not in alone
    assert sum(kept.values()) - sum(alone.values()) == 3_000_000

    class Components:
        spec, t5_max_length, downscale = {"kind": "sd3"}, 77, 8

        def parameters(self):
            return []

        buffers = parameters

    monkeypatch.setattr(memory, "device_memory", lambda device: 24 * memory.GIB)  # a 24 GB card's worth
    line, warning = memory.estimate_lines(config, plan, Components(), Precision(), DistInfo())
    assert "--trained_dtype bf16 --optimizer adamw8bit --step_in_backward 1" in warning.split("would fit:")[1]
    assert "--optimizer adamw8bit;" not in warning  # with the fp32 EMA it would not fit alone


def test_the_estimate_names_the_largest_micro_batch_that_fits():
    """The estimate line on a GPU names the largest micro-batch whose activations fit, every block recomputed."""
    import model.memory as memory
    from model.model_sd3light import preset_config

    config = preset_config("sd3.5-medium")
    plan = memory.MemoryPlan((1,), "adamw", False, "auto", 1, 1024, True)
    room = memory.activation_bytes(config, 5, 1024, 8, 333, True, 2)
    assert memory.largest_batch(config, plan, room, (8, 333), 2) == 5
    assert memory.largest_batch(config, plan, room - 1, (8, 333), 2) == 4
    assert memory.largest_batch(config, plan, 0, (8, 333), 2) == 0


def test_a_gpu_runs_estimate_line_names_its_blocks_recomputed_and_largest_batch(monkeypatch):
    import model.memory as memory
    from model.model_sd3light import preset_config
    from model.precision import Precision
    from trainer.mechanics.distributed import DistInfo

    class Components:
        spec, t5_max_length, downscale = {"kind": "sd3"}, 256, 8

        def parameters(self):
            return []

        buffers = parameters

    monkeypatch.setattr(memory, "device_memory", lambda device: 24 * memory.GIB)
    config, gpu = preset_config("sd3.5-medium"), DistInfo(device=torch.device("cuda"))
    plan = memory.MemoryPlan((9_437_184,), "adamw", False, "auto", 1, 1024, "auto")
    plan = memory.fitted_plan(config, plan, memory.device_memory(gpu.device),
                              *memory.run_holding(Components(), Precision("bf16", "bf16"), gpu))
    assert plan.checkpointing == 0  # an SD3.5-Medium LoRA at batch 1 on 24 GB: nothing recomputed
    line, = memory.estimate_lines(config, plan, Components(), Precision("bf16", "bf16"), gpu)
    largest = int(line.split("fits 80% of it: ")[1].split()[0])
    assert "blocks recomputed in backward: 0 of 24" in line and 4 <= largest <= 16, line


def test_what_a_trained_text_encoder_keeps_for_backward_is_measured_without_its_weights():
    from model import memory
    from model.components import BuiltinComponents
    from model.model_lora import TEXT_TARGETS, apply_lora

    components = BuiltinComponents(["circle"])
    assert memory.text_activation_bytes(components) == 0  # nothing trains: nothing is kept
    components.train_text_encoders(("text",))
    encoder = components.text_models()["text"]
    apply_lora(encoder, TEXT_TARGETS["text"], rank=8)
    kept = memory.text_activation_bytes(components)
    # one caption's tokens through its layers: at least each layer's input and its MLP's [tokens, 4 * width]
    # output in fp32, and far less than the weights, which are not counted
    width, tokens, layers = 128, 24, 2
    assert layers * tokens * 5 * width * 4 <= kept < sum(p.numel() * 4 for p in encoder.parameters())
