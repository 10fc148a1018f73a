"""Sharded training (--fsdp 1): FSDP2 trains like DDP, its DCP resume checkpoints resume bitwise on the same
processes and on any other number of processes or mode, a kill in the middle of a save loses nothing, the
exported weights are the gathered ones and load in diffusers, and bad settings are one line."""
import functools
import io
import json
import math
import os
import pickle
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import trainer.train_pretrain as train_pretrain
from model.checkpoint import (
    CheckpointError, checkpoint_file, first_difference, load_safetensors, load_torch, read_manifest,
)
from eval.sampling import load_for_sampling
from model.errors import UserError, run_main
from model.model_sd3light import SD3Light, preset_config
from trainer.mechanics.sharded_checkpoint import (
    MetadataUnpickler, SafeReader, join_tensors, read_shards, split_tensors, write_shards,
)
from trainer.mechanics.distributed import DistInfo
from trainer.mechanics.run_lock import hold_run_folders
from trainer.mechanics.state import leaves, map_leaves

from tests.scripts import run, run_in_process, run_many
from tests.conftest import alive, children, launch, uncommitted, wait_for_step
from tests.conftest import GRID, PRETRAIN_SMALL, lora_export, sft_export

SCRIPT = "trainer/train_pretrain.py"
# a constant learning rate: a run stopped at step 3 and resumed to step 6 is the 6-step run
RECIPE = [SCRIPT, "--num_samples", "32", "--batch_size", "2", "--warmup_steps", "0", "--min_lr_ratio", "1",
          "--ema_decay", "0.9", "--prediction", "v", "--sample_interval", "0", "--sample_steps", "1", *GRID,
          "--save_dtype", "fp32", "--save_interval", "100", "--log_sample_ids", "1"]
MODES = {"fsdp2": (2, ["--fsdp", "1", "--gradient_checkpointing", "1"]), "fsdp1": (0, ["--fsdp", "1"]),
         "ddp2": (2, []), "single": (0, []), "hsdp2": (2, ["--fsdp", "1", "--fsdp_shard_size", "1"]),
         "fsdp2_8bit": (2, ["--fsdp", "1", "--optimizer", "adamw8bit"]), "ddp2_8bit": (2, ["--optimizer", "adamw8bit"]),
         "single_8bit": (0, ["--optimizer", "adamw8bit"]),
         "fsdp2_compiled": (2, ["--compile", "1", "--fsdp", "1", "--gradient_checkpointing", "1"])}
# The legs the tests read, (mode, steps) or (mode, steps, (mode, steps) of the leg it resumes a copy of), run once
# for the whole test run in two batches: fp32 AdamW, and 8-bit AdamW (with an fp32 FSDP leg of its own to compare
# shard sizes with, so that neither batch waits for the other). The fp32 batch (and the tests that resume its legs)
# trains the 2-block sd3-tiny preset on the built-in components, 0.3M parameters: what it checks, sharding against
# DDP and resuming, holds at any size, and its saves and grids cost a twentieth of the tiny preset's 7.8M. The
# 8-bit batch keeps the tiny preset: its tensors stay large enough in a shard (4096 values) for 8-bit state.
BATCHES = {
    "fp32": [("fsdp2", 3), ("ddp2", 3), ("fsdp2", 6), ("hsdp2", 3), ("fsdp2_compiled", 2), ("fsdp1", 3), ("single", 3),
             ("fsdp2", 6, ("fsdp2", 3)), ("fsdp1", 6, ("fsdp2", 3)), ("single", 6, ("fsdp2", 3)),
             ("single", 6, ("ddp2", 3)), ("fsdp2", 6, ("fsdp1", 3)), ("ddp2", 6, ("single", 3)),
             ("fsdp2", 6, ("ddp2", 3))],
    "8bit": [("fsdp2_8bit", 3), ("fsdp2_8bit", 6), ("ddp2_8bit", 3), ("fsdp2", 3), ("single_8bit", 3),
             ("fsdp2_8bit", 6, ("fsdp2_8bit", 3)), ("fsdp2_8bit", 6, ("single_8bit", 3)),
             ("ddp2_8bit", 6, ("single_8bit", 3)), ("single_8bit", 6, ("fsdp2_8bit", 3)),
             ("single_8bit", 6, ("ddp2_8bit", 3))],
}
MODEL = {"fp32": ["--preset", "sd3-tiny"], "8bit": []}


# Under pytest-xdist the tests that read the same batch run on one worker (they would wait there for the batch
# anyway): those of fp32 AdamW on one, those of 8-bit AdamW on another
ON_LEGS, ON_8BIT_LEGS = pytest.mark.xdist_group("fsdp_legs"), pytest.mark.xdist_group("fsdp_8bit_legs")


def folders(path):
    return ["--out_dir", str(path / "out"), "--save_dir", str(path / "ckpt")]


