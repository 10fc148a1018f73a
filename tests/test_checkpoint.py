"""Checkpoints that cannot lie: verified atomic saves, manifests, kill safety, graceful stop, exact resume,
world-size changes and two nodes on localhost."""
import argparse
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import time

import pytest
import torch

import trainer.train_pretrain as train_pretrain
from dataset.shapes import GRAMMAR_WORDS, ShapesDataset
from model import checkpoint, file_io
from model.checkpoint import (
    CheckpointError, first_difference, load_safetensors, load_torch, read_manifest, remove_leftovers,
    save_checkpoint, sha256_of,
)
from model.components import BuiltinComponents
from model.errors import UserError
from model.model_sd3light import SD3Light, StateDictMismatchError, preset_config
from model.weights import load_weights, save_weights
from trainer.mechanics.distributed import NamedOptimizerState
from trainer.mechanics.checkpointer import RunSpec, check_resume
from trainer.mechanics import signals
from trainer.mechanics.signals import StopSignal
from trainer.trainer_utils import lr_at

from tests.scripts import REPO, run, run_here, run_in_process, run_many, run_script_here
from tests.conftest import GRID, PRETRAIN_SMALL, metric_steps, narrow_tiny, sft_export
from tests.conftest import final_state as ended_with
from tests.conftest import alive, children, family, launch, uncommitted, wait_for_step

SCRIPT = "trainer/train_pretrain.py"
QUIET = ["--warmup_steps", "2", "--sample_interval", "0", "--sample_steps", "1", *GRID]


def parse(argv=()):
    return train_pretrain.parse_args(list(argv))


def spec(args, stage):
    """The run `args` describe, as a resume compares it (no settings decided at start-up)."""
    return RunSpec(stage, {"kind": "full"}, vars(args), args.resume_kinds, {})


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return SD3Light(preset_config("tiny"))


def files_in(directory):
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------------------------------------------------
# Verified saves and manifests


def test_save_commits_a_manifest_and_replaces_the_previous_step(tmp_path):
    stem = str(tmp_path / "run")
    save_checkpoint(stem, 1, {"kind": "test"}, {".safetensors": {"w": torch.ones(3)}, ".pt": {"n": 1}})
    save_checkpoint(stem, 2, {"kind": "test"}, {".safetensors": {"w": torch.full((3,), 2.0)}, ".pt": {"n": 2}})
    assert files_in(tmp_path) == ["run.json", "run.step00000002.pt", "run.step00000002.safetensors"]
    record = read_manifest(stem, "test")
    assert record["step"] == 2
    for name, entry in record["files"].items():
        path = tmp_path / name
        assert entry == {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    assert load_safetensors(str(tmp_path / "run.step00000002.safetensors"))["w"].tolist() == [2, 2, 2]
    assert load_torch(str(tmp_path / "run.step00000002.pt")) == {"n": 2}
    assert oct(os.stat(tmp_path / "run.step00000002.pt").st_mode & 0o777) != oct(0o600)  # not private to the writer


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "garbage_manifest", "other_kind"])
def test_a_damaged_checkpoint_is_a_one_line_error(tmp_path, damage):
    stem = str(tmp_path / "run")
    save_checkpoint(stem, 3, {"kind": "resume"}, {".pt": {"w": torch.arange(1000.0)}})
    data = tmp_path / "run.step00000003.pt"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "delete":
        data.unlink()
    elif damage == "garbage_manifest":
        (tmp_path / "run.json").write_text('{"kind": "resu')
    with pytest.raises(CheckpointError) as e:
        read_manifest(stem, "weights" if damage == "other_kind" else "resume")
    message = str(e.value)
    assert "\n" not in message
    expected = {"truncate": "truncated", "flip": "sha256", "delete": "is missing",
                "garbage_manifest": "not a readable manifest", "other_kind": "is a resume checkpoint, not a weights"}
    assert expected[damage] in message


def test_an_empty_or_incomplete_state_is_refused_before_anything_is_replaced(tmp_path):
    model, components = tiny_model(), BuiltinComponents(GRAMMAR_WORDS)
    stem = str(tmp_path / "pretrain_tiny")
    record = {"stage": "pretrain", "preset": "tiny", "resolution": 32, "transformer": model.config.to_dict(),
              "components": components.spec, "sampling": {"steps": 1, "cfg": 1.0, "shift": 1.0}}
    save_weights(stem, 1, model, model.state_dict(), components.trained_state_dict(), record, torch.bfloat16)
    before = {name: (tmp_path / name).read_bytes() for name in files_in(tmp_path)}
    full = model.state_dict()
    partial = {k: v for k, v in full.items() if k != "pos_embed.pos_embed"}  # a buffer: saves must hold buffers too
    for state, needle in (({}, "missing"), (partial, "pos_embed.pos_embed"),
                          ({**full, "extra.weight": torch.ones(1)}, "1 unexpected: extra.weight")):
        with pytest.raises(StateDictMismatchError, match=needle):
            save_weights(stem, 2, model, state, components.trained_state_dict(), record, torch.bfloat16)
    assert {name: (tmp_path / name).read_bytes() for name in files_in(tmp_path)} == before
    with pytest.raises(RuntimeError, match="empty state dict"):
        save_checkpoint(stem, 2, {"kind": "weights"}, {".safetensors": {}})
    loaded, _, saved = load_weights(stem)
    assert saved["step"] == 1
    for other_name in ("pretrain_tiny.json", "pretrain_tiny.step00000001.safetensors"):  # what users also pass
        assert load_weights(str(tmp_path / other_name))[2]["step"] == 1
    assert all(torch.equal(v.bfloat16().float(), loaded.state_dict()[k]) for k, v in full.items())


