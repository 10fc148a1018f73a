"""What lets the real sizes fit, on the tiny SD3 folder: frozen networks held in bf16 or int8, the stages' start in
phases (the text encoders freed once training reads the cache), weights filled into a model that was on the meta
device (no random copy), a sharded run's ranks filled from rank 0, 8-bit AdamW, and the memory estimate."""
import argparse
import gc
import os
import types
import weakref

import pytest
import torch

import trainer.train_distill as train_distill
import trainer.train_full_sft as train_full_sft
import trainer.train_lora as train_lora
import trainer.train_pretrain as train_pretrain
from dataset import training_data
from model import loading
from model.checkpoint import first_difference, load_safetensors
from model.errors import UserError
from model.model_lora import apply_lora
from model import memory
from model.model_sd3light import SD3LightConfig, meta_model, preset_config
from model.rectified_flow import Sampler
from model.precision import StagePrecision, run_precision, torch_dtype
from model.weights import load_components, load_transformer
from trainer import networks
from trainer.mechanics.distributed import DistInfo
from trainer.networks import start_weights_source

from tests.scripts import run, run_here, run_in_process
from tests.conftest import GRID, final_state

SMALL = ["--max_steps", "2", "--batch_size", "2", "--warmup_steps", "1", "--preset", "sd3-tiny", "--resolution", "32",
         "--num_samples", "4"]
FAST = [*SMALL, "--sample_steps", "1", "--sample_interval", "0", *GRID]


def dirs(tmp_path):
    return ["--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt"), "--cache_dir",
            str(tmp_path / "cache")]


def started(module, stage, roles, argv, adapt=None):
    """A stage's arguments, its precision and its start-up (the pieces the stages call, in their order), in
    this process -> (the arguments with the precision the run resolved them to, what started: its networks by
    name, each "trained", "frozen", or "adapted" (frozen, with `adapt` putting adapters on it), its components
    and the grids' prompts)."""
    args = module.parse_args(argv)
    info = DistInfo()
    precision = run_precision(args.dtype, args.frozen_dtype, StagePrecision(stage, frozen_transformer=stage != "sft"),
                              info, bool(args.base))
    resolved = argparse.Namespace(**{**vars(args), **precision.as_args()})
    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    components = load_components(source, info.device, torch_dtype(precision.frozen))
    data = training_data.stage_data(args.data_settings, components,
                                    SD3LightConfig.from_dict(source["transformer"]), info, args.batch_size, print)
    nets = {name: networks.load_network(source, "trained" if role == "trained" else "frozen", precision.frozen,
                                             info)
            for name, role in roles.items()}
    for name, role in roles.items():
        if role == "adapted":
            adapt(nets[name])
    return resolved, types.SimpleNamespace(nets=nets, components=components, prompts=data.prompts)


def adapters(model):
    apply_lora(model, "attention", 2)


def dtypes(model):
    return {p.dtype for name, p in model.named_parameters() if ".lora_" not in name}


@pytest.mark.parametrize("frozen", ["auto", "bf16", "fp32"])
def test_every_frozen_network_is_held_in_the_frozen_dtype_and_what_trains_in_fp32(tmp_path, sd3, frozen):
    common = ["--base", sd3, "--from_weight", "base", "--frozen_dtype", frozen, *SMALL, *dirs(tmp_path)]
    held = torch.float32 if frozen == "fp32" else torch.bfloat16  # auto: bf16 with --base's SD3 components
    args, lora = started(train_lora, "lora", {"model": "adapted"}, common, adapt=adapters)
    model = lora.nets["model"]
    assert dtypes(model) == {held} and model.pos_embed.pos_embed.dtype == held
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # the adapters
    assert {p.dtype for p in lora.components.vae.parameters()} == {held}
    assert args.dtype == ("fp32" if frozen == "fp32" else "bf16")  # a bf16 base computes under bf16 autocast
    args, distill = started(train_distill, "distill", {"teacher": "frozen", "generator": "trained",
                                                       "fake_score": "trained"}, common)
    assert dtypes(distill.nets["teacher"]) == {held}
    assert dtypes(distill.nets["generator"]) == dtypes(distill.nets["fake_score"]) == {torch.float32}
    args, sft = started(train_full_sft, "sft", {"model": "trained"}, common)
    assert dtypes(sft.nets["model"]) == {torch.float32} and args.dtype == "fp32"  # on a CPU, as before
    # the same weights whatever they are held in
    for name, value in sft.nets["model"].state_dict().items():
        assert torch.equal(value.to(held), model.state_dict()[name]), name