@pytest.fixture(scope="session")
def legs(shared):
    """legs(mode, steps, after=None, batch=None) -> the folder of a run of RECIPE in `mode` to `steps` steps; with
    `after` (mode, steps), of a copy of that leg's folder resumed. The leg's batch (by default the 8-bit one for an
    8-bit mode) runs once for the whole test run."""
    def leg(mode, steps, after=None, batch=None):
        batch = batch or ("8bit" if "8bit" in mode else "fp32")
        folder = shared(f"legs-{batch}", functools.partial(run_batch, batch)) / leg_name(mode, steps, after)
        assert folder.is_dir(), f"no leg {folder.name} in batch {batch} (tests/test_fsdp.py's BATCHES)"
        return folder

    return leg


def leg_name(mode, steps, after=None):
    return f"{after[0]}_{after[1]}-{mode}_{steps}" if after else f"{mode}_{steps}"


def run_batch(batch, root):
    """Run the legs of BATCHES[`batch`] (on MODEL[`batch`]) into folders of `root`. Those of one process run in
    this one (run_main tears its process group down, as at a script's end): from scratch first, resumed last. Those
    of two processes run between, in torchrun launches: from scratch, then each resumed one after a copy of the
    folder it resumes (tests/stage_runs.py's --copy). The fp32 batch resumes in the same launch (the SIGKILL test
    resumes its shards in new processes); the 8-bit batch in a launch of its own, in new processes as a user's
    resume is: no other test resumes 8-bit shards. In the fp32 batch torch.compile (the compiled leg's blocks) runs
    as captured (conftest.compiled_as_captured: Dynamo's graphs, eager kernels), where inductor would compile the
    blocks afresh in both ranks (inductor's own code: test_train's compiled pretraining); in the 8-bit batch the
    update stays compiled (eager, its arithmetic costs more than compiling it)."""
    here, scratch, resumed, last = [], [], [], []
    for mode, steps, *after in BATCHES[batch]:
        folder = root / leg_name(mode, steps, *after)
        args = RECIPE[1:] + MODEL[batch] + ["--max_steps", str(steps)] + MODES[mode][1] + folders(folder)
        copy = [["--copy", str(root / leg_name(*after[0])), str(folder)]] if after else []
        runs = (resumed if after else scratch) if MODES[mode][0] else last if after else here
        runs += copy + [args + (["--from_resume", "1"] if after else [])]
    run_here_in_turn(here)
    for launched in ([scratch, resumed] if batch == "8bit" else [scratch + resumed]):
        run_many("trainer.train_pretrain", launched, torchrun=2, captured=batch == "fp32")
    run_here_in_turn(last)


def run_here_in_turn(runs):
    """Run train_pretrain once per argument list of `runs`, in this process; `--copy SOURCE TARGET` copies a
    folder."""
    for argv in runs:
        if argv[0] == "--copy":
            shutil.copytree(*argv[1:])
        else:
            run_main(functools.partial(train_pretrain.main, argv))


def run_in(folder):
    """The name of the run whose files a run folder holds (pretrain_sd3-tiny, pretrain_tiny): its metrics file's."""
    (path,) = (folder / "out").glob("*_metrics.jsonl")
    return path.name.removesuffix("_metrics.jsonl")


def whole_resume_state(folder, name=None):
    """The resume checkpoint of a run folder (of run `name`, by default the one it holds) with every tensor whole,
    whatever wrote it: the .pt, and for a sharded run its DCP shards read back by this one process."""
    stem = str(folder / "ckpt" / f"{name or run_in(folder)}_resume")
    state = load_torch(checkpoint_file(stem, read_manifest(stem, "resume"), ".pt"))
    if state["shards"]:
        shards = os.path.join(os.path.dirname(stem), state["shards"])
        stored = SafeReader(shards).read_metadata().state_dict_metadata
        tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in stored.items()}
        dcp.load(tensors, storage_reader=SafeReader(shards), no_dist=True)
        state = join_tensors(state, tensors)
    return state


def exported(folder):
    stem = str(folder / "out" / run_in(folder))
    return load_safetensors(checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))


