"""Saves that stream: written and read back a tensor at a time, still atomic and as strictly verified; a save the
disk cannot take is one line, and the last committed checkpoint resumes."""
import errno
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import model.checkpoint as checkpoint
import model.file_io as file_io
import trainer.train_full_sft as train_full_sft
from model.checkpoint import SaveError, load_safetensors, read_manifest, remove_leftovers, save_checkpoint

from tests.conftest import QUIET, run_stage


def weights(n=5):
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(64, 32, generator=generator) for i in range(n)}


def files_in(folder):
    return sorted(os.listdir(folder))


def test_a_streamed_file_is_a_safetensors_file_with_the_values_cast_as_declared(tmp_path):
    state = {**weights(), "steps": torch.arange(3), "flag": torch.tensor(True), "scalar": torch.tensor(2.5)}
    save_checkpoint(str(tmp_path / "run"), 1, {"kind": "weights"}, {".safetensors": state}, float_dtype=torch.bfloat16,
                    cast=True)
    back = load_file(str(tmp_path / "run.step00000001.safetensors"))  # safetensors' own reader
    assert back.keys() == state.keys()
    for key, value in state.items():
        expected = value.bfloat16() if value.is_floating_point() else value
        assert back[key].dtype == expected.dtype and torch.equal(back[key], expected), key


@pytest.mark.parametrize("cut", range(5))
def test_a_save_cut_at_any_tensor_leaves_the_last_committed_checkpoint_whole(tmp_path, monkeypatch, cut):
    stem = str(tmp_path / "run")
    save_checkpoint(stem, 1, {"kind": "weights"}, {".safetensors": weights()})
    before = {name: (tmp_path / name).read_bytes() for name in files_in(tmp_path)}
    real, written = file_io.write_bytes, []

    def dies_at_a_tensor(f, tensor):
        if len(written) == cut:
            raise KeyboardInterrupt  # the process stopped there (a kill leaves the same: a temp file)
        written.append(real(f, tensor))

    monkeypatch.setattr(file_io, "write_bytes", dies_at_a_tensor)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(stem, 2, {"kind": "weights"}, {".safetensors": {k: v + 1 for k, v in weights().items()}})
    remove_leftovers(stem)
    assert {name: (tmp_path / name).read_bytes() for name in files_in(tmp_path)} == before
    assert read_manifest(stem, "weights")["step"] == 1


def test_a_corrupted_tensor_is_caught_by_the_read_back_in_either_file(tmp_path, monkeypatch):
    stem, state = str(tmp_path / "run"), weights()
    real_bytes = file_io.write_bytes

    def flips_one_tensor(f, tensor):
        if torch.equal(tensor, state["layer3.weight"]):
            tensor = tensor.clone()
            tensor.view(-1)[7] += 1
        real_bytes(f, tensor)

    monkeypatch.setattr(file_io, "write_bytes", flips_one_tensor)
    with pytest.raises(RuntimeError, match=r"read back with a different layer3.weight"):
        save_checkpoint(stem, 1, {"kind": "weights"}, {".safetensors": state})
    monkeypatch.undo()
    real_save = torch.save

    def corrupts_the_file(obj, path):  # torch.save, then one value of one tensor altered on the disk
        real_save(obj, path)
        data = bytearray(open(path, "rb").read())
        at = data.find(state["layer3.weight"].view(-1)[:4].numpy().tobytes())
        data[at + 1] ^= 0x10
        open(path, "wb").write(bytes(data))

    monkeypatch.setattr(checkpoint.torch, "save", corrupts_the_file)
    with pytest.raises(RuntimeError, match=r"read back with a different state\['model'\]\['layer3.weight'\]"):
        save_checkpoint(stem, 1, {"kind": "resume"}, {".pt": {"model": state}})
    assert not os.path.exists(stem + ".json")