def test_weights_in_another_dtype_than_declared_are_refused_before_anything_is_written(tmp_path):
    """An fp32 tensor among bf16 weights (what FSDP's upcasting has produced elsewhere) never reaches the disk."""
    mixed = {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(2), "steps": torch.ones(2, dtype=torch.long)}
    with pytest.raises(RuntimeError, match=r"b is torch.float32, not the declared torch.bfloat16 \(1 such tensors\)"):
        save_checkpoint(str(tmp_path / "run"), 1, {"kind": "weights"}, {".safetensors": mixed},
                        float_dtype=torch.bfloat16)
    assert files_in(tmp_path) == []
    mixed["b"] = mixed["b"].bfloat16()  # integers keep their own dtype
    save_checkpoint(str(tmp_path / "run"), 1, {"kind": "weights"}, {".safetensors": mixed}, float_dtype=torch.bfloat16)


def test_a_write_that_reads_back_wrong_is_caught_and_never_committed(tmp_path, monkeypatch):
    stem = str(tmp_path / "run")
    save_checkpoint(stem, 1, {"kind": "weights"}, {".safetensors": {"w": torch.ones(4)}})
    real_write_bytes = file_io.write_bytes

    def lossy_write_bytes(f, tensor):  # a writer that silently changes a value
        real_write_bytes(f, tensor * 0.5)

    monkeypatch.setattr(file_io, "write_bytes", lossy_write_bytes)  # the verified writer lives in model/file_io.py
    with pytest.raises(RuntimeError, match="read back with a different w"):
        save_checkpoint(stem, 2, {"kind": "weights"}, {".safetensors": {"w": torch.ones(4)}})
    assert read_manifest(stem, "weights")["step"] == 1  # the previous save is still the committed one
    remove_leftovers(stem)
    assert files_in(tmp_path) == ["run.json", "run.step00000001.safetensors"]


def test_leftovers_of_a_killed_save_are_removed_and_nothing_else(tmp_path):
    stem = str(tmp_path / "run")
    save_checkpoint(stem, 5, {"kind": "resume"}, {".pt": {"n": 5}})
    for name in (".tmp-run.step00000006.pt.x1y2", ".tmp-run.json.abcd", "run.step00000006.pt",
                 "run_metrics.jsonl", "other.step00000001.pt", ".tmp-other.json.1234", "notes.txt"):
        (tmp_path / name).write_text("x")
    assert sorted(remove_leftovers(stem)) == [".tmp-run.json.abcd", ".tmp-run.step00000006.pt.x1y2",
                                              "run.step00000006.pt"]
    assert files_in(tmp_path) == [".tmp-other.json.1234", "notes.txt", "other.step00000001.pt", "run.json",
                                  "run.step00000005.pt", "run_metrics.jsonl"]


def test_loading_weights_is_strict_and_names_the_keys(tmp_path):
    model, components = tiny_model(), BuiltinComponents(GRAMMAR_WORDS)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("proj_out.")}
    state["proj.out.weight"] = torch.ones(1)
    record = {"kind": "weights", "stage": "pretrain", "preset": "tiny", "resolution": 32,
              "transformer": model.config.to_dict(), "components": components.spec}
    save_checkpoint(str(tmp_path / "bad"), 1, record, {".safetensors": state})  # bypasses save_weights' check
    with pytest.raises(UserError, match=r"2 missing: proj_out.weight, proj_out.bias; 1 unexpected: proj.out.weight"):
        load_weights(str(tmp_path / "bad"))


