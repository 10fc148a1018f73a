"""Block swap (model/block_swap.py): the first blocks' weights held apart in host memory and copied in around each
use compute bit for bit what resident blocks do (a LoRA on a bf16 or int8 base, a full fine-tune stepped in
backward with its optimizer state, T5 streamed by layer); nothing backward keeps holds a weight; the stages train
and resume across a change of the count bit for bit; the estimate and the plan; what it does not go with."""
import json
import dataclasses

import pytest
import torch

import trainer.train_dpo as train_dpo
import trainer.train_full_sft as train_full_sft
import trainer.train_lora as train_lora
from model.block_swap import BlockSwap, HostMemory, host_arena_bytes, module_slots, packed, pieces_of, swap_request
from model.checkpoint import first_difference, load_safetensors, read_manifest
from model.errors import UserError
from model.model_lora import apply_lora, lora_parameters, read_lora_file
from model.model_sd3light import SD3Light
from model.precision import int8_weights
from trainer.mechanics.optimizers import StepInBackward

from tests.conftest import (
    compiled_as_captured, dirs, final_state, inputs, random_config, randomise, shape_pairs,
)
from tests.scripts import run_in_process
from model import checkpoint

# four blocks of three shapes: a second attention in blocks 0 and 2, plain block 1, the context-only last block
CONFIG = random_config(4, qk_norm="rms_norm", num_layers=4, dual_attention_layers=(0, 2))


def lora_model(int8=False):
    model = randomise(SD3Light(CONFIG), 0)
    if int8:
        model = model.to(torch.bfloat16).requires_grad_(False)
        int8_weights(model)
    apply_lora(model, ["attention", "ff"], rank=4)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def grads_of(model, x, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(*x).float().square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def at_rest(swap):
    """Nothing in, held or kept; every swapped tensor the module holds is the one at home."""
    homes = [(pieces_of(slot.get())[0], slot.home) for slots in swap.slots for slot in slots]
    return not (swap.loaded or swap.held or swap.kept) and all(
        a.data_ptr() == b.data_ptr() for held, home in homes for a, b in zip(held, home))


@pytest.mark.parametrize("int8", [False, True], ids=["fp32 base", "int8 base"])
@pytest.mark.parametrize("count", [3, 4])
def test_a_swapped_lora_computes_bit_for_bit_what_resident_blocks_do(int8, count):
    x = inputs(CONFIG, None, seed=0)
    resident, swapped = lora_model(int8), lora_model(int8)
    swapped.block_swap = swap = BlockSwap(swapped.transformer_blocks, count, "cpu")
    expected, got = grads_of(resident, x, int8), grads_of(swapped, x, int8)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert at_rest(swap)
    shapes = {swap.shape_of(i) for i in range(count)}
    assert len(shapes) == (3 if count == 4 else 2) and swap.buffers_made <= 2 * len(shapes)  # buffers follow shapes
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=int8):
        assert torch.equal(resident(*x), swapped(*x))
        with swap.streaming(1):  # a grid where the card has room: only the first block streams
            assert torch.equal(resident(*x), swapped(*x)) and set(swap.kept) == set(range(1, count))
    assert at_rest(swap)