@pytest.mark.parametrize("failure", ["ENOSPC from the writer", "torch's writer falls short", "no free space"])
def test_a_save_the_disk_cannot_take_is_one_line_naming_what_to_resume(tmp_path, monkeypatch, failure):
    stem = str(tmp_path / "run")
    save_checkpoint(stem, 1, {"kind": "resume"}, {".pt": {"model": weights()}})
    if failure == "ENOSPC from the writer":
        def full(f, tensor):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(file_io, "write_bytes", full)
        part = {".safetensors": weights()}
    elif failure == "torch's writer falls short":
        def short(obj, path):
            raise RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 66719552 vs 66719444")
        monkeypatch.setattr(checkpoint.torch, "save", short)
        part = {".pt": {"model": weights()}}
    else:
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=1000))
        part = {".pt": {"model": weights()}}
    with pytest.raises(SaveError) as raised:
        save_checkpoint(stem, 2, {"kind": "resume"}, part)
    message = str(raised.value)
    assert "\n" not in message and f"cannot save into {tmp_path}" in message and "MB" in message
    assert "the last committed one, step 1" in message and "--from_resume 1" in message
    assert read_manifest(stem, "resume")["step"] == 1 and files_in(tmp_path) == ["run.json", "run.step00000001.pt"]
    # the disk is to blame where the error says so; torch's writer does not say why it fell short
    assert ("make room" in message) == (failure != "torch's writer falls short")


@pytest.mark.parametrize("failure", ["a data loader worker died", "the write was interrupted"])
def test_a_save_that_fails_for_another_reason_names_it_and_does_not_blame_the_disk(tmp_path, monkeypatch, failure):
    stem = str(tmp_path / "run")
    save_checkpoint(stem, 1, {"kind": "resume"}, {".pt": {"model": weights()}})
    if failure == "a data loader worker died":  # torch's SIGCHLD handler raises this wherever the main process is
        said = "DataLoader worker (pid 4242) is killed by signal: Terminated."

        def dies(obj, path):
            raise RuntimeError(said)
        monkeypatch.setattr(checkpoint.torch, "save", dies)
        part = {".pt": {"model": weights()}}
    else:
        said = "Input/output error"

        def cut(f, tensor):
            raise OSError(errno.EIO, said)
        monkeypatch.setattr(file_io, "write_bytes", cut)
        part = {".safetensors": weights()}
    with pytest.raises(SaveError) as raised:
        save_checkpoint(stem, 2, {"kind": "resume"}, part)
    message = str(raised.value)
    assert "\n" not in message and f"cannot save into {tmp_path}: {said}" in message and "make room" not in message
    assert "the last committed one, step 1" in message and "is intact" in message and "--from_resume 1" in message
    assert read_manifest(stem, "resume")["step"] == 1 and files_in(tmp_path) == ["run.json", "run.step00000001.pt"]


def test_a_run_whose_disk_fills_ends_in_one_line_and_resumes_from_its_last_save(tmp_path, monkeypatch, pretrained):
    base = pretrained
    argv = ["--from_weight", base, "--num_samples", "16", "--batch_size", "2", "--max_steps", "4", "--save_interval",
            "2", "--sample_interval", "0", *QUIET, "--out_dir", str(tmp_path / "out"), "--save_dir",
            str(tmp_path / "ckpt")]
    usage, committed = shutil.disk_usage(tmp_path), tmp_path / "ckpt" / "sft_tiny_resume.json"

    def fills_after_the_first_save(path):  # the checkpoint folder is full once step 2's resume file is in it
        return usage._replace(free=0 if committed.exists() and path.endswith("ckpt") else usage.free)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", fills_after_the_first_save)
    with pytest.raises(SaveError, match=r"cannot save into .*ckpt: not enough free space; .* step 2 .* is intact"):
        run_stage(train_full_sft, argv, monkeypatch)
    monkeypatch.undo()
    assert read_manifest(str(tmp_path / "ckpt" / "sft_tiny_resume"), "resume")["step"] == 2
    run_stage(train_full_sft, argv + ["--from_resume", "1"], monkeypatch)
    with open(tmp_path / "out" / "sft_tiny_metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f][-2:] == [3, 4]
    assert load_safetensors(str(tmp_path / "out" / "sft_tiny.step00000004.safetensors"))


def test_shards_the_disk_cannot_take_are_one_line_too(tmp_path, monkeypatch):
    import trainer.mechanics.sharded_checkpoint as sharded_checkpoint
    from trainer.mechanics.distributed import DistInfo

    stem = str(tmp_path / "run_resume")
    save_checkpoint(stem, 1, {"kind": "resume"}, {".pt": {"n": 1}})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded_checkpoint.dcp, "save", full)
    with pytest.raises(SaveError, match=r"cannot save into .*: No space left on device; .* step 1 .* is intact"):
        sharded_checkpoint.write_shards(stem + ".step00000002.dcp", weights(), DistInfo())