def metrics(folder):
    with open(folder / "out" / f"{run_in(folder)}_metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def assert_close_states(a, b, atol=1e-5):
    """Same trained state (model, AdamW, EMA: the same tensors) within atol, and the same data order."""
    for name in ("model", "optimizer", "ema"):
        left, right = leaves(a[name]), leaves(b[name])
        assert left.keys() == right.keys(), name
        worst = max((left[k].double() - right[k].double()).abs().max().item() for k in left)
        assert worst <= atol, f"{name} differs by {worst}"
    assert a["step"] == b["step"] and a["samples_seen"] == b["samples_seen"]


def assert_resumed_bitwise(whole, resumed):
    """The run folder `resumed` (stopped and resumed) holds bitwise what the uninterrupted `whole` does: the
    trained state, the random streams, the data position, the export and the metric rows."""
    a, b = whole_resume_state(whole), whole_resume_state(resumed)
    for key in ("model", "optimizer", "ema", "rng", "step", "samples_seen", "epoch", "consumed"):
        assert first_difference(a[key], b[key], key) is None, key
    assert first_difference(exported(whole), exported(resumed)) is None
    keep = ("step", "loss", "lr", "grad_norm", "sample_ids")
    assert [{k: r[k] for k in keep} for r in metrics(whole)] == [{k: r[k] for k in keep} for r in metrics(resumed)]


def sample_ids(folder):
    return [row["sample_ids"] for row in metrics(folder)]


# ------------------------------------------------------------------------------------------------------------
# Training and resuming


@ON_LEGS
@pytest.mark.slow
def test_fsdp_trains_like_ddp_and_exports_the_gathered_weights(legs):
    fsdp, ddp = legs("fsdp2", 3), legs("ddp2", 3)
    assert_close_states(whole_resume_state(fsdp), whole_resume_state(ddp))
    assert sample_ids(fsdp) == sample_ids(ddp)
    for mine, theirs in zip(metrics(fsdp), metrics(ddp)):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    # the export is the EMA (the tracked average), gathered whole from the shards, in the declared dtype
    state, weights = whole_resume_state(fsdp), exported(fsdp)
    assert weights.keys() == state["ema"].keys()
    for key, value in weights.items():
        assert value.dtype == torch.float32 and torch.equal(value, state["ema"][key]), key
    # and the diffusers transformer folder written beside it (v-prediction) loads in diffusers as those weights
    from diffusers import SD3Transformer2DModel

    theirs = SD3Transformer2DModel.from_pretrained(str(fsdp / "out" / PRETRAIN_SMALL / "transformer"))
    for key, value in theirs.state_dict().items():
        assert torch.equal(value.float(), weights[key].float()), key


@ON_LEGS
@pytest.mark.slow
def test_an_fsdp_run_stopped_and_resumed_equals_the_uninterrupted_run_bitwise(legs):
    whole, resumed = legs("fsdp2", 6), legs("fsdp2", 6, after=("fsdp2", 3))
    assert_resumed_bitwise(whole, resumed)


@ON_LEGS
@pytest.mark.slow
@pytest.mark.parametrize("first,then,ref_first,ref_then", [
    ("fsdp2", "fsdp1", "ddp2", "single"),  # FSDP 2 -> 1 as DDP 2 -> 1
    ("fsdp2", "single", "ddp2", "single"),  # FSDP 2 -> one process without FSDP
    ("fsdp1", "fsdp2", "single", "ddp2"),  # FSDP 1 -> 2 as one process -> DDP 2
    ("ddp2", "fsdp2", "fsdp2", "fsdp2"),  # DDP -> FSDP on the same processes
])
def test_resume_on_another_number_of_processes_or_mode_continues_like_ddp(legs, first, then, ref_first, ref_then):
    mine, theirs = legs(then, 6, after=(first, 3)), legs(ref_then, 6, after=(ref_first, 3))
    assert_close_states(whole_resume_state(mine), whole_resume_state(theirs))
    assert sample_ids(mine) == sample_ids(theirs)  # the same data order, through the change
    ids = [i for row in sample_ids(mine) for i in row]
    assert len(ids) == len(set(ids)) == whole_resume_state(mine)["samples_seen"]  # nothing twice, none dropped


def shard_bytes(folder):
    return sum(path.stat().st_size for path in (folder / "ckpt").glob("*.dcp/*.distcp"))


def dequantized(state):
    """A state with torchao's 8-bit optimizer states as the fp32 values they stand for."""
    return map_leaves(state, lambda path, t: t.dequantize() if hasattr(t, "dequantize") else t)


@ON_8BIT_LEGS
@pytest.mark.slow
def test_8bit_adamw_under_fsdp_saves_verified_resumes_bitwise_and_finishes(legs):
    import torchao.optim  # noqa: F401  (its 8-bit state is what the shards hold: torch.load allows it once imported)

    whole, resumed = legs("fsdp2_8bit", 6), legs("fsdp2_8bit", 6, after=("fsdp2_8bit", 3))
    assert_resumed_bitwise(whole, resumed)
    # the moments are stored 8-bit: the shards are smaller than fp32 AdamW's (16 -> 10 bytes a parameter)
    assert shard_bytes(legs("fsdp2_8bit", 3)) < 0.7 * shard_bytes(legs("fsdp2", 3, batch="8bit"))


@ON_8BIT_LEGS
@pytest.mark.slow
@pytest.mark.parametrize("first,then,ref_first,ref_then", [
    ("single_8bit", "fsdp2_8bit", "single_8bit", "ddp2_8bit"),  # whole 8-bit states cut into shards
    ("fsdp2_8bit", "single_8bit", "ddp2_8bit", "single_8bit"),  # 8-bit shards read into whole states
])
def test_8bit_adamw_resumes_across_sharding_like_ddp(legs, first, then, ref_first, ref_then):
    import torchao.optim  # noqa: F401

    mine, theirs = legs(then, 6, after=(first, 3)), legs(ref_then, 6, after=(ref_first, 3))
    # requantised where a process holds another part of a tensor (measured: 1.6e-5 apart after 3 steps)
    assert_close_states(dequantized(whole_resume_state(mine)), dequantized(whole_resume_state(theirs)), atol=1e-4)
    assert sample_ids(mine) == sample_ids(theirs)
    ids = [i for row in sample_ids(mine) for i in row]
    assert len(ids) == len(set(ids)) == whole_resume_state(mine)["samples_seen"]


@ON_LEGS
@pytest.mark.slow
def test_hybrid_sharding_trains_like_ddp(legs):
    assert_close_states(whole_resume_state(legs("hsdp2", 3)), whole_resume_state(legs("ddp2", 3)))


def kill_torchrun(proc):
    """SIGKILL to the workers and to torchrun: each worker has a process group of its own, and one whose torchrun
    died trains on (its peers are reached directly), so a kill of torchrun alone would leave the run writing."""
    workers = children(proc.pid)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while any(alive(pid) for pid in workers):
        assert time.time() < deadline, "a killed worker lives on"
        time.sleep(0.01)


@ON_LEGS
@pytest.mark.slow
def test_sigkill_during_an_fsdp_save_leaves_the_last_commit_whole(tmp_path, legs):
    """Saves on every step. Killed (both processes and torchrun) as soon as a save's shard folder appears, i.e.
    while the ranks write their shards, the run leaves the last commit whole and loadable; the resumed run ends as
    the uninterrupted one, with the half-written folder gone."""
    args = RECIPE + MODEL["fp32"] + ["--max_steps", "6", "--save_interval", "1"] + MODES["fsdp2"][1] + \
        folders(tmp_path)
    ckpt, metrics_path = str(tmp_path / "ckpt"), str(tmp_path / "out" / f"{PRETRAIN_SMALL}_metrics.jsonl")
    proc = launch(args, torchrun=2, log_path=tmp_path / "killed.log")
    wait_for_step(proc, metrics_path, 2)  # step 1's save has committed: step 2's is about to start
    deadline = time.time() + 60
    while not uncommitted(ckpt, f"{PRETRAIN_SMALL}_resume") and proc.poll() is None:
        assert time.time() < deadline, "no save started"
        time.sleep(0.005)
    kill_torchrun(proc)
    assert any(name.endswith(".dcp") for name in uncommitted(ckpt, f"{PRETRAIN_SMALL}_resume")), "killed after the save"
    state = whole_resume_state(tmp_path)  # the last commit: its files match the manifest and load
    assert state["step"] >= 1 and leaves(state["model"]) and leaves(state["optimizer"])
    run(args + ["--from_resume", "1"], torchrun=2)
    assert not uncommitted(str(tmp_path / "ckpt"), f"{PRETRAIN_SMALL}_resume")
    whole, resumed = whole_resume_state(legs("fsdp2", 6)), whole_resume_state(tmp_path)
    for key in ("model", "optimizer", "ema", "rng"):
        assert first_difference(whole[key], resumed[key], key) is None, key


@pytest.mark.slow
def test_a_second_run_into_a_running_runs_folders_is_refused_and_a_killed_run_leaves_them_free(tmp_path,
                                                                                               monkeypatch):
    """Rank 0 of a run under torchrun holds its folders: a run started into either of them is refused in one line
    naming it, before it writes anything; once the first is SIGKILLed the folders take a new run."""
    args = RECIPE + ["--max_steps", "100000"] + folders(tmp_path)
    metrics_path = tmp_path / "out" / "pretrain_tiny_metrics.jsonl"
    proc = launch(args, torchrun=2, log_path=tmp_path / "first.log")
    try:
        wait_for_step(proc, str(metrics_path), 1)
        lock = tmp_path / "out" / "pretrain_tiny.lock"
        rank0 = [pid for pid in children(proc.pid) if f"pid {pid} " in lock.read_text()]
        assert len(rank0) == 1
        rows = metrics_path.read_text()
        for other in (["--out_dir", str(tmp_path / "other")], ["--save_dir", str(tmp_path / "other")]):
            refused = rf"another run \(pid {rank0[0]} on .*\) is writing pretrain_tiny into "
            with pytest.raises(UserError, match=refused):
                run_in_process(train_pretrain, args[1:] + other, monkeypatch)
        assert not (tmp_path / "other" / "pretrain_tiny_metrics.jsonl").exists()
        other_name = hold_run_folders([str(tmp_path / "out")], "lora_demo_tiny", DistInfo())  # runs of other names
        assert len(other_name.files) == 1  # share the folders
    finally:
        kill_torchrun(proc)
    assert metrics_path.read_text().startswith(rows)  # nothing of the refused runs in the first one's metrics
    # the kernel frees the lock once the killed process is gone (all its threads: the leader may be a zombie first)
    deadline = time.time() + 30
    while not lock_is_free(lock):
        assert time.time() < deadline, "a SIGKILLed run still holds its folder"
        time.sleep(0.05)
    run_in_process(train_pretrain, args[1:-len(folders(tmp_path))] + ["--max_steps", "1"] + folders(tmp_path),
                   monkeypatch)
    assert metrics(tmp_path)[-1]["step"] == 1 and not lock.exists()  # the run let go of it as it ended


def lock_is_free(path):
    import fcntl

    with open(path, "a") as f:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
    return True


@ON_LEGS
@pytest.mark.slow
def test_compiled_blocks_train_under_fsdp(legs):
    compiled, eager = metrics(legs("fsdp2_compiled", 2)), metrics(legs("ddp2", 3))
    assert compiled[0]["loss"] == pytest.approx(eager[0]["loss"], abs=1e-5)  # the same weights, the same loss
    # and the same step: the blocks' gradients, each block recomputed inside its compiled forward (Dynamo's
    # capture; this backend runs the captured checkpoint as torch's), within FSDP's gathers
    assert compiled[1]["loss"] == pytest.approx(eager[1]["loss"], abs=1e-5)
    assert [r["sample_ids"] for r in compiled] == [r["sample_ids"] for r in eager[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "lora"])
def test_fine_tune_stages_shard_like_ddp_and_lora_files_load_in_diffusers(tmp_path_factory, pretrained_small, stage):
    base = Path(pretrained_small).parent  # with a diffusers transformer folder beside the weights
    script, name, export, data = {
        "sft": ("trainer/train_full_sft.py", "sft_sd3-tiny", sft_export, []),
        "lora": ("trainer/train_lora.py", "lora_demo_sd3-tiny", lora_export, ["--prior_samples", "12"])}[stage]
    export = functools.partial(export, name=name)
    args = [script, "--from_weight", pretrained_small, "--preset", "sd3-tiny", "--num_samples", "12", *data,
            "--batch_size", "2", "--max_steps", "3", "--ema_decay", "0", "--sample_interval", "0", "--sample_steps",
            "1", *GRID, "--save_dtype", "fp32"]
    runs = {mode: tmp_path_factory.mktemp(mode) for mode in ("fsdp2", "ddp2")}
    launched = [args[1:] + MODES[mode][1] + folders(runs[mode]) for mode in runs]
    if stage == "lora":  # in the same launch: LoKr and DoRA, each with LoRA on the text encoder too
        for kind in ("lokr", "dora"):
            launched += kind_runs(args[1:] + ["--adapter", kind], kind, runs, tmp_path_factory, name)
    run_many(f"trainer.{Path(script).stem}", launched)
    sharded, reference = export(runs["fsdp2"]), export(runs["ddp2"])
    assert sharded.keys() == reference.keys()
    for key, value in sharded.items():
        assert value.dtype == torch.float32 and (value - reference[key]).abs().max() <= 1e-5, key
    state = whole_resume_state(runs["fsdp2"], name)
    if stage == "sft":  # no EMA: the export is the trained weights, gathered whole from the shards
        assert all(torch.equal(value, state["model"][key]) for key, value in sharded.items())
        return
    # only the adapters were trained: they alone are in the shards, with their AdamW state
    assert state["model"].keys() == sharded.keys() and all(".lora_" in k for k in sharded)
    assert set(state["optimizer"]["state"]) == {k.removeprefix("transformer.") for k in sharded}
    for kind, key in (("lokr", ".lokr_w1"), ("dora", ".dora_scale")):
        check_kind_runs(runs, kind, key, name)
    # the file loads in diffusers onto the base transformer and draws what our sampler draws with it
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    lora_path = runs["fsdp2"] / "out" / "lora" / f"{name}.safetensors"
    ours = load_for_sampling(pretrained_small, str(base), "cpu", lora=str(lora_path))[0].eval()
    theirs = SD3Transformer2DModel.from_pretrained(str(base / "pretrain_sd3-tiny" / "transformer")).eval()
    lora, metadata = StableDiffusion3Pipeline.lora_state_dict(str(lora_path.parent), weight_name=lora_path.name,
                                                              return_lora_metadata=True)
    theirs.load_lora_adapter(lora, prefix="transformer", metadata=metadata)
    config, generator = ours.config, torch.Generator().manual_seed(0)
    x = (torch.randn(2, config.in_channels, 8, 8, generator=generator),
         torch.randn(2, 5, config.joint_attention_dim, generator=generator),
         torch.randn(2, config.pooled_projection_dim, generator=generator), torch.tensor([300.0, 800.0]))
    with torch.no_grad():
        torch.testing.assert_close(theirs(*x).sample, ours(*x), rtol=0, atol=1e-5)


def kind_runs(args, kind, runs, tmp_path_factory, name):
    """The runs of an adapter kind (`args`: the LoRA stage's, with --adapter), with LoRA on the text encoder too and
    an EMA: sharded and under DDP; and sharded to step 6, in one go and resumed from the 3rd (the 6 steps are within
    the recipe's warmup of 10: their rates do not depend on --max_steps) -> their argument lists, their folders
    added to `runs`."""
    own = args + ["--train_text_encoders", "text", "--ema_decay", "0.9"]
    for label in (f"{kind}_fsdp2", f"{kind}_ddp2", f"{kind}_6", f"{kind}_resumed"):
        runs[label] = tmp_path_factory.mktemp(label)
    resume = str(runs[f"{kind}_fsdp2"] / "ckpt" / f"{name}_resume.json")
    return [own + MODES[mode][1] + folders(runs[f"{kind}_{mode}"]) for mode in ("fsdp2", "ddp2")] + [
        own + MODES["fsdp2"][1] + ["--max_steps", "6"] + folders(runs[f"{kind}_6"]),
        own + MODES["fsdp2"][1] + ["--max_steps", "6", "--from_resume", resume] + folders(runs[f"{kind}_resumed"])]


def check_kind_runs(runs, kind, key, name):
    """kind_runs' runs: sharded, the adapters (with `key`) and the text encoder's train as under DDP, gradient norms
    included; stopped at step 3 and resumed (the encoder's adapters whole beside the shards), the run ends bitwise as
    the one in one go."""
    sharded, ddp = lora_export(runs[f"{kind}_fsdp2"], name), lora_export(runs[f"{kind}_ddp2"], name)
    assert sharded.keys() == ddp.keys() and any(k.endswith(key) for k in sharded)
    worst = max(((value - ddp[k]).abs().max().item(), k) for k, value in sharded.items())
    assert worst[0] <= 1e-5, (kind, worst)
    norms = [[row["grad_norm"] for row in metrics(runs[f"{kind}_{mode}"]) if "grad_norm" in row]
             for mode in ("fsdp2", "ddp2")]
    assert len(norms[0]) == 3 and norms[0] == pytest.approx(norms[1], abs=1e-5), kind  # both kinds' joint norm
    text = {k: v for k, v in sharded.items() if not k.startswith("transformer.")}
    assert text and all(k.startswith("text_encoder.") for k in text)
    assert sum(1 for k, v in text.items() if "lora_B" in k and v.abs().sum() > 0) == 12  # all trained
    whole, resumed = (whole_resume_state(runs[f"{kind}_{end}"], name) for end in ("6", "resumed"))
    assert whole["step"] == 6 and whole["text_optimizer"]["state"] and whole["ema"]
    for part in ("model", "optimizer", "text_optimizer", "ema", "rng", "samples_seen", "epoch", "consumed"):
        assert first_difference(whole[part], resumed[part], part) is None, (kind, part)
    exports = [lora_export(runs[f"{kind}_{end}"], name) for end in ("6", "resumed")]
    assert first_difference(*exports) is None, kind


# ------------------------------------------------------------------------------------------------------------
# Bad input and what protects against it


def test_every_rank_starts_from_rank_0s_weights_and_skips_a_step_whose_sharded_gradients_are_not_finite(tmp_path):
    torch.multiprocessing.spawn(two_ranks_from_different_seeds, args=(str(tmp_path),), nprocs=2, join=True)


def two_ranks_from_different_seeds(rank, folder):
    """Two gloo processes build the model from different seeds; once sharded, the model is rank 0's. Then one rank
    alone has an infinite gradient in its shard: both see the global norm and both skip the update, by the host's
    check and by fused AdamW's `found_inf` on the device (DTensor parameters, a plain flag)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.mechanics.distributed import DistInfo, data_parallel, gathered
    from trainer.mechanics.distributed import whole as made_whole
    from trainer.mechanics.optimizers import adamw
    from trainer.trainer_utils import NonFiniteSteps, not_finite

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        model = SD3Light(preset_config("tiny"))
        rank0 = [model.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(rank0, 0)  # what rank 0 built, as rank 0 built it
        info = DistInfo(rank, rank, 2, torch.device("cpu"), init_device_mesh("cpu", (2,)))
        whole = gathered(data_parallel(model, info).state_dict(), info)
        if rank == 0:
            assert first_difference(rank0[0], whole) is None
        guard = NonFiniteSteps(folder)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=0.1)
        before = [p.to_local().clone() for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        if rank == 1:
            params[0].grad.to_local()[0] = float("inf")
        # as the stages' loops did: the gradients clipped by their global norm, read, the update only where finite
        grad_norm = made_whole(torch.nn.utils.clip_grad_norm_(params, 1.0)).item()
        skipped = guard.skip(1.0, grad_norm, 1)
        if skipped is None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert skipped is not None and not math.isfinite(grad_norm) and guard.in_a_row == 1
        assert all(torch.equal(p.to_local(), b) for p, b in zip(params, before))
        # as every stage's loop does now: the skip decided on the device, fused AdamW reading it
        fused = adamw(params, 0.1, 0.0)
        for p in params:
            p.grad = torch.zeros_like(p)
        if rank == 1:
            params[0].grad.to_local()[0] = float("inf")
        norm = made_whole(torch.nn.utils.clip_grad_norm_(params, 1.0))
        flag = not_finite(torch.tensor(1.0, dtype=torch.float64), norm)
        fused.found_inf = flag
        fused.step()
        assert flag.item() == 1.0 and all(torch.equal(p.to_local(), b) for p, b in zip(params, before))
        whole_gradients_beside_the_shards(rank, params)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def whole_gradients_beside_the_shards(rank, sharded):
    """Gradients no wrapper reduces (the text encoders' adapters) are averaged over the ranks, one without left as
    it is; then they and the `sharded` parameters' are clipped by their joint norm, as torch clips all whole."""
    from trainer.mechanics.distributed import DistInfo, average_gradients, clip_grad_norm_mixed

    text = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    text[0].grad = torch.full((3,), float(rank + 1))
    average_gradients(text, DistInfo(rank, rank, 2))
    assert torch.equal(text[0].grad, torch.full((3,), 1.5)) and text[1].grad is None
    small = 2.0 ** -7  # its squares sum exactly in fp32
    for p in sharded:
        p.grad = torch.full_like(p, small)
    mixed = clip_grad_norm_mixed(sharded + text, 1.0)
    expected = math.sqrt(sum(p.numel() for p in sharded) * small ** 2 + 3 * 1.5 ** 2)
    clip = 1.0 / (mixed + 1e-6)
    assert mixed.item() == pytest.approx(expected, rel=1e-6) and expected > 1.0
    assert torch.equal(text[0].grad, torch.full((3,), 1.5) * clip) and text[1].grad is None
    assert all(torch.equal(p.grad.full_tensor(), torch.full(p.shape, small) * clip) for p in sharded)


def test_a_shard_size_that_does_not_divide_the_processes_is_one_line_before_any_work(tmp_path, monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=r"--fsdp_shard_size 3 does not divide the 4 process\(es\): use a divisor"):
        run_in_process(train_pretrain, ["--fsdp", "1", "--fsdp_shard_size", "3"] + folders(tmp_path), monkeypatch)
    with pytest.raises(UserError, match=r"--fsdp_shard_size shards the weights: it needs --fsdp 1"):
        run_in_process(train_pretrain, ["--fsdp_shard_size", "2"] + folders(tmp_path), monkeypatch)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "ckpt")


@ON_LEGS
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_incomplete_shards_are_a_one_line_error(tmp_path, legs, damage):
    shutil.copytree(legs("fsdp2", 3), tmp_path / "run")
    shards = next((tmp_path / "run" / "ckpt").glob("*.dcp"))
    shard = shards / "__1_0.distcp"
    if damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:1000])
    result = run(RECIPE + MODEL["fp32"] + ["--max_steps", "6", "--from_resume", "1"] + folders(tmp_path / "run"),
                 check=False)
    expected = "is missing" if damage == "delete" else "has 1000 bytes but its manifest says"
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.startswith("error: ") and "__1_0.distcp" in last and expected in last
    assert "Traceback" not in result.stderr


