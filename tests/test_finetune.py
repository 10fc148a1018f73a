"""Full SFT and LoRA stages: they start from trained weights, resume exactly like pretraining, LoRA trains only
its adapters, and the adapters sample the same merged or not."""
import json
import os

import pytest
import torch

import trainer.train_full_sft as train_full_sft
import trainer.train_lora as train_lora
import trainer.networks as networks
from eval.sampling import load_for_sampling, sample_images
from model.rectified_flow import Sampler
from model.checkpoint import first_difference, read_manifest
from model.errors import UserError
from model.model_lora import lora_layers, read_lora_file
from model.model_sd3light import SD3Light, preset_config

from tests.scripts import run
from tests.conftest import QUIET, final_state, lora_export, pretrain_weights, run_stage, sft_export


@pytest.fixture(scope="module")
def base(pretrained):
    return pretrained


STAGES = {
    "sft": (train_full_sft, "sft_tiny", sft_export, ["--num_samples", "24"]),
    "lora": (train_lora, "lora_demo_tiny", lora_export, ["--num_samples", "12", "--prior_samples", "12",
                                                          "--ema_decay", "0.9"]),
    # the other adapter kinds (model/lokr.py, model_lora.DoRALinear): their factors and magnitudes resume too
    "lokr": (train_lora, "lora_demo_tiny", lora_export, ["--num_samples", "12", "--prior_samples", "12",
                                                          "--ema_decay", "0.9", "--adapter", "lokr"]),
    "dora": (train_lora, "lora_demo_tiny", lora_export, ["--num_samples", "12", "--prior_samples", "12",
                                                          "--ema_decay", "0.9", "--adapter", "dora"]),
    # LoRA on the built-in text encoder too, at a rate of its own, which stops training it after step 6
    "text": (train_lora, "lora_demo_tiny", lora_export, ["--num_samples", "12", "--prior_samples", "12",
                                                          "--ema_decay", "0.9", "--train_text_encoders", "text",
                                                          "--text_encoder_lr", "5e-4", "--text_encoder_steps", "6"]),
}
ADAPTER_KEYS = {"lora": (".lora_A.", ".lora_B."), "dora": (".lora_A.", ".lora_B.", ".dora_scale"),
                "lokr": (".lokr_w1", ".lokr_w2"), "text": (".lora_A.", ".lora_B.")}