def test_every_torch_load_in_the_repo_is_weights_only():
    import ast

    calls = []
    for package in ("model", "dataset", "trainer", "eval", "bench", "tests"):
        folder = os.path.join(REPO, package)
        for name in (n for n in os.listdir(folder) if n.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                    weights_only = [k.value for k in node.keywords if k.arg == "weights_only"]
                    calls.append((os.path.relpath(path, REPO), node.lineno,
                                  bool(weights_only) and isinstance(weights_only[0], ast.Constant)
                                  and weights_only[0].value is True))
    assert calls and all(ok for *_, ok in calls), [c for c in calls if not c[2]]


# ------------------------------------------------------------------------------------------------------------
# Resume checks


@pytest.mark.parametrize("layout", ["adamw", "two_optimizers", "one_per_parameter"])
def test_named_optimizer_state_is_what_dcp_writes(layout):
    """The resume file's optimizer state, named here from the model's parameters, is exactly DCP's
    get_optimizer_state_dict: the same names, values and groups in the same order, so either reads the other."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = SD3Light(preset_config("tiny"))
    if layout == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif layout == "two_optimizers":  # --optimizer muon's split (Muon's own steps are slow on a CPU)
        hidden, rest = model.block_matrices_and_rest()
        optimizer = [torch.optim.AdamW(hidden, lr=1e-3), torch.optim.AdamW(rest, lr=2e-3)]
    else:
        optimizer = [torch.optim.AdamW([param], lr=1e-3) for param in model.parameters()]
    ours = NamedOptimizerState(model, optimizer)
    assert first_difference(ours.state_dict(), get_optimizer_state_dict(model, optimizer)) is None  # before a step
    inputs = torch.randn(2, 12, 16, 16), torch.randn(2, 5, 128), torch.randn(2, 128), torch.tensor([1.0, 500.0])
    model(*inputs).square().mean().backward()
    for one in optimizer if isinstance(optimizer, list) else [optimizer]:
        one.step()
    mine, dcp = ours.state_dict(), get_optimizer_state_dict(model, optimizer)
    assert first_difference(mine, dcp) is None
    assert list(mine["state"]) == list(dcp["state"]) and len(mine["state"]) > 0
    assert [list(group) for group in mine["param_groups"]] == [list(group) for group in dcp["param_groups"]]


def test_resume_refuses_another_identity_and_needs_force_for_recipe_changes():
    args = parse([])
    state = {"kind": "resume", "stage": "pretrain", "args": vars(parse([])), "dataset_size": 20000}
    assert check_resume(state, spec(args, "pretrain"), 20000) == []
    with pytest.raises(UserError, match="not a MiniSD3 resume checkpoint"):
        check_resume({**state, "kind": "weights"}, spec(args, "pretrain"), 20000)
    with pytest.raises(UserError, match="from stage 'pretrain', not 'sft'"):
        check_resume(state, spec(args, "sft"), 20000)
    for flag, saved in (("prediction", "v"), ("resolution", 64), ("preset", "small"), ("data", "my_images")):
        with pytest.raises(UserError, match=rf"--{flag} {saved} \(saved\) vs .* \(now\)"):
            check_resume({**state, "args": {**state["args"], flag: saved}},
                         spec(parse(["--force_resume", "1"]), "pretrain"), 20000)
    changed = {**state, "args": {**state["args"], "learning_rate": 0.002, "batch_size": 8}}
    with pytest.raises(UserError, match=r"--batch_size 8 \(saved\) vs 16 \(now\); --learning_rate 0.002 .*"
                                        r"pass --force_resume 1"):
        check_resume(changed, spec(args, "pretrain"), 20000)
    with pytest.raises(UserError, match=r"dataset size 20000 \(saved\) vs 19000 \(now\)"):
        check_resume(state, spec(args, "pretrain"), 19000)
    forced = check_resume(changed, spec(parse(["--force_resume", "1"]), "pretrain"), 20000)
    assert forced == ["--batch_size 8 (saved) vs 16 (now)", "--learning_rate 0.002 (saved) vs 0.001 (now)"]
    # paths, saving, sampling and hardware settings are free to change
    free = parse(["--out_dir", "elsewhere", "--save_interval", "7", "--sample_cfg", "4", "--num_workers", "2"])
    assert check_resume(state, spec(free, "pretrain"), 20000) == []


def one_line_error(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


@pytest.mark.slow
def test_mismatched_or_foreign_resume_files_are_one_line_errors(tmp_path, capsys):
    """Run here as the script's __main__ runs it (test_train.py's bad inputs run in processes of their own)."""
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    dirs = ["--out_dir", out, "--save_dir", ckpt]
    run_here(train_pretrain, ["--num_samples", "16", "--batch_size", "4", "--max_steps", "2", *QUIET, *dirs], capsys)
    resume_json = os.path.join(ckpt, "pretrain_tiny_resume.json")
    error = one_line_error(run_script_here(train_pretrain, ["--preset", "small", "--from_resume", resume_json,
                                                             "--num_samples", "16", "--batch_size", "4", *dirs],
                                           capsys))
    assert "--preset tiny (saved) vs small (now)" in error
    error = one_line_error(run_script_here(train_pretrain, ["--from_resume", os.path.join(out, "pretrain_tiny.json"),
                                                             *dirs], capsys))
    assert "is a weights checkpoint, not a resume checkpoint" in error
    error = one_line_error(run_script_here(train_pretrain, ["--from_resume", "1", "--num_samples", "16", "--batch_size",
                                                             "4", "--max_steps", "2", *QUIET, "--learning_rate", "2e-3",
                                                             *dirs], capsys))
    assert "--learning_rate 0.001 (saved) vs 0.002 (now)" in error and "--force_resume 1" in error
    # a resume file holding a pickled object (here an argparse.Namespace) is refused, even with a valid manifest
    pickled = os.path.join(ckpt, "pretrain_tiny_resume.step00000002.pt")
    torch.save({"kind": "resume", "args": argparse.Namespace(lr=1)}, pickled)
    manifest = json.load(open(resume_json))
    manifest["files"] = {os.path.basename(pickled): {"bytes": os.path.getsize(pickled), "sha256": sha256_of(pickled)}}
    json.dump(manifest, open(resume_json, "w"))
    error = one_line_error(run_script_here(train_pretrain, ["--from_resume", "1", "--num_samples", "16", *dirs],
                                           capsys))
    assert "cannot read" in error and "Traceback" not in error


# ------------------------------------------------------------------------------------------------------------
# Graceful stop and exact resume (in-process: a dataset that signals the process itself at a chosen sample)


class SignalAtFetch(torch.utils.data.Dataset):
    """The built-in data; fetching item number `at` (counted over the whole run) sends `signum` to this process,
    as a scheduler would in the middle of a step."""

    def __init__(self, data, at=None, signum=signal.SIGTERM):
        self.data, self.at, self.signum, self.fetched = data, at, signum, 0
        self.sample_prompts = data.sample_prompts

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.fetched += 1
        if self.fetched == self.at:
            os.kill(os.getpid(), self.signum)
        return self.data[i]


def train_in_process(tmp_path, dataset, monkeypatch, from_resume="0", recipe=()):
    argv = ["--num_samples", str(len(dataset)), "--batch_size", "2", "--accumulation_steps", "2", "--max_steps", "9",
            "--save_interval", "3", "--ema_decay", "0.9", *QUIET, *recipe, "--from_resume", from_resume,
            "--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt")]
    with monkeypatch.context() as patch:
        return run_in_process(train_pretrain, argv, patch, build_dataset=lambda *args, **kwargs: dataset)


def final_state(run_dir, name="pretrain_tiny"):
    """What pretraining run `name` in `run_dir` ended with (conftest's final_state): its resume checkpoint, its
    exported weights ("export") and its rows."""
    return ended_with(run_dir, name, functools.partial(sft_export, name=name))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])  # muon: two optimizers, both states in the checkpoint
def test_sigterm_saves_at_the_step_boundary_and_resume_is_bitwise_exact(tmp_path, monkeypatch, optimizer):
    if optimizer == "muon":  # its orthogonalisation computes in bf16: one narrow block still has matrices for Muon
        narrow_tiny(monkeypatch)  # and the rest for AdamW
    data, recipe = ShapesDataset("train", 24, 32), ["--optimizer", optimizer]  # 6 steps of 4 an epoch: the run
    step, _ = train_in_process(tmp_path / "whole", SignalAtFetch(data), monkeypatch, recipe=recipe)  # crosses one
    assert step == 9
    # the signal comes while step 5's first micro-batch is fetched (4 samples a step): the step completes first
    step, messages = train_in_process(tmp_path / "cut", SignalAtFetch(data, at=4 * 4 + 1), monkeypatch, recipe=recipe)
    assert step == 5 and "stopped by SIGTERM at step 5, checkpoint saved" in messages[-1]
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / "pretrain_tiny_resume"), "resume")["step"] == 5
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is gone after the run returns
    step, messages = train_in_process(tmp_path / "cut", SignalAtFetch(data), monkeypatch, from_resume="1",
                                      recipe=recipe)
    assert step == 9 and any("at step 5 (epoch 0, 20 samples seen)" in m for m in messages)
    whole, cut = final_state(tmp_path / "whole"), final_state(tmp_path / "cut")
    for key in ("model", "ema", "optimizer", "rng", "export", "step", "epoch", "consumed", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"] and [r["step"] for r in cut["logged"]] == list(range(1, 10))


@pytest.mark.slow
def test_a_resume_file_in_the_earlier_layout_resumes_bitwise(tmp_path, monkeypatch):
    """Resume files from before the metrics were a named object (the wandb run's id at the top, no micro-batch
    size) still resume: a stopped run's file rewritten in that layout continues to the uninterrupted run's end,
    bit for bit."""
    data = ShapesDataset("train", 24, 32)
    train_in_process(tmp_path / "whole", SignalAtFetch(data), monkeypatch)
    train_in_process(tmp_path / "cut", SignalAtFetch(data, at=4 * 4 + 1), monkeypatch)
    stem = str(tmp_path / "cut" / "ckpt" / "pretrain_tiny_resume")
    manifest = read_manifest(stem, "resume")
    state = load_torch(checkpoint.checkpoint_file(stem, manifest, ".pt"))
    earlier = {**{k: v for k, v in state.items() if k not in ("metrics", "batch_size")},
               "wandb_id": state["metrics"]["wandb_id"]}
    record = {k: v for k, v in manifest.items() if k not in ("step", "files")}
    checkpoint.save_checkpoint(stem, manifest["step"], record, {".pt": earlier})
    step, messages = train_in_process(tmp_path / "cut", SignalAtFetch(data), monkeypatch, from_resume="1")
    assert step == 9 and any("at step 5 (epoch 0, 20 samples seen)" in m for m in messages)
    whole, cut = final_state(tmp_path / "whole"), final_state(tmp_path / "cut")
    for key in ("model", "ema", "optimizer", "rng", "export", "step", "epoch", "consumed", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"]


@pytest.fixture
def default_signals():
    """SIGINT and SIGTERM as an interactive Python starts with them, whatever the test run inherited (one started
    in the background, e.g. under nohup, ignores SIGINT); the inherited ones back afterwards."""
    inherited = {signum: signal.signal(signum, handler) for signum, handler in
                 ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))}
    yield
    for signum, handler in inherited.items():
        signal.signal(signum, handler)


def test_stop_signal_handler_sets_a_flag_and_a_second_ctrl_c_stops_at_once(default_signals):
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.received == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        with StopSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert stop.received == signal.SIGINT
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_under_torchrun_the_agents_copy_of_a_ctrl_c_is_the_same_stop(default_signals, monkeypatch):
    """torchrun passes the SIGINT it got on to its ranks, which a scheduler may have signalled too: a second SIGINT
    that soon after the first stops nothing more; one later is a second Ctrl-C."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(signals, "FORWARDED_SECONDS", 0.3)
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the agent's copy
        time.sleep(0.05)
        assert stop.received == signal.SIGINT
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        time.sleep(0.01)
        return i


def test_data_loader_workers_ignore_stop_signals_but_their_parents(default_signals):
    """A worker survives SIGTERM and SIGINT from anyone but its parent (a signal to the whole group: the main
    process stops the run), and leaves quietly when its loader ends it (torch's own SIGTERM to a stuck worker)."""
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=2, num_workers=2,
                                         worker_init_fn=signals.leave_stopping_to_the_main_process)
    with StopSignal() as stop, signals.stop_signals_held():
        batches = iter(loader)
    workers = [w.pid for w in batches._workers]
    assert next(batches).tolist() == [0, 1]
    for signum in ("TERM", "INT"):  # sent by another process, as a group signal is
        subprocess.run(["kill", f"-{signum}", *map(str, workers)], check=True)
    time.sleep(0.3)
    assert [next(batches).tolist() for _ in range(3)] == [[2, 3], [4, 5], [6, 7]]
    assert stop.received is None and all(w.is_alive() for w in batches._workers)
    os.kill(workers[0], signal.SIGTERM)  # from its parent
    batches._workers[0].join(timeout=10)
    assert batches._workers[0].exitcode == 0
    batches._shutdown_workers()
    assert not any(w.is_alive() for w in batches._workers)


