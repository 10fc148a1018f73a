"""--cuda_graph (model/step_graphs.py) where a CPU can check it: which runs may capture their step and the
one line of those that may not, the eager step unchanged where graphs are off, and the parts of the step a graph
needs: the flow loss split into the host's draws and the device's work, and a recomputed block (model/recompute.py)
that gives the gradients of torch's checkpoint with one autograd node. The capture itself needs a GPU:
bench/bench_cuda_graphs.py checks graphed losses against eager ones there."""
import pytest
import torch

import trainer.train_dpo as train_dpo
import trainer.train_lora as train_lora
from model.errors import UserError
from model.model_lora import apply_lora, lora_layers, lora_parameters
from model.model_sd3light import SD3Light
from model.recompute import compile_block
from model.rectified_flow import FlowRecipe, flow_inputs, flow_loss_of, flow_matching_loss
from tests.scripts import run_in_process
from tests.conftest import CONFIGS, inputs, random_config, randomise
from model.step_graphs import StepGraphs, graphs_choice, graphs_refusal, shape_key

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def refusal(**changes):
    values = dict(device=CUDA, world_size=1, blocks_swapped=False, step_in_backward=False, routing=False,
                  dropout_recomputed=False, compiled_recomputed=False)
    return graphs_refusal(**{**values, **changes})


def test_which_steps_a_graph_may_capture_and_the_one_line_of_those_it_may_not():
    assert refusal() is None
    for change, words in [({"device": CPU}, "CUDA GPU"), ({"world_size": 2}, "several processes"),
                          ({"blocks_swapped": True}, "block swap"), ({"step_in_backward": True}, "step in backward"),
                          ({"routing": True}, "token routing"), ({"dropout_recomputed": True}, "LoRA dropout"),
                          ({"compiled_recomputed": True}, "compiled blocks recomputed")]:
        assert words in refusal(**change)
    assert graphs_choice("1", None, CUDA) == (True, None)
    with pytest.raises(UserError) as error:
        graphs_choice("1", refusal(blocks_swapped=True), CUDA)
    assert "--cuda_graph 1" in str(error.value) and "block swap" in str(error.value) and "\n" not in str(error.value)
    on, line = graphs_choice("auto", None, CUDA)  # auto: off until a GPU run has checked graphs against eager
    assert not on and "waits for a GPU run" in line
    assert graphs_choice("auto", refusal(world_size=2), CUDA) == (False, "CUDA graphs: off (several processes "
                                                                         "(their collectives are not captured here))")
    assert graphs_choice("auto", refusal(device=CPU), CPU) == (False, None)  # a CPU run: unchanged, nothing said
    assert graphs_choice("0", None, CUDA) == (False, None)


def test_graphs_off_run_the_step_as_written_and_hand_back_its_outputs():
    graphs = StepGraphs(False, CPU, print)
    batch = [{"latents": torch.ones(1, 4, 2, 2), "mask": None}]
    assert not graphs.captured(batch)
    with graphs.recording(batch) as step_inputs:
        assert step_inputs is batch  # no copy
        loss = step_inputs[0]["latents"].sum()
        graphs.outputs(loss, loss * 2)
    assert graphs.run(batch) == (loss, loss * 2) and graphs.run(batch)[0] is loss
    # a graph is captured for a layout: names, shapes and dtypes of each micro-batch
    assert shape_key(batch) != shape_key([{"latents": torch.ones(1, 4, 2, 4), "mask": None}])
    assert shape_key(batch) == shape_key([{"latents": torch.zeros(1, 4, 2, 2), "mask": None}])


def test_the_flow_loss_is_its_host_draws_then_its_device_work():
    config = random_config(4, qk_norm="rms_norm", num_layers=2, out_channels=None)  # out as in: the flow target
    model = randomise(SD3Light(config), seed=2)

    class Components:  # cached latents and text: what a training run's batches hold
        text_encoders = [None, None]

        def condition(self, features, drop):
            return features["tokens"] * (~drop[:, :1, None]), features["pooled"]

        def latents(self, features, generator):
            return features["latents"]

    latents, tokens, pooled, _ = inputs(config, (4, 4))
    batch = {"latents": latents, "tokens": tokens, "pooled": pooled}
    recipe = FlowRecipe(prediction="v", sigma_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, train_shift=3.0,
                        loss="mse", weighting="none", caption_dropout=0.3)
    whole = flow_matching_loss(model, Components(), batch, torch.Generator().manual_seed(4), recipe)
    drawn = flow_inputs(model, Components(), batch, torch.Generator().manual_seed(4), recipe)
    assert all(v is None or v.device == latents.device for v in drawn.values() if v is not None)
    assert torch.equal(flow_loss_of(model, drawn, recipe), whole)