@pytest.mark.parametrize("stage", list(STAGES))
def test_fine_tune_stages_stop_and_resume_bitwise_exactly(tmp_path, base, monkeypatch, stage):
    module, name, export, data = STAGES[stage]

    def argv(run_dir, *extra):
        return ["--from_weight", base, *data, "--batch_size", "2", "--accumulation_steps", "2", "--max_steps", "9",
                "--save_interval", "3", "--sample_interval", "0", *QUIET, "--out_dir", str(run_dir / "out"),
                "--save_dir", str(run_dir / "ckpt"), *extra]

    run_stage(module, argv(tmp_path / "whole"), monkeypatch)
    # the signal comes while step 5's first micro-batch is fetched (4 samples a step): the step completes first
    run_stage(module, argv(tmp_path / "cut"), monkeypatch, signal_at=4 * 4 + 1)
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / f"{name}_resume"), "resume")["step"] == 5
    run_stage(module, argv(tmp_path / "cut", "--from_resume", "1"), monkeypatch)
    whole, cut = final_state(tmp_path / "whole", name, export), final_state(tmp_path / "cut", name, export)
    assert whole["step"] == 9
    adapters = ("text_optimizer",) if stage != "sft" else ()  # (None where no text encoder trains)
    for key in ("model", "ema", "optimizer", *adapters, "rng", "export", "step", "epoch", "consumed", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"] and [r["step"] for r in cut["logged"]] == list(range(1, 10))
    with open(tmp_path / "whole" / "out" / f"{name}_metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    assert rows and all(row["tflop_s"] > 0 and row["mfu"] > 0 for row in rows)  # each step's FLOPs counted
    # step 0 shows the starting weights; each run's last grid shows where it ended
    samples = os.listdir(tmp_path / "whole" / "out" / "samples")
    assert f"{name}_step000000.png" in samples and f"{name}_step000009.png" in samples
    if stage != "sft":  # the resume file holds the adapters only, the export names its base weights
        assert whole["model"] and all(any(part in k for part in ADAPTER_KEYS[stage]) for k in whole["model"])
        assert all(any(part in k for k in whole["model"]) for part in ADAPTER_KEYS[stage])
        text = whole["text_optimizer"]["state"] if stage == "text" else {}
        assert len(whole["optimizer"]["state"]) + len(text) == len(whole["model"])
        assert (stage == "text") == any(k.startswith("text_encoder.text_model.") for k in whole["export"])
        if stage == "text":  # the text encoder's adapters trained, for its 6 steps (--text_encoder_steps) of the 9
            text_b = [v for k, v in whole["export"].items() if k.startswith("text_encoder.") and "lora_B" in k]
            assert len(text_b) == 12 and all(v.abs().sum() > 0 for v in text_b)  # 6 layers in each of 2 blocks
            assert {float(s["step"]) for s in text.values()} == {6.0}
            assert {float(s["step"]) for s in whole["optimizer"]["state"].values()} == {9.0}
        record = read_lora_file(str(tmp_path / "whole" / "out" / "lora" / "lora_demo_tiny.safetensors"))[2]
        assert record["base"]["weights"] == base and record["step"] == 9 and record["stage"] == "lora"
    else:
        assert len(whole["model"]) == len(SD3Light(preset_config("tiny")).state_dict())


def test_lora_training_changes_only_the_adapters(tmp_path, base, monkeypatch):
    seen = {}

    def apply_and_watch(model, *args):  # the stage's model, as it was before and right after the adapters went on
        seen["model"], seen["before"] = model, {k: v.clone() for k, v in model.state_dict().items()}
        adapted = apply_lora(model, *args)
        seen["trained"] = [p for p in model.parameters() if p.requires_grad]
        return adapted

    apply_lora = networks.apply_lora  # the stage puts its adapters on through networks.adapted_frozen
    monkeypatch.setattr(networks, "apply_lora", apply_and_watch)
    run_stage(train_lora, ["--from_weight", base, "--num_samples", "16", "--prior_data", "none",
                           "--lora_targets", "attention,ff", "--lora_rank", "4", "--lora_alpha", "8",
                           "--batch_size", "4", "--max_steps", "3", "--ema_decay", "0", "--sample_interval", "0",
                           *QUIET, "--learning_rate", "1e-2", "--out_dir", str(tmp_path / "out"),
                           "--save_dir", str(tmp_path / "ckpt")], monkeypatch)
    model, before, trained_params = seen["model"], seen["before"], seen["trained"]
    after = model.state_dict()
    assert {k for k in after if k not in before} == {k for k in after if ".lora_" in k}
    for key, value in before.items():  # every base weight and buffer, bit for bit
        assert torch.equal(after[key], value), key
    assert len(trained_params) == 2 * len(lora_layers(model))
    unchanged = [name for name, layer in lora_layers(model).items() if layer.lora_B.weight.abs().sum() == 0]
    assert unchanged == ["transformer_blocks.5.attn.add_q_proj"]  # the last block's text queries feed nothing


def test_lora_samples_the_same_merged_or_not_and_scale_zero_is_the_base(tmp_path, base, monkeypatch):
    out = tmp_path / "out"
    run_stage(train_lora, ["--from_weight", base, "--num_samples", "8", "--prior_data", "none", "--batch_size", "4",
                           "--max_steps", "2", "--learning_rate", "5e-2", "--sample_interval", "0", *QUIET,
                           "--out_dir", str(out), "--save_dir", str(tmp_path / "ckpt")], monkeypatch)
    prompts = ["a large white star in the center", "two white circles", ""]

    def images(weights=None, **lora):  # default weights: the LoRA's base
        model, components, record, _ = load_for_sampling(weights, str(out), "cpu", **lora)
        return sample_images(model, components, prompts, 0, Sampler(32, 4, 2.0, 3.0, record["prediction"]), "cpu")

    plain, merged = images(lora="demo"), images(lora="demo", merge=True)
    assert torch.allclose(plain, merged, atol=1e-4)
    base_images, at_zero = images(base), images(lora="demo", lora_scale=0.0)
    assert torch.equal(base_images, at_zero)
    assert (plain - base_images).abs().max() > 1e-2  # the adapter does change the images


@pytest.mark.slow
@pytest.mark.parametrize("script", ["trainer/train_full_sft.py", "trainer/train_lora.py"])
def test_from_weight_of_another_preset_is_a_one_line_error(tmp_path, base, script):
    result = run([script, "--from_weight", base, "--preset", "small", "--out_dir", str(tmp_path)], check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds 'tiny' weights, not --preset small" in lines[0]


def test_sft_keeps_the_prediction_of_its_weights(tmp_path, monkeypatch, pretrained_v):
    v_weights = pretrained_v
    out = str(tmp_path / "sft")
    common = ["--from_weight", v_weights, "--num_samples", "8", "--batch_size", "4", "--max_steps", "1",
              "--sample_interval", "0", *QUIET, "--out_dir", out, "--save_dir", str(tmp_path / "ckpt")]
    with pytest.raises(UserError, match="predicts v, not --prediction x"):
        run_stage(train_full_sft, common + ["--prediction", "x"], monkeypatch)
    run_stage(train_full_sft, common, monkeypatch)
    assert json.load(open(os.path.join(out, "sft_tiny.json")))["prediction"] == "v"


def test_a_resume_on_other_base_weights_is_refused(tmp_path, base, monkeypatch):
    common = ["--num_samples", "8", "--prior_data", "none", "--batch_size", "4", "--max_steps", "4",
              "--save_interval", "1", "--sample_interval", "0", *QUIET, "--out_dir", str(tmp_path / "out"),
              "--save_dir", str(tmp_path / "ckpt")]
    run_stage(train_lora, ["--from_weight", base] + common, monkeypatch, signal_at=5)  # stops after step 2
    other = pretrain_weights(tmp_path / "other", steps=3)
    with pytest.raises(UserError, match="resume checkpoint trained"):
        run_stage(train_lora, ["--from_weight", other, "--force_resume", "1", "--from_resume", "1"] + common,
                  monkeypatch)


def test_lora_names_and_missing_lora_files_are_one_line_errors(tmp_path, base, monkeypatch):
    with pytest.raises(UserError, match="letters, digits"):
        run_stage(train_lora, ["--from_weight", base, "--lora_name", "../x"], monkeypatch)
    with pytest.raises(UserError, match="no LoRA file for --lora nothing"):
        load_for_sampling(None, str(tmp_path), "cpu", lora="nothing")


def test_a_resolution_beyond_the_position_table_is_a_one_line_error(tmp_path, base, monkeypatch):
    with pytest.raises(UserError, match="--resolution 160: latent grid 40x40 patches exceeds the position table"):
        run_stage(train_full_sft, ["--from_weight", base, "--resolution", "160", "--num_samples", "4",
                                   "--batch_size", "2", "--max_steps", "1", "--out_dir", str(tmp_path / "out"),
                                   "--save_dir", str(tmp_path / "ckpt")], monkeypatch)
    assert not os.path.exists(tmp_path / "out" / "sft_tiny.json")