def test_the_built_in_components_on_a_cpu_stay_fp32(tmp_path, pretrained):
    weights = pretrained
    args, lora = started(train_lora, "lora", {"model": "adapted"},
                         ["--from_weight", weights, "--num_samples", "4", "--prior_data", "none", *dirs(tmp_path)],
                         adapt=adapters)
    assert args.frozen_dtype == "fp32" and args.dtype == "fp32" and dtypes(lora.nets["model"]) == {torch.float32}


def test_the_text_encoders_are_freed_once_training_reads_the_cache(tmp_path, sd3):
    seen = {}
    free = training_data.features_to_train_on

    def watch(args, dataset, components, prompts, info, log):
        seen["encoders"] = [weakref.ref(components.clip_l), weakref.ref(components.clip_g),
                            weakref.ref(components.t5)]
        return free(args, dataset, components, prompts, info, log)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training_data, "features_to_train_on", watch)
        args, start = started(train_full_sft, "sft", {"model": "trained"},
                              ["--base", sd3, "--from_weight", "base", *FAST, *dirs(tmp_path)])
    gc.collect()
    assert seen["encoders"] and all(ref() is None for ref in seen["encoders"])
    assert start.components.vae is not None  # the grids still decode
    tokens, _ = start.components.encode_prompts(start.prompts)  # the grids' prompts were encoded before
    assert tokens.shape[0] == len(start.prompts)
    with pytest.raises(UserError, match="text encoders were freed"):
        start.components.encode_prompts(["a prompt nobody encoded"])


def test_a_load_fills_a_model_built_on_the_meta_device_without_a_random_copy(tmp_path, sd3, monkeypatch):
    replaced = []
    put = loading.put

    def watch(model, name, tensor):
        replaced.append((name, model.get_submodule(name.rpartition(".")[0])._parameters.get(
            name.rpartition(".")[2], model.get_submodule(name.rpartition(".")[0])._buffers.get(
                name.rpartition(".")[2])).is_meta))
        put(model, name, tensor)

    monkeypatch.setattr(loading, "put", watch)
    record = start_weights_source("base", "sd3-tiny", None, str(tmp_path), sd3)
    model = load_transformer(record, torch.bfloat16)
    names = list(model.state_dict())
    assert [name for name, _ in replaced] == names and all(was_meta for _, was_meta in replaced)
    assert not any(t.is_meta for t in model.state_dict().values())
    stored = {}
    for path in record["weight_files"]:
        stored.update(load_safetensors(path))
    assert all(torch.equal(model.state_dict()[k], v.to(torch.bfloat16)) for k, v in stored.items())


def test_fsdp_fills_every_rank_from_rank_0_as_every_rank_loading_would(tmp_path, sd3):
    torch.multiprocessing.spawn(fill_from_rank_0, args=(str(tmp_path), sd3), nprocs=2, join=True)