def test_shard_metadata_that_asks_for_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    with pytest.raises(pickle.UnpicklingError, match=r"asks for posix\.system, which is not checkpoint metadata"):
        MetadataUnpickler(io.BytesIO(pickle.dumps(Payload()))).load()


def test_shards_that_do_not_hold_what_the_run_has_are_a_one_line_error(tmp_path):
    """The resume file names the tensors its shards hold: a run with other ones is refused, naming them."""
    model = SD3Light(preset_config("tiny"))
    saved, tensors = split_tensors({"model": model.state_dict()})
    dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp_path / "shards")), no_dist=True)
    current = {"model": {**model.state_dict(), "extra.weight": torch.zeros(2)}}
    del current["model"]["proj_out.bias"]
    with pytest.raises(CheckpointError, match=r"run.json does not fit this run; missing: model/extra.weight \(1\); "
                                              r"unexpected: model/proj_out.bias \(1\)"):
        read_shards(str(tmp_path / "shards"), saved, current, "run.json")
    fresh = SD3Light(preset_config("tiny"))
    loaded = read_shards(str(tmp_path / "shards"), saved, {"model": fresh.state_dict()}, "run.json")
    assert first_difference(model.state_dict(), loaded["model"]) is None
    assert first_difference(model.state_dict(), fresh.state_dict()) is None  # read straight into the run's tensors