def test_a_stop_during_a_save_lets_the_save_finish(tmp_path, monkeypatch, default_signals):
    """SIGTERM to the trainer and, from another process, to its 2 data loader workers, in the middle of a save (as
    a signal to the whole group comes): the save finishes, the step in progress too, and the run saves it."""
    real = checkpoint.write_torch

    def signalled(path, state):  # in the middle of the resume file's save at step 3
        workers = [str(pid) for pid in children(os.getpid())]
        subprocess.run(["kill", "-TERM", *workers], check=True)
        os.kill(os.getpid(), signal.SIGTERM)
        monkeypatch.setattr(checkpoint, "write_torch", real)
        return real(path, state)

    monkeypatch.setattr(checkpoint, "write_torch", signalled)
    step, messages = train_in_process(tmp_path, ShapesDataset("train", 24, 32), monkeypatch,
                                      recipe=["--num_workers", "2"])
    assert any(m.startswith("saved step 3:") for m in messages)  # that save finished: written and verified
    assert step == 4 and "stopped by SIGTERM at step 4, checkpoint saved" in messages[-1]  # the step in progress
    assert read_manifest(str(tmp_path / "ckpt" / "pretrain_tiny_resume"), "resume")["step"] == 4


# ------------------------------------------------------------------------------------------------------------
# Real processes: SIGKILL at random moments, stops signalled to the whole group, world-size changes, two nodes


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_a_save_and_the_run_ends_bitwise_equal(tmp_path, capsys):
    """The killed runs are processes of their own; the reference run and the last resume, which nothing kills, run
    here on one thread, as the killed ones do."""
    run_args = [SCRIPT, "--num_samples", "24", "--batch_size", "2", "--accumulation_steps", "2", "--max_steps", "12",
                "--ema_decay", "0.9", *QUIET]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run_here(train_pretrain, run_args[1:] + ["--save_interval", "1000", "--out_dir", str(ref / "out"), "--save_dir",
                                             str(ref / "ckpt")], capsys, threads=1)
    dirs = ["--out_dir", str(cut / "out"), "--save_dir", str(cut / "ckpt"), "--save_interval", "1"]
    metrics = str(cut / "out" / "pretrain_tiny_metrics.jsonl")
    rng, kills, mid_save, committed = random.Random(0), 0, 0, 0
    while kills < 12:
        proc = launch(run_args + dirs + ["--from_resume", "1"], log_path=tmp_path / f"attempt{kills}.log")
        if kills % 2 == 0:  # any moment from the start: imports, clean-up, loading the checkpoint, training
            time.sleep(rng.uniform(0.5, 6.0))
        else:  # just after a step: saves take most of each step here, so most of these land inside a save
            wait_for_step(proc, metrics, committed + 1)
            time.sleep(rng.uniform(0, 1.0))
        if proc.poll() is not None:
            break  # it finished first
        proc.kill()
        proc.wait()
        kills += 1
        left = uncommitted(str(cut / "ckpt"), "pretrain_tiny_resume") + \
            uncommitted(str(cut / "out"), "pretrain_tiny")
        mid_save += bool(left)
        # the last committed save is whole: its files match the manifest and load
        resume_at, weights_at = str(cut / "ckpt" / "pretrain_tiny_resume"), str(cut / "out" / "pretrain_tiny")
        if not os.path.exists(resume_at + ".json"):
            assert committed == 0  # killed before the first save ever committed
            continue
        resume = read_manifest(resume_at, "resume")
        load_torch(checkpoint.checkpoint_file(resume_at, resume, ".pt"))
        if os.path.exists(weights_at + ".json"):  # the weights are committed after the resume checkpoint
            load_weights(weights_at)
        assert resume["step"] >= committed
        committed = resume["step"]
    finished = run_here(train_pretrain, run_args[1:] + dirs + ["--from_resume", "1"], capsys, threads=1)
    assert "done:" in finished.stdout + finished.stderr
    print(f"{kills} kills, {mid_save} of them inside a save")
    assert kills >= 6 and mid_save >= 1
    assert not uncommitted(str(cut / "ckpt"), "pretrain_tiny_resume") and not uncommitted(str(cut / "out"),
                                                                                       "pretrain_tiny")
    whole, resumed = final_state(ref), final_state(cut)
    for key in ("model", "ema", "optimizer", "rng", "export", "step", "samples_seen"):
        assert first_difference(whole[key], resumed[key], key) is None, key
    assert whole["logged"] == resumed["logged"]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_stop_signalled_to_the_whole_group_saves_exits_0_and_resumes_bitwise(tmp_path, capsys, processes):
    """SIGTERM or SIGINT to a run's whole process group, as Ctrl-C, `timeout`, `kill -- -PGID` and schedulers
    send it: its data loader workers (2 a process) get it too and leave stopping to the trainer, which finishes
    the step, saves and exits 0 on every rank; no worker outlives it; the resumed run ends bitwise where the
    uninterrupted one does. Under torchrun the agent gets the signal too and passes it on. The 2-block sd3-tiny
    preset: what a stop does is the same at any size, and its steps and saves are cheap; 30 steps, for the signal
    sent after step 3 to arrive well before the end."""
    run_args = [SCRIPT, "--preset", "sd3-tiny", "--num_samples", "32", "--batch_size", "2", "--max_steps", "30",
                "--save_interval", "1000", "--ema_decay", "0.9", "--num_workers", "2", *QUIET]

    def dirs(name):
        return ["--out_dir", str(tmp_path / name / "out"), "--save_dir", str(tmp_path / name / "ckpt")]

    for signum in (signal.SIGTERM, signal.SIGINT):
        log = tmp_path / f"{signum.name}.log"
        torchrun = ["--standalone", "--log-dir", str(tmp_path / f"{signum.name}-ranks"), "--redirects", "3"]
        proc = launch(run_args + dirs(signum.name), torchrun=processes if processes > 1 else 0, log_path=log,
                      extra=torchrun if processes > 1 else ())
        wait_for_step(proc, str(tmp_path / signum.name / "out" / f"{PRETRAIN_SMALL}_metrics.jsonl"), 3)
        started = family(proc.pid)
        assert len(started) >= 3 * processes  # each trainer and its 2 workers (and torchrun)
        for group in {os.getpgid(pid) for pid in started}:  # torchrun starts each rank in a group of its own
            os.killpg(group, signum)
        code = proc.wait(timeout=120)
        text = log.read_text()
        if processes > 1:  # torchrun reports the signal it got (and would say if it had to kill a rank)
            outputs = ["".join(path.read_text() for path in sorted((tmp_path / f"{signum.name}-ranks").glob(
                f"*/attempt_0/{rank}/std*.log"))) for rank in (0, 1)]  # each rank's own output
            assert code == 1 and "SignalException" in text and "forcefully" not in text, text[-3000:]
            assert all("Traceback" not in out and "error:" not in out for out in outputs), outputs
            text = outputs[0]
        else:
            assert code == 0, text[-3000:]
        stopped_at = read_manifest(str(tmp_path / signum.name / "ckpt" / f"{PRETRAIN_SMALL}_resume"), "resume")["step"]
        assert f"stopped by {signum.name} at step {stopped_at}, checkpoint saved" in text and "Traceback" not in text
        assert 3 <= stopped_at < 30
        deadline = time.time() + 15
        while any(alive(pid) for pid in started) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in started)  # no worker outlived the run
    resumes = [run_args[1:] + dirs(signum.name) + ["--from_resume", "1"] for signum in (signal.SIGTERM, signal.SIGINT)]
    if processes > 1:
        run_many("trainer.train_pretrain", [run_args[1:] + dirs("whole")] + resumes, torchrun=processes)
    else:
        for argv in [run_args[1:] + dirs("whole")] + resumes:
            run_here(train_pretrain, argv, capsys, threads=1)
    whole = final_state(tmp_path / "whole", PRETRAIN_SMALL)
    for signum in (signal.SIGTERM, signal.SIGINT):
        resumed = final_state(tmp_path / signum.name, PRETRAIN_SMALL)
        for key in ("model", "ema", "optimizer", "rng", "export", "step", "samples_seen"):
            assert first_difference(whole[key], resumed[key], key) is None, (signum.name, key)
        assert whole["logged"] == resumed["logged"]