def test_nothing_backward_keeps_holds_a_swapped_weight():
    """Between forward and backward every buffer is filled with NaN: backward copies the weights in again, so the
    gradients are still those of resident blocks."""
    x = inputs(CONFIG, None, seed=1)
    resident, swapped = lora_model(), lora_model()
    swapped.block_swap = swap = BlockSwap(swapped.transformer_blocks, 4, "cpu")
    expected = grads_of(resident, x)
    loss = swapped(*x).square().mean()
    for pool in swap.pools.values():
        for buffer in pool:
            buffer.memory.view(torch.float32).fill_(float("nan"))
    loss.backward()
    assert all(torch.equal(expected[name], p.grad) for name, p in swapped.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("dtype, eight_bit", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32 AdamW", "bf16 8-bit AdamW"])
def test_a_full_fine_tune_stepped_in_backward_swaps_weights_and_optimizer_state(dtype, eight_bit, monkeypatch):
    compiled_as_captured(monkeypatch)  # torchao compiles its 8-bit step: captured, computed as eager (quicker here)

    def trained(count):
        model = randomise(SD3Light(CONFIG), 0).to(dtype)
        fused = StepInBackward(model.parameters(), 1e-3, 0.01, eight_bit,
                               "stochastic" if dtype == torch.bfloat16 else None, 1.0)
        if count:
            model.block_swap = BlockSwap(model.transformer_blocks, count, "cpu", fused.optimizer_of)
        torch.manual_seed(0)  # stochastic rounding draws from it, in the order parameters are stepped
        for step in range(3):
            grads_of(model, inputs(CONFIG, None, seed=step), autocast=dtype == torch.bfloat16)
        state = {name: [pieces_of(v)[0] for v in fused.optimizer_of[p].state[p].values()]
                 for name, p in model.named_parameters()}
        return model, state

    (resident, expected), (swapped, got) = trained(0), trained(4)
    for (name, a), b in zip(resident.named_parameters(), swapped.parameters()):
        assert torch.equal(a, b), name
        assert first_difference(expected[name], got[name], name) is None
    swap = swapped.block_swap
    assert at_rest(swap) and len(swap.state_home) > 0  # the state was written home, and is held there


def test_t5_streamed_by_layer_encodes_what_it_does_whole(sd3):
    from model.components import SD3Components

    prompts = ["a red circle", "two blue squares on the left"]
    whole, streamed = SD3Components(sd3), SD3Components(sd3)
    streamed.stream_text_encoders(("T5",))
    expected, got = whole.encode_text(prompts), streamed.encode_text(prompts)
    assert streamed.t5_swap is not None and streamed.t5_swap.count == len(streamed.t5.encoder.block)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_pinned_memory_that_cannot_be_had_falls_back_with_a_warning(monkeypatch):
    """A container's locked-memory limit refuses pinned memory: the arenas are pageable, said once."""
    empty = torch.empty

    def refused(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refused)
    said, host = [], HostMemory(True, None)
    host.log = said.append
    model = randomise(SD3Light(CONFIG), 0).requires_grad_(False)
    host.home([module_slots(block, False) for block in model.transformer_blocks])
    assert not host.pin and len(said) == 1 and said[0].startswith("warning: pinned host memory is not available")
    assert "ulimit -l" in said[0] and all(not arena.is_pinned() for arena in host.arenas)


def test_host_memory_comes_in_arenas_of_powers_of_two_that_waste_little():
    """torch's pinned-memory cache rounds an allocation up to a power of two: blocks are packed into arenas of that
    size, each filled as far as its blocks go."""
    block = 212_999_680 * 2  # an SD3.5-Large block in bf16: 406 MiB
    arenas = packed([block] * 36)
    assert [size for size, _ in arenas] == [2 ** 32] * 3 + [2 ** 31, 2 ** 29]  # 10, 10, 10, 5 blocks and 1
    assert sum(len(members) for _, members in arenas) == 36 and [m for _, ms in arenas for m in ms] == list(range(36))
    assert host_arena_bytes([block] * 36) < 1.03 * 36 * block
    assert packed([3, 3, 3]) == [(8, [0, 1]), (4, [2])]


# ----------------------------------------------------------------------------------------------------------------
# The stages: 20 steps with blocks swapped and without, and a resume across a change of the count


STEPS = ["--batch_size", "2", "--num_samples", "8", "--warmup_steps", "0", "--min_lr_ratio", "1", "--sample_interval",
         "0", "--sample_steps", "1", "--save_interval", "10"]
STAGES = {  # fp32 here, which this CPU computes fast (the unit tests above take bf16, int8 and 8-bit AdamW)
    "lora": (train_lora, "lora_demo_sd3-tiny", ["--prior_data", "none", "--frozen_dtype", "fp32"]),
    "fused full fine-tune": (train_full_sft, "sft_sd3-tiny", ["--step_in_backward", "1"]),
}


def exported(run_dir, name):
    if name.startswith("lora"):
        return read_lora_file(str(run_dir / "out" / "lora" / f"{name}.safetensors"))[0]
    stem = str(run_dir / "out" / name)
    return load_safetensors(checkpoint.checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_stage_with_blocks_swapped_trains_and_resumes_bit_for_bit(tmp_path, sd3, monkeypatch, stage):
    """20 steps without a swap; the same 10 steps with both blocks of sd3-tiny swapped (two shapes: the last is
    context-only), then resumed to 20 with one: the losses, the weights, the optimizer state are the same bits. The
    runs share a cache: after the first, whose cache and grid prompts are complete, the text encoders never run."""
    from model.components import SD3Components

    module, name, extra = STAGES[stage]

    def argv(run_dir, steps, count):
        return ["--base", sd3, "--from_weight", "base", "--preset", "sd3-tiny", "--data", "builtin", *STEPS, *extra,
                "--max_steps", str(steps), "--blocks_to_swap", str(count), *dirs(run_dir), "--cache_dir",
                str(tmp_path / "cache")]

    run_in_process(module, argv(tmp_path / "whole", 20, 0), monkeypatch)
    monkeypatch.setattr(SD3Components, "text_encoders_in", None)  # calling it would fail the runs
    _, first = run_in_process(module, argv(tmp_path / "swapped", 10, 2), monkeypatch)
    _, then = run_in_process(module, argv(tmp_path / "swapped", 20, 1) + ["--from_resume", "1"], monkeypatch)
    for messages, count in ((first, 2), (then, 1)):  # it swapped, and said what that saves on a CPU
        assert any(f"blocks swapped to host memory: {count} of 2" in m for m in messages)
        assert any(m.startswith("--blocks_to_swap on a CPU") and m.endswith("it saves nothing") for m in messages)
    whole, swapped = (final_state(tmp_path / run, name, lambda run_dir: exported(run_dir, name))
                      for run in ("whole", "swapped"))
    assert whole["step"] == 20 and len({row["loss"] for row in whole["logged"]}) == 20  # it trained
    for key in ("model", "optimizer", "export", "samples_seen"):
        assert first_difference(whole[key], swapped[key], key) is None, key
    assert whole["logged"] == swapped["logged"]


def test_flow_dpo_with_adapters_swaps_its_base(tmp_path, sd3, monkeypatch):
    (tmp_path / "pairs.jsonl").write_text("\n".join(shape_pairs(tmp_path, 4)) + "\n")
    losses = {}
    for count in (0, 2):
        run_dir = tmp_path / f"swap{count}"
        run_in_process(train_dpo, ["--base", sd3, "--from_weight", "base", "--preset", "sd3-tiny", "--pairs",
                              str(tmp_path / "pairs.jsonl"), "--lora_rank", "4", "--batch_size", "2", "--max_steps",
                              "2", "--sample_steps", "1", "--blocks_to_swap", str(count), *dirs(run_dir)], monkeypatch)
        with open(run_dir / "out" / "lora_dpo_sd3-tiny_metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        losses[count] = [{k: row[k] for k in ("step", "dpo", "reward_accuracy", "reward_margin")} for row in rows
                         if "dpo" in row]
    assert len(losses[0]) == 2 and losses[0] == losses[2]


# ----------------------------------------------------------------------------------------------------------------
# What it does not go with: one line, before anything is loaded


@pytest.mark.parametrize("module, extra, needle", [
    (train_lora, ["--blocks_to_swap", "7"], "--blocks_to_swap 7: this model has 6 blocks; pass at most 6"),
    (train_full_sft, ["--blocks_to_swap", "2"], "add --step_in_backward 1 --accumulation_steps 1"),
    (train_dpo, ["--blocks_to_swap", "2"], "Flow-DPO swaps the blocks of a frozen base: pass --lora_rank"),
], ids=["too many", "full fine-tune", "dpo"])
def test_what_block_swap_does_not_go_with_is_one_line(tmp_path, pretrained, monkeypatch, module, extra, needle):
    monkeypatch.setattr(module, "load_components", None)  # refused before anything is loaded
    with pytest.raises(UserError, match=needle):
        module.main(["--from_weight", pretrained, "--max_steps", "1", *dirs(tmp_path), *extra])


def test_under_fsdp_a_count_is_refused_and_auto_swaps_nothing():
    with pytest.raises(UserError, match="--blocks_to_swap with --fsdp 1 is not supported"):
        swap_request(3, True, None, 24)
    assert swap_request("auto", True, None, 24) == 0 and swap_request("auto", False, None, 24) == "auto"
    assert swap_request("auto", False, "a full fine-tune not stepped in backward", 24) == 0


# ----------------------------------------------------------------------------------------------------------------
# The estimate and the plan


def test_the_estimate_moves_swapped_weights_to_the_host_and_counts_two_buffers_a_shape():
    from model import memory
    from model.model_sd3light import meta_model, preset_config

    config = preset_config("sd3.5-medium")  # blocks 0-12 with a second attention, 13-22 plain, 23 context-only
    blocks = memory.block_shapes(meta_model(config))
    sizes = [size for size, _ in blocks]
    assert memory.swap_sizes(blocks, 14) == (sum(sizes[:14]), sizes[0] + sizes[1] + sizes[13])
    assert memory.swap_sizes(blocks, 24) == (sum(sizes), 2 * sizes[0] + 2 * sizes[13] + sizes[23])
    lora = memory.MemoryPlan((9_437_184,), "adamw", False, "auto", 1, 1024, True)
    none, some = (memory.estimate(config, memory.replace(lora, blocks_to_swap=n), "int8", 1, 0, 0, "cuda")
                  for n in (0, 14))
    assert none["weights"] - some["weights"] == memory.frozen_bytes("int8") * sum(sizes[:14])
    assert some["swap buffers"] == memory.frozen_bytes("int8") * (sizes[0] + sizes[1] + sizes[13])
    fused = memory.MemoryPlan(("trained",), "adamw8bit", True, "auto", 1, 1024, True, "bf16", True, 6)
    pinned, pageable = memory.swap_host_bytes(config, fused, "bf16")
    weights, state = 2 * sizes[0], memory.OPTIMIZER_BYTES["adamw8bit"] * sizes[0]  # blocks 0-5: one shape
    assert pinned == host_arena_bytes([weights] * 6) + 6 * host_arena_bytes([state])  # a block's state apart
    assert 6 * (weights + state) < pinned < 1.25 * 6 * (weights + state) and pageable == 4 * 6 * sizes[0]  # EMA


def test_auto_recomputes_every_block_before_it_swaps_one():
    from model import memory
    from model.model_sd3light import preset_config

    config, gib = preset_config("sd3.5-large"), memory.GIB
    plan = memory.MemoryPlan((23_000_000,), "adamw", False, "auto", 1, 1024, "auto", blocks_to_swap="auto")
    holding, latent, value_bytes = ("int8", 1, 0.16 * gib, "cuda"), (8, 154), memory.kept_value_bytes("bf16", "cuda")
    roomy, small, cpu = (memory.fitted_plan(config, plan, card * gib, (*holding[:3], device), latent, value_bytes)
                         for card, device in ((24, "cuda"), (8, "cuda"), (8, "cpu")))
    assert roomy.blocks_to_swap == 0 and roomy.checkpointing < 38  # it fits with some blocks not even recomputed
    assert 0 < small.blocks_to_swap < 38 and small.checkpointing == 38  # every block recomputed, the fewest swapped
    less = memory.replace(small, blocks_to_swap=small.blocks_to_swap - 1)
    parts = memory.estimate(config, less, "int8", 1, memory.activation_bytes(config, 1, 1024, *latent, 38, value_bytes),
                            holding[2], "cuda")
    assert sum(parts.values()) > 0.8 * 8 * gib  # one fewer would not fit
    assert cpu.blocks_to_swap == 0  # a CPU's memory is the host's: nothing to gain


def test_the_cache_build_streams_t5_only_where_the_encoders_do_not_fit():
    from model.memory import GIB, cache_build_plan

    from tests.card_estimate import SD3_ENCODERS

    whole, parts = cache_build_plan(SD3_ENCODERS, 4, 1024, 24 * GIB, "cuda")
    assert whole == () and parts["T5"] == SD3_ENCODERS["T5"][0]
    streamed, parts = cache_build_plan(SD3_ENCODERS, 1, 1024, 8 * GIB, "cuda")
    assert streamed == ("T5",) and sum(parts.values()) <= 0.8 * 8 * GIB
    assert parts["T5 streamed"] == SD3_ENCODERS["T5"][0] - SD3_ENCODERS["T5"][1] + SD3_ENCODERS["T5"][2]


def test_a_grid_fits_the_room_left_in_parts_and_with_fewer_blocks_streamed():
    from model import memory
    from model.model_sd3light import preset_config

    config, gib = preset_config("sd3.5-large"), memory.GIB
    tokens, block = 4096 + 154, 0.2 * gib  # 1024 px; an int8 block
    decode = memory.VAE_DECODE_VALUES * 2 * 1024 ** 2
    assert memory.sampling_fit(config, 40 * gib, (32, block), 8, tokens, decode) == (8, 0)  # all in, all at once
    per_forward, streamed = memory.sampling_fit(config, 3 * gib, (32, block), 8, tokens, decode)
    assert per_forward < 8 and 0 < streamed < 32  # in parts, and some blocks brought in
    need = memory.sampling_need(config, per_forward, tokens, decode)
    assert need <= 3 * gib and need + (32 - streamed) * block <= 3 * gib < need + (33 - streamed) * block
    assert memory.sampling_fit(config, 0, (32, block), 8, tokens, decode) == (1, 32)  # nothing left: one at a time


def test_prompts_drawn_in_parts_are_the_images_drawn_at_once():
    from eval.sampling import sample_images
    from model.components import BuiltinComponents
    from model.rectified_flow import Sampler
    from model.model_sd3light import preset_config

    components = BuiltinComponents(["red", "circle", "blue", "square"])
    config = preset_config("tiny", num_layers=2)
    model = randomise(SD3Light(config), 0).eval()
    prompts, sampler = ["red circle", "blue square", "red square", ""], Sampler(32, 2, 2.0, 3.0, "v")
    whole = sample_images(model, components, prompts, 5, sampler, "cpu")
    parts = sample_images(model, components, prompts, 5, dataclasses.replace(sampler, batch=3), "cpu")
    assert torch.allclose(whole, parts, atol=1e-5)


def test_the_host_is_warned_before_loading_where_it_has_too_little(monkeypatch):
    from model import memory
    from model.model_sd3light import preset_config

    config, gib = preset_config("sd3.5-large"), memory.GIB
    plan = memory.MemoryPlan((23_000_000,), "adamw", False, "auto", 1, 1024, 38, blocks_to_swap=36)
    monkeypatch.setattr(memory, "host_memory", lambda: 8 * gib)
    monkeypatch.setattr(memory, "locked_memory_limit", lambda: 64 * 2 ** 10)  # docker's default
    host, memlock = memory.swap_lines(config, plan, "bf16", torch.device("cuda"))
    pinned, _ = memory.swap_host_bytes(config, plan, "bf16")
    assert 14 * gib < pinned < 15 * gib  # 36 blocks of 0.40 GiB, in arenas
    assert host.startswith(f"warning: the swapped blocks take {pinned / gib:.1f} GiB of host memory and the host "
                           "has 8.0")
    assert "--frozen_dtype int8" in host and "ulimit -l" in memlock
    monkeypatch.setattr(memory, "host_memory", lambda: 64 * gib)
    monkeypatch.setattr(memory, "locked_memory_limit", lambda: None)  # unlimited
    assert memory.swap_lines(config, plan, "bf16", torch.device("cuda")) == []
