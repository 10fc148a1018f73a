"""--export_single_file: the transformer in the original SD3 / SD3.5 single-file layout, which diffusers'
from_single_file (and ComfyUI, Forge) read, and which our loaders read back as --from_weight."""
import pytest
import torch
from safetensors import safe_open

import trainer.train_full_sft as train_full_sft
import trainer.train_pretrain as train_pretrain
from model import checkpoint
from model.checkpoint import load_safetensors, read_manifest
from model.errors import UserError
from model.model_sd3light import SD3Light
from model.single_file import PREFIX, single_file_state
from model.weights import load_weights, single_file_path

from tests.scripts import run_in_process
from tests.conftest import CONFIGS, QUIET, randomise


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_layout_is_what_diffusers_converts_back_to_our_tensors(name):
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    state = randomise(SD3Light(CONFIGS[name]), 0).state_dict()
    single = single_file_state(state)
    assert all(key.startswith(PREFIX) for key in single)
    assert f"{PREFIX}joint_blocks.0.x_block.attn.qkv.weight" in single
    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(single))
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state), name


def pretrain(tmp_path, monkeypatch, *extra):
    out = tmp_path / "out"
    run_in_process(train_pretrain, ["--num_samples", "8", "--batch_size", "4", "--max_steps", "2",
                                    "--sample_interval", "0", *QUIET, "--out_dir", str(out), "--save_dir",
                                    str(tmp_path / "ckpt"), *extra], monkeypatch)
    return out


def test_single_file_export_loads_in_diffusers_and_back_as_from_weight(tmp_path, monkeypatch):
    from diffusers import SD3Transformer2DModel

    out = pretrain(tmp_path, monkeypatch, "--prediction", "v", "--export_single_file")
    path = single_file_path(str(out / "pretrain_tiny"))
    stem = str(out / "pretrain_tiny")
    ours = load_safetensors(checkpoint.checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))
    with safe_open(path, framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    theirs = SD3Transformer2DModel.from_single_file(path, config=str(out / "pretrain_tiny"), subfolder="transformer",
                                                    local_files_only=True, torch_dtype=torch.bfloat16).state_dict()
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[k], ours[k].to(torch.bfloat16)) for k in ours)  # bitwise (the export is bf16)

    model, _, record = load_weights(path)  # our loaders: the record rides in the file's metadata
    assert record["prediction"] == "v" and record["step"] == 2
    assert all(torch.equal(v, ours[k].to(torch.bfloat16).float()) for k, v in model.state_dict().items())
    run_in_process(train_full_sft, ["--from_weight", path, "--num_samples", "8", "--batch_size", "4",
                                    "--max_steps", "1", "--sample_interval", "0", *QUIET, "--out_dir",
                                    str(tmp_path / "sft"), "--save_dir", str(tmp_path / "sft_ckpt")], monkeypatch)
    sft = read_manifest(str(tmp_path / "sft" / "sft_tiny"), "weights")
    assert sft["step"] == 1 and sft["args"]["from_weight"] == path


def test_single_file_export_of_clean_image_weights_is_refused_before_training(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="--export_single_file needs v-prediction") as e:
        pretrain(tmp_path, monkeypatch, "--prediction", "x", "--export_single_file")
    assert "\n" not in str(e.value) and not (tmp_path / "ckpt").exists()