def fill_from_rank_0(rank, folder, sd3):
    """Rank 1 builds its model on the meta device and reads nothing; once sharded, rank 0's weights fill it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.mechanics.distributed import data_parallel, gathered

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)
    try:
        info = DistInfo(rank, rank, 2, torch.device("cpu"), init_device_mesh("cpu", (2,)))
        record = start_weights_source("base", "sd3-tiny", None, folder, sd3)
        model = load_transformer(record, torch.float32, meta=rank == 1)
        assert all(t.is_meta for t in model.state_dict().values()) == (rank == 1)
        whole = gathered(data_parallel(model, info).state_dict(), info)
        if rank == 0:
            assert first_difference(load_transformer(record).state_dict(), whole) is None
        dist.barrier()
    finally:
        dist.destroy_process_group()


def pretrain_argv(run_dir, optimizer, *extra):
    return ["--optimizer", optimizer, "--num_samples", "32", "--batch_size", "4", "--max_steps", "6",
            "--save_interval", "3", "--sample_interval", "0", "--sample_steps", "1", "--warmup_steps", "2",
            "--out_dir", str(run_dir / "out"), "--save_dir", str(run_dir / "ckpt"), *extra]


def pretrain_export(run_dir):
    from model import checkpoint
    from model.checkpoint import read_manifest

    stem = str(run_dir / "out" / "pretrain_tiny")
    return load_safetensors(checkpoint.checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))


def test_adamw8bit_stops_and_resumes_bitwise_and_trains_like_adamw(tmp_path, monkeypatch):
    from tests.conftest import run_stage

    run_stage(train_pretrain, pretrain_argv(tmp_path / "whole", "adamw8bit"), monkeypatch)
    # SIGTERM while step 5 fetches its first sample (4 a step): the step completes and is saved
    run_stage(train_pretrain, pretrain_argv(tmp_path / "cut", "adamw8bit"), monkeypatch, signal_at=4 * 4 + 1)
    run_stage(train_pretrain, pretrain_argv(tmp_path / "cut", "adamw8bit", "--from_resume", "1"), monkeypatch)
    whole = final_state(tmp_path / "whole", "pretrain_tiny", pretrain_export)
    cut = final_state(tmp_path / "cut", "pretrain_tiny", pretrain_export)
    for key in ("model", "ema", "optimizer", "rng", "export", "step", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"] and whole["step"] == 6
    state = whole["optimizer"]["state"]["transformer_blocks.0.attn.to_q.weight"]["exp_avg"]
    assert type(state).__name__ == "OptimState8bit"  # 8-bit moments, in the resume file as such
    run_stage(train_pretrain, pretrain_argv(tmp_path / "adamw", "adamw"), monkeypatch)
    adamw = final_state(tmp_path / "adamw", "pretrain_tiny", pretrain_export)
    # the same losses within 2% a step (measured: under 0.5%), and weights as near as 8-bit moments allow
    for ours, theirs in zip(whole["logged"], adamw["logged"]):
        assert abs(ours["loss"] - theirs["loss"]) <= 0.02 * theirs["loss"], (ours, theirs)
    moved = sum((adamw["model"][k] - whole["model"][k]).norm() ** 2 for k in adamw["model"]) ** 0.5
    assert moved < 0.05 * sum(v.norm() ** 2 for v in adamw["model"].values()) ** 0.5


def test_an_int8_lora_trains_and_its_file_loads_in_diffusers(tmp_path, sd3, capsys):
    from diffusers import StableDiffusion3Pipeline

    from eval.sampling import load_for_sampling, sample_images
    from tests.conftest import diffusers_image

    result = run_here(train_lora, ["--base", sd3, "--from_weight", "base", "--frozen_dtype", "int8", "--prior_data",
                                   "none", "--learning_rate", "0.05", *FAST, *dirs(tmp_path)], capsys)
    assert "frozen networks held in int8" in result.stdout and "frozen in int8" in result.stdout
    lora_path = tmp_path / "out" / "lora" / "lora_demo_sd3-tiny.safetensors"
    model, components, _, _ = load_for_sampling(None, str(tmp_path / "out"), "cpu", lora=str(lora_path))
    prompt = "a large red circle in the center"
    ours = sample_images(model, components, [prompt], 3, Sampler(32, 2, 2.0, 3.0, "v"), torch.device("cpu"))[0]
    pipeline = StableDiffusion3Pipeline.from_pretrained(sd3)
    without = diffusers_image(pipeline, prompt, seed=3, steps=2, cfg=2.0)
    pipeline.load_lora_weights(str(lora_path))
    with_lora = diffusers_image(pipeline, prompt, seed=3, steps=2, cfg=2.0)
    assert (ours - with_lora).abs().max() < 1e-4  # diffusers applies the adapters as we do
    assert (with_lora - without).abs().max() > 1e-3  # and the adapters trained on the int8 base do something


def test_bad_precision_arguments_are_one_line_errors(tmp_path, sd3, monkeypatch):
    with pytest.raises(UserError, match=r"--frozen_dtype int8 quantises a frozen transformer, and the pretrain stage"):
        run_in_process(train_pretrain, ["--frozen_dtype", "int8", *dirs(tmp_path)], monkeypatch)
    with pytest.raises(UserError, match=r"--dtype fp32 with --frozen_dtype bf16: .* drop --dtype fp32"):
        run_in_process(train_lora, ["--base", sd3, "--from_weight", "base", "--dtype", "fp32", "--frozen_dtype",
                                    "bf16", *FAST, *dirs(tmp_path)], monkeypatch)
    import importlib

    real_import = importlib.import_module

    def without_torchao(name, *args):
        if name.startswith("torchao"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_torchao)
    with pytest.raises(UserError, match=r"--optimizer adamw8bit needs torchao: pip install"):
        run_in_process(train_pretrain, ["--optimizer", "adamw8bit", "--num_samples", "8", "--max_steps", "1",
                                        *dirs(tmp_path)], monkeypatch)


def test_an_estimate_over_the_device_memory_warns_in_one_line_and_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "device_memory", lambda device: 2 ** 20)
    step, messages = run_in_process(train_pretrain, ["--num_samples", "8", "--batch_size", "4", "--max_steps", "1",
                                                     "--sample_steps", "1", *dirs(tmp_path)], monkeypatch)
    estimate = [m for m in messages if m.startswith("memory estimate per process:")]
    warning = [m for m in messages if m.startswith("warning: the estimate")]
    assert len(estimate) == 1 and len(warning) == 1 and "\n" not in warning[0]
    assert "--gradient_checkpointing 1" in warning[0] and "--frozen_dtype int8" in warning[0] and step == 1
    assert any(m.startswith("peak memory after the weights loaded:") for m in messages)


def test_the_estimate_counts_what_each_network_holds():
    from model.memory import MemoryPlan, estimate

    config = preset_config("base")
    params = sum(p.numel() for p in meta_model(config).parameters())
    full = estimate(config, MemoryPlan(("trained",), "adamw", True, "auto", 1, 32, False), "bf16", 1, 0, 0, "cuda")
    assert full["weights"] == full["gradients"] == full["EMA"] == 4 * params and full["optimizer"] == 8 * params
    lean = estimate(config, MemoryPlan(("trained",), "adamw8bit", True, "cpu", 1, 32, False), "bf16", 1, 0, 0, "cuda")
    assert lean["optimizer"] < 2.1 * params and lean["EMA"] == 0  # --ema_device cpu
    lora = estimate(config, MemoryPlan((1000,), "adamw", False, "auto", 1, 32, False), "int8", 1, 0, 0, "cuda")
    assert lora["weights"] == pytest.approx(1.02 * params + 4000) and lora["optimizer"] == 8000
    sharded = estimate(config, MemoryPlan(("trained",), "adamw", False, "auto", 1, 32, False), "bf16", 4, 0, 0, "cuda")
    assert sharded["weights"] == params and sharded["gathered block"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--frozen_dtype", "int8"], ["--frozen_dtype", "bf16", "--fsdp", "1"]])
def test_a_lora_on_a_bf16_or_int8_base_trains_on_two_processes(tmp_path, sd3, mode):
    """DDP leaves the frozen base alone (int8 weights cannot be broadcast); FSDP shards a bf16 base beside fp32
    adapters. Both train the adapters and write a file whose adapters moved. Each launches the script itself under
    torchrun, as a user does (the other LoRA runs of two processes go through tests/stage_runs.py)."""
    from model.model_lora import read_lora_file

    result = run(["trainer/train_lora.py", "--base", sd3, "--from_weight", "base", "--prior_data", "none",
                  "--learning_rate", "0.05", *FAST, *mode, *dirs(tmp_path)], torchrun=2)
    assert f"frozen networks held in {mode[1]}" in result.stdout
    assert ("FSDP over mesh" if "--fsdp" in mode else "(DDP)") in result.stdout
    state = read_lora_file(str(tmp_path / "out" / "lora" / "lora_demo_sd3-tiny.safetensors"))[0]
    assert state and any(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k)


def test_a_resume_file_from_before_frozen_dtype_resumes_where_its_frozen_weights_were_fp32():
    from trainer.mechanics.checkpointer import RunSpec, check_resume

    args = train_lora.parse_args([])
    saved = {k: v for k, v in vars(args).items() if k != "frozen_dtype"}
    state = {"kind": "resume", "stage": "lora", "args": saved, "dataset_size": 10}
    args.frozen_dtype = "fp32"  # what --frozen_dtype auto resolves to for the built-in components on a CPU
    assert check_resume(state, RunSpec("lora", {"kind": "full"}, vars(args), args.resume_kinds, {}), 10) == []
    args.frozen_dtype = "bf16"
    with pytest.raises(UserError, match=r"--frozen_dtype fp32 \(saved\) vs bf16 \(now\)"):
        check_resume(state, RunSpec("lora", {"kind": "full"}, vars(args), args.resume_kinds, {}), 10)