def check_epochs(rows, dataset_size, max_global_batch):
    """Every epoch's samples are distinct, and only a tail shorter than a global batch is left out."""
    by_epoch = {}
    for row in rows:
        by_epoch.setdefault(row["epoch"], []).extend(row["sample_ids"])
    for epoch, ids in by_epoch.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch} repeats samples"
        assert dataset_size - len(ids) < max_global_batch, f"epoch {epoch} skipped {dataset_size - len(ids)}"
    return by_epoch


@pytest.mark.slow
@pytest.mark.parametrize("first,second,signum", [(2, 1, signal.SIGTERM), (1, 2, signal.SIGINT)])
def test_stop_and_resume_on_another_world_size_continues_the_epoch(tmp_path, capsys, first, second, signum):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    run_args = [SCRIPT, "--num_samples", "20", "--batch_size", "2", "--epochs", "4", "--save_interval", "1000",
                "--log_sample_ids", "1", *QUIET, "--out_dir", str(out), "--save_dir", str(ckpt)]
    metrics = str(out / "pretrain_tiny_metrics.jsonl")
    proc = launch(run_args + ["--num_workers", "2"], torchrun=first if first > 1 else 0,
                  log_path=tmp_path / "first.log")
    wait_for_step(proc, metrics, 3)
    if first > 1:  # what a scheduler does: signal every worker
        for pid in children(proc.pid):
            os.kill(pid, signum)
    else:  # what Ctrl-C does: signal the whole process group, data loader workers included
        os.killpg(proc.pid, signum)
    assert proc.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    text = (tmp_path / "first.log").read_text()
    stopped_at = read_manifest(str(ckpt / "pretrain_tiny_resume"), "resume")["step"]
    assert f"stopped by {signal.Signals(signum).name} at step {stopped_at}" in text and "Traceback" not in text
    assert 3 <= stopped_at < 4 * 20 // (2 * first)  # it stopped early, at a step boundary
    if second > 1:
        resumed = run(run_args + ["--from_resume", "1"], torchrun=second)
    else:  # one process: here, on one thread as a process of its own would compute
        resumed = run_here(train_pretrain, run_args[1:] + ["--from_resume", "1"], capsys, threads=1)
    text = resumed.stdout + resumed.stderr
    assert f"resuming with {second} process(es) and global batch {2 * second} (saved: {first}, {2 * first})" in text
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))

    def row_batch(row):
        return 2 * (first if row["step"] <= stopped_at else second)

    assert all(len(r["sample_ids"]) == row_batch(r) for r in rows)
    # the schedule is counted in samples: the run ends where an uninterrupted one would (4 epochs of 20)
    assert 80 <= rows[-1]["samples_seen"] < 80 + 2 * second
    # and the learning rate follows the planned schedule at the samples seen, in steps of the first global batch
    for row in rows[-3:]:
        planned = lr_at((row["samples_seen"] - row_batch(row)) / (2 * first), 80 // (2 * first), 1e-3, 2, 0.1)
        assert row["lr"] == pytest.approx(planned, rel=1e-12)
    by_epoch = check_epochs(rows, 20, max(2 * first, 2 * second))
    assert sorted(by_epoch) == [0, 1, 2, 3]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_localhost_train_save_once_and_resume(tmp_path):
    # the 2-block sd3-tiny preset: what crosses the nodes is the same at any size, and its saves are small
    run_args = [SCRIPT, "--preset", "sd3-tiny", "--num_samples", "16", "--batch_size", "2", "--save_interval", "2",
                *QUIET]

    def folders(node):
        return ["--out_dir", str(tmp_path / node / "out"), "--save_dir", str(tmp_path / node / "ckpt")]

    def two_nodes(per_node_args, name, expect=0):
        port = str(free_port())
        procs = [launch(run_args + per_node_args[rank], torchrun=1, log_path=tmp_path / f"{name}{rank}.log",
                        extra=["--nnodes", "2", "--node_rank", str(rank), "--master_addr", "127.0.0.1",
                               "--master_port", port]) for rank in (0, 1)]
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout=300)
            assert (code == 0) == (expect == 0), (tmp_path / f"{name}{rank}.log").read_text()[-3000:]
        return [(tmp_path / f"{name}{rank}.log").read_text() for rank in (0, 1)]

    # each node is given its own folders: node 1 (rank 1) must write nothing at all, not even a folder
    first = ["--max_steps", "4"]
    node0, node1 = two_nodes([first + folders("node0"), first + folders("node1")], "first")
    assert "2 process(es)" in node0 and node0.count("saved step") == 2
    assert not os.path.exists(tmp_path / "node1")
    state = load_torch(str(tmp_path / "node0" / "ckpt" / "pretrain_sd3-tiny_resume.step00000004.pt"))
    assert state["world_size"] == 2 and state["samples_seen"] == 16 and len(state["rng"]) == 2
    # resuming needs a save folder that every node sees: here node 1 does not, and both stop with one line
    second = ["--max_steps", "6", "--from_resume", "1", "--force_resume", "1"]
    logs = two_nodes([second + folders("node0"), second + folders("node1")], "unshared", expect=1)
    for log in logs:  # (torchrun adds a traceback of its own about the failed child; ours has none)
        assert "error: only 1 of 2 processes see" in log and "every node sees" in log
        assert "trainer_utils.py" not in log and "train_pretrain.py\", line" not in log
    # with the folders shared (as on a cluster filesystem) both nodes resume
    node0, node1 = two_nodes([second + folders("node0")] * 2, "second")
    assert "the schedule now ends at step 6 (it was to end at step 4)" in node0  # a longer run is no recipe change
    assert "at step 4" in node0 and "saved step 6" in node0
    assert read_manifest(str(tmp_path / "node0" / "out" / "pretrain_sd3-tiny"), "weights")["step"] == 6
    assert files_in(tmp_path / "node0" / "ckpt") == ["pretrain_sd3-tiny_resume.json",
                                                     "pretrain_sd3-tiny_resume.step00000006.pt"]