def test_a_block_recomputed_by_one_node_gives_torchs_checkpoint_gradients(monkeypatch):
    """model/recompute.Recomputed on plain blocks; a block with a forward of its own (not compile_block's) keeps
    torch's checkpoint. A LoRA's first block takes no input that needs a gradient: its adapters get theirs all the
    same; dropout's draws are replayed in the recompute. So they are in a compiled block's recompute where Dynamo
    runs it uncompiled (past its recompile limit): compile_block's path with torch.compile doing nothing."""
    config = CONFIGS["sd3.5-medium-like"]
    grads = {}
    for recomputed in (False, True, "torch", "uncompiled"):
        model = randomise(SD3Light(config), seed=5)
        apply_lora(model, rank=4, dropout=0.2)
        torch.manual_seed(1)
        for p in lora_parameters(model):
            p.data.normal_(std=0.1)
        model.gradient_checkpointing = recomputed is not False
        if recomputed == "torch":  # an instance forward compile_block did not set: torch's checkpoint
            for block in model.transformer_blocks:
                block.forward = block.forward
        if recomputed == "uncompiled":
            with monkeypatch.context() as patch:
                patch.setattr(torch, "compile", lambda function: function)
                for block in model.transformer_blocks:
                    compile_block(block)
        torch.manual_seed(7)
        model(*inputs(config, (3, 3))).square().mean().backward()
        grads[recomputed] = [p.grad for p in lora_parameters(model)]
    assert all(g is not None for g in grads[True])
    for mine, plain, torchs, uncompiled in zip(grads[True], grads[False], grads["torch"], grads["uncompiled"]):
        torch.testing.assert_close(mine, plain, rtol=0, atol=1e-6)
        torch.testing.assert_close(mine, torchs, rtol=0, atol=1e-6)
        torch.testing.assert_close(uncompiled, plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [train_lora, train_dpo], ids=["lora", "dpo"])
def test_cuda_graph_1_on_a_cpu_is_one_line_before_any_step(tmp_path, pretrained, monkeypatch, stage):
    with pytest.raises(UserError) as error:
        run_in_process(stage, ["--cuda_graph", "1", "--from_weight", pretrained, "--out_dir", str(tmp_path / "out"),
                               "--save_dir", str(tmp_path / "ckpt"), "--max_steps", "1"], monkeypatch)
    assert "a CUDA GPU captures graphs" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())  # no step, no save


def test_a_sample_grid_counts_the_memory_a_captured_step_keeps(monkeypatch):
    """A graph's pool keeps its step's temporaries reserved between replays: a grid drawn beside it fits the rest."""
    from model import memory

    gib = 2 ** 30
    segments = [{"device": 0, "total_size": 3 * gib, "allocated_size": 1 * gib, "segment_pool_id": (0, 0)},
                {"device": 0, "total_size": 2 * gib, "allocated_size": 0, "segment_pool_id": (1, 0)},  # a graph's
                {"device": 1, "total_size": 5 * gib, "allocated_size": 0, "segment_pool_id": (1, 0)}]  # another GPU
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * gib)
    monkeypatch.setattr(memory, "device_memory", lambda device: 10 * gib)
    assert memory.graph_pools_free(CUDA) == 2 * gib
    assert memory.sampling_room(CUDA) == memory.AUTO_SHARE * 10 * gib - 1 * gib - 2 * gib
    segments[1]["segment_pool_id"] = (0, 0)  # no graph: as before
    assert memory.sampling_room(CUDA) == memory.AUTO_SHARE * 10 * gib - 1 * gib


def test_a_recomputed_block_under_autograd_grad_gives_the_inputs_gradient_and_touches_no_parameter():
    """Distillation's GAN loss asks torch.autograd.grad for a sample's gradient through recomputed blocks: the
    answer is the unrecomputed model's, and no parameter's .grad is written (their optimizer would step on it)."""
    config = CONFIGS["sd3.5-medium-like"]
    grads = []
    for recomputed in (False, True):
        model = randomise(SD3Light(config), seed=6)
        model.gradient_checkpointing = recomputed
        x, *rest = inputs(config, (3, 3))
        x.requires_grad_(True)
        grads.append(torch.autograd.grad(model(x, *rest).square().mean(), x)[0])
        assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)


def test_graphs_prepare_the_rates_as_device_tensors_and_lora_casts_at_each_forward():
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    optimizer.param_groups[0]["capturable"] = False
    graphs = StepGraphs(True, torch.device("meta"), print)  # (meta: a device that is not the host's)
    graphs.prepare([optimizer])
    group = optimizer.param_groups[0]
    assert group["lr"].device.type == "meta" and group["lr"].dtype == torch.float32 and group["capturable"]
    group["lr"] = torch.tensor(0.2)  # a resume's rate, read into host memory: moved too
    graphs.prepare([optimizer])
    assert group["lr"].device.type == "meta"
    # a LoRA layer in a graphed step casts its adapters at each forward: a replay repeats the cast, no hook runs
    model = SD3Light(CONFIGS["plain-a"])
    apply_lora(model, rank=2)
    layer = next(iter(lora_layers(model).values()))
    layer.cast_once = False
    layer.adapters_in(torch.bfloat16)
    layer.lora_A.weight.data.add_(1.0)  # as a fused step writes it: no version change, no hook
    assert torch.equal(layer.adapters_in(torch.bfloat16)[2], layer.lora_A.weight.to(torch.bfloat16))
