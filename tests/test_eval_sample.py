"""Sampling from weights: default outputs go beside the weights, so two runs of the same name never overwrite each
other's grids or reports."""
import os
import sys

import torch
from PIL import Image

import eval.eval_sample as eval_sample
from dataset.shapes import GRAMMAR_WORDS
from eval.sampling import output_path
from model.components import BuiltinComponents
from model.model_sd3light import SD3Light, preset_config
from model.weights import save_weights


def save_tiny_weights(stem):
    model, components = SD3Light(preset_config("tiny")), BuiltinComponents(GRAMMAR_WORDS)
    record = {"stage": "pretrain", "preset": "tiny", "resolution": 32, "prediction": "x",
              "transformer": model.config.to_dict(), "components": components.spec,
              "sampling": {"steps": 1, "cfg": 2.0, "shift": 3.0}}
    save_weights(stem, 1, model, model.state_dict(), components.trained_state_dict(), record, torch.float32)
    return stem + ".json"


def test_two_runs_of_the_same_name_keep_their_own_sample_grids(tmp_path, monkeypatch):
    out = tmp_path / "out"
    written = []
    for run in ("run_a", "run_b"):
        weights = save_tiny_weights(str(tmp_path / run / "pretrain_tiny"))
        monkeypatch.setattr(sys, "argv", ["eval_sample.py", "--weights", weights, "--prompt", "a red circle",
                                          "--out_dir", str(out)])
        eval_sample.main()
        written.append(tmp_path / run / "samples" / "pretrain_tiny_eval.png")
    assert all(Image.open(path).size[0] > 0 for path in written)
    assert not os.path.exists(out / "samples")  # nothing of either run went to the shared --out_dir


def test_a_diffusers_folder_is_named_after_itself_in_out_dir(tmp_path):
    record = {"stage": "diffusers", "preset": "sd3-medium", "manifest": "/models/sd3-medium/transformer"}
    assert output_path(record, None, str(tmp_path), "samples/{name}_eval.png") == \
        os.path.join(str(tmp_path), "samples", "sd3-medium_eval.png")
    ours = {"stage": "sft", "preset": "tiny", "manifest": "/runs/a/sft_tiny.json"}
    assert output_path(ours, None, str(tmp_path), "geneval_{name}.json") == "/runs/a/geneval_sft_tiny.json"
    assert output_path(ours, {"args": {"lora_name": "demo"}}, str(tmp_path), "samples/{name}_eval.png") == \
        "/runs/a/samples/lora_demo_tiny_eval.png"