def test_resuming_with_a_longer_schedule_trains_on_and_says_so(tmp_path, monkeypatch):
    """The most common reason to resume: train longer. A larger --max_steps or --epochs continues (one log line says
    the schedule ends later); a smaller one, or another learning rate, is still a recipe change."""
    common = ["--num_samples", "8", "--batch_size", "4", "--save_interval", "1", *QUIET,
              "--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt")]
    metrics = tmp_path / "out" / "pretrain_tiny_metrics.jsonl"
    step, _ = run_in_process(train_pretrain, common + ["--max_steps", "2"], monkeypatch)
    assert step == 2
    step, messages = run_in_process(train_pretrain, common + ["--max_steps", "3", "--from_resume", "1"], monkeypatch)
    assert step == 3 and "the schedule now ends at step 3 (it was to end at step 2): the learning rate follows the " \
        "longer schedule from here" in messages and not any("--force_resume" in m for m in messages)
    assert metric_steps(metrics) == [1, 2, 3]
    for change, refused in ((["--max_steps", "2"], "--max_steps 3 (saved) vs 2 (now)"),
                            (["--max_steps", "4", "--learning_rate", "2e-3"],
                             "--learning_rate 0.001 (saved) vs 0.002 (now)")):
        with pytest.raises(UserError, match=rf"cannot resume with changed settings: {re.escape(refused)} \(pass "
                                            r"--force_resume 1"):
            run_in_process(train_pretrain, common + change + ["--from_resume", "1"], monkeypatch)
    # what counts is where the schedule ends: 3 epochs of 2 steps end at step 6, after the 3 steps taken ...
    step, messages = run_in_process(train_pretrain, common + ["--max_steps", "0", "--epochs", "3", "--from_resume",
                                                              "1"], monkeypatch)
    assert step == 6 and "the schedule now ends at step 6 (it was to end at step 3): the learning rate follows the " \
        "longer schedule from here" in messages
    # ... so --max_steps 5, a larger number than 0, still ends earlier than 3 epochs: a recipe change
    with pytest.raises(UserError, match=r"--max_steps 0 \(saved\) vs 5 \(now\) \(pass --force_resume 1"):
        run_in_process(train_pretrain, common + ["--max_steps", "5", "--epochs", "3", "--from_resume", "1"],
                       monkeypatch)
    step, messages = run_in_process(train_pretrain, common + ["--max_steps", "0", "--epochs", "4", "--from_resume",
                                                              "1"], monkeypatch)
    assert step == 8 and "the schedule now ends at step 8 (it was to end at step 6): the learning rate follows the " \
        "longer schedule from here" in messages
    assert metric_steps(metrics) == list(range(1, 9))