def eight_bit(shape, seed):
    """torchao's 8-bit optimizer state of `shape`, holding seeded random values."""
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit.zeros(shape, True, 256)
    state.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return state


def shard_unaligned_8bit_state(rank, folder):
    """A whole 8-bit state whose halves do not fall on its 256-value blocks (38 x 384: SD3.5-Large's norm bias on 2
    GPUs is alike), cut into this rank's shard; then the shards written."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.mechanics.distributed import shard_of

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)
    try:
        whole = eight_bit((38, 384), 0)
        target = distribute_tensor(torch.zeros(38, 384), init_device_mesh("cpu", (2,)), [Shard(0)])
        shard = shard_of(whole, target)  # 19 rows a rank: 7296 values, torchao's slice refuses them
        assert torch.equal(shard.to_local(), whole.dequantize()[19 * rank:19 * (rank + 1)])
        dcp.save({"m": shard}, storage_writer=FileSystemWriter(os.path.join(folder, "shards")))
    finally:
        dist.destroy_process_group()


def test_8bit_states_change_sharding_where_their_blocks_do_not_line_up(tmp_path):
    torch.multiprocessing.spawn(shard_unaligned_8bit_state, args=(str(tmp_path),), nprocs=2, join=True)
    whole = eight_bit((38, 384), 1)  # a one-process run's 8-bit state reads the two shards (read as fp32, requantised)
    read_shards(str(tmp_path / "shards"), {"m": {"__dcp__": "m"}}, {"m": whole}, "run.json")
    assert type(whole).__name__ == "OptimState8bit"
    expected = eight_bit((38, 384), 0).dequantize()
    assert torch.allclose(whole.dequantize(), expected, rtol=0.02, atol=1e-6)


def test_shards_are_hashed_for_the_manifest_and_a_wrong_read_back_is_caught(tmp_path, monkeypatch):
    from trainer.mechanics import sharded_checkpoint
    from trainer.mechanics.distributed import DistInfo

    tensors = {"model/a": torch.ones(3), "model/b": torch.arange(4)}
    entries = write_shards(str(tmp_path / "run.step00000001.dcp"), tensors, DistInfo())
    assert sorted(entries) == ["run.step00000001.dcp/.metadata", "run.step00000001.dcp/__0_0.distcp"]
    for name, entry in entries.items():
        assert entry["bytes"] == os.path.getsize(tmp_path / name) and len(entry["sha256"]) == 64
    monkeypatch.setattr(sharded_checkpoint, "tensors_equal", lambda a, b: not torch.equal(b, torch.ones(3)))
    with pytest.raises(RuntimeError, match=r"writing the shards of .*run.step00000002.dcp failed: rank 0: .* read "
                                           r"back with a different model/a"):
        write_shards(str(tmp_path / "run.step00000002.dcp"), tensors, DistInfo())


@pytest.mark.slow
def test_own_data_with_validation_shards_like_ddp(tmp_path):
    """A folder with repeats, a trigger word, flips, caption lines and a mask, validated every step: FSDP logs the
    validation loss DDP logs and exports what DDP exports, the single file included."""
    from tests.conftest import CAT, noise_image, save_array_png as save_png

    data = tmp_path / "data"
    for i, caption in enumerate(CAT):
        save_png(str(data / "3_cat" / f"cat{i}.png"), noise_image(i))
        (data / "3_cat" / f"cat{i}.txt").write_text(caption)
        save_png(str(data / "1_misc" / f"misc{i}.png"), noise_image(10 + i))
    save_png(str(data / "3_cat" / "cat0.mask.png"), noise_image(5)[..., 0])
    args = RECIPE[:1] + RECIPE[3:] + MODEL["fp32"] + ["--data", str(data), "--caption_prefix", "sks, ",
                                                      "--random_flip", "0.5", "--val_fraction", "0.25",
                                                      "--val_interval", "1", "--max_steps", "3", "--export_single_file"]
    runs = {mode: tmp_path / mode for mode in ("fsdp2", "ddp2")}
    run_many("trainer.train_pretrain", [args[1:] + MODES[mode][1] + folders(folder) for mode, folder in runs.items()])
    sharded, reference = metrics(runs["fsdp2"]), metrics(runs["ddp2"])
    assert [r["sample_ids"] for r in sharded] == [r["sample_ids"] for r in reference]
    assert [r["val_loss"] for r in sharded] == pytest.approx([r["val_loss"] for r in reference], rel=1e-5)
    single = {mode: load_safetensors(str(folder / "out" / f"{PRETRAIN_SMALL}_single_file.safetensors"))
              for mode, folder in runs.items()}
    assert single["fsdp2"].keys() == single["ddp2"].keys()
    for key, value in single["fsdp2"].items():
        assert (value.float() - single["ddp2"][key].float()).abs().max() <= 1e-2, key  # bf16 of fp32 within 1e-5
