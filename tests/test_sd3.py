"""Real SD3 components (a tiny SD3 folder built here, no download): every stage trains on them through the
cache, the cache is reused and rebuilt when it should be, and what we export is what diffusers samples."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import dataset.training_data
import trainer.train_pretrain as train_pretrain
from eval.sampling import load_for_sampling, sample_images
from model.rectified_flow import Sampler
from model import checkpoint
from model.checkpoint import first_difference, load_safetensors, read_manifest
from model.components import SD3Components
from model.errors import UserError
from model.weights import load_weights
import eval.eval_sample as eval_sample
import trainer.train_full_sft as train_full_sft
import trainer.train_lora as train_lora
from tests.scripts import run, run_here, run_in_process, run_script_here
from tests.conftest import SignalAt, final_state
from tests.tiny_sd3 import build_folder
from tests.conftest import GRID, diffusers_image, dirs

FAST = ["--max_steps", "2", "--batch_size", "2", "--warmup_steps", "1", "--sample_steps", "2", "--sample_interval", "0",
        *GRID, "--preset", "sd3-tiny", "--resolution", "32"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Five captioned images of three shapes: wide, tall and square (they fall into different buckets)."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for k, (w, h) in enumerate([(64, 32), (60, 30), (32, 64), (40, 40), (48, 48)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"p{k}.png")
        (folder / f"p{k}.txt").write_text(f"a large red circle number {k}")
    (folder / "p4.txt").write_text("a caption far longer than the seventy-seven tokens that CLIP reads, so that the "
                                   "encoders have to cut it short and the run has to say so")  # a token a letter
    return folder


@pytest.mark.slow
def test_pretrain_on_sd3_components_caches_once_and_exports_a_diffusers_pipeline(tmp_path, sd3, photos, capsys):
    from diffusers import StableDiffusion3Pipeline

    args = ["--base", sd3, "--data", str(photos), *FAST, *dirs(tmp_path)]
    first = run_here(train_pretrain, args + ["--export_pipeline"], capsys)
    assert "encoding 5 samples" in first.stdout and "buckets" in first.stdout
    assert "warning: 1 caption(s) were longer than CLIP's 77 tokens" in first.stdout
    out = tmp_path / "out"
    record = json.loads((out / "pretrain_sd3-tiny.json").read_text())
    assert record["prediction"] == "v" and record["components"]["kind"] == "sd3"

    # built once: the second run reuses it (and --cache_only stops there)
    again = run_here(train_pretrain, args + ["--cache_only"], capsys)
    assert "reusing 5 samples" in again.stdout and "encoding" not in again.stdout
    # a changed caption, or another resolution, rebuilds it
    (photos / "p1.txt").write_text("a small blue square")
    changed = run_here(train_pretrain, args + ["--cache_only"], capsys)
    assert "stale (changed: captions" in changed.stdout and "encoding 5 samples" in changed.stdout
    resized = run_here(train_pretrain, [*args, "--cache_only", "--resolution", "48"], capsys)
    assert "stale" in resized.stdout and "resolution" in resized.stdout and "encoding 5 samples" in resized.stdout

    # the exported pipeline folder loads in diffusers and draws what we draw, for a prompt and seed
    pipeline = StableDiffusion3Pipeline.from_pretrained(str(out / "pretrain_sd3-tiny"))
    assert pipeline.scheduler.config.shift == record["sampling"]["shift"]
    model, components, _ = load_weights(str(out / "pretrain_sd3-tiny.json"))
    prompt = "a large red circle number 3"
    ours = sample_images(model, components, [prompt], 7, Sampler(32, 3, 2.0, record["sampling"]["shift"], "v"),
                         torch.device("cpu"))[0]
    theirs = diffusers_image(pipeline, prompt, seed=7, steps=3, cfg=2.0)
    assert ours.abs().mean() > 0.01 and (ours - theirs).abs().max() < 1e-4

    # eval_sample on the run's weights, and on a diffusers folder (the base's own transformer)
    for weights in (str(out / "pretrain_sd3-tiny.json"), sd3):
        grid = tmp_path / "grid.png"
        run_here(eval_sample, ["--weights", weights, "--prompt", "a red circle", "--steps", "2", "--out", str(grid),
                               "--out_dir", str(out)], capsys)
        assert Image.open(grid).size[0] > 0
        grid.unlink()


@pytest.mark.slow
def test_sft_and_lora_start_from_the_base_transformer_and_the_lora_loads_in_diffusers(tmp_path, sd3, capsys):
    from diffusers import StableDiffusion3Pipeline

    common = ["--base", sd3, "--from_weight", "base", "--data", "builtin", "--num_samples", "8", *FAST,
              *dirs(tmp_path)]
    run_here(train_full_sft, common, capsys)
    out = tmp_path / "out"
    assert (out / "sft_sd3-tiny" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    # the cache of the same data and components is shared between stages
    # alpha != rank (8): the file folds the scale into B, and diffusers must apply the strength ours does
    lora = run_here(train_lora, [*common, "--prior_data", "none", "--learning_rate", "0.05", "--lora_alpha", "4"],
                    capsys)
    assert "reusing 8 samples" in lora.stdout
    lora_path = out / "lora" / "lora_demo_sd3-tiny.safetensors"

    model, components, _, lora_record = load_for_sampling(None, str(out), "cpu", lora=str(lora_path))
    assert lora_record["base"]["weights"] == os.path.join(sd3, "transformer")
    prompt, shift = "a large red circle in the center", 3.0
    ours = sample_images(model, components, [prompt], 3, Sampler(32, 2, 2.0, shift, "v"), torch.device("cpu"))[0]
    pipeline = StableDiffusion3Pipeline.from_pretrained(sd3)
    without = diffusers_image(pipeline, prompt, seed=3, steps=2, cfg=2.0)
    pipeline.load_lora_weights(str(lora_path))
    with_lora = diffusers_image(pipeline, prompt, seed=3, steps=2, cfg=2.0)
    assert (ours - with_lora).abs().max() < 1e-4
    assert (with_lora - without).abs().max() > 1e-3  # the adapters did something


@pytest.mark.slow
def test_a_bad_base_folder_is_a_one_line_error(tmp_path, sd3, capsys):
    """Pretraining's run here as its __main__ runs it; the full fine-tune's in a process of its own."""
    broken = tmp_path / "no-vae"
    os.makedirs(broken)
    for part in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
        os.symlink(os.path.join(sd3, part), broken / part)
    cases = [
        (["--base", str(broken), "--preset", "sd3-tiny"], "lacks vae/"),
        (["--base", str(tmp_path / "nowhere"), "--preset", "sd3-tiny"], "is not a folder"),
    ]
    for extra, expected in cases:
        result = run_script_here(train_pretrain, [*extra, *dirs(tmp_path)], capsys)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr
    result = run(["trainer/train_full_sft.py", "--from_weight", "base", *dirs(tmp_path)], check=False)
    assert result.returncode == 2 and "needs --base" in result.stderr


def test_sd3_text_is_formed_as_diffusers_forms_it_with_and_without_t5(tmp_path, sd3):
    from diffusers import StableDiffusion3Pipeline

    no_t5 = build_folder(str(tmp_path / "no-t5"), with_t5=False)
    captions = ["a large red circle in the center", "", "two blue stars and words it has never seen"]
    for folder, extra in ((sd3, {}), (no_t5, {"text_encoder_3": None, "tokenizer_3": None})):
        pipeline = StableDiffusion3Pipeline.from_pretrained(folder, **extra)  # diffusers wants T5's absence said
        components = SD3Components(folder)
        with torch.no_grad():
            tokens, _, pooled, _ = pipeline.encode_prompt(captions, captions, captions, max_sequence_length=77,
                                                          do_classifier_free_guidance=False)
        ours_tokens, ours_pooled = components.encode_prompts(captions)
        assert torch.equal(ours_tokens, tokens) and torch.equal(ours_pooled, pooled)
        assert ours_tokens.shape == (3, 154, 4096) and ours_pooled.shape == (3, 2048)
    # caption dropout zeroes each encoder's part independently
    features = components.encode_text(captions)
    drop = torch.tensor([[True, False], [False, True], [False, False]])
    dropped_tokens, dropped_pooled = components.condition(features, drop)
    assert dropped_tokens[0, :, :32].abs().sum() == 0 and dropped_tokens[0, :77, 32:80].abs().sum() > 0
    assert dropped_pooled[0, :768].abs().sum() == 0 and dropped_pooled[1, 768:].abs().sum() == 0
    assert torch.equal(dropped_tokens[2], ours_tokens[2])


def test_a_cached_bucketed_run_on_sd3_components_stops_and_resumes_bitwise_exactly(tmp_path, sd3, photos,
                                                                                   monkeypatch):
    """Resume through the cache, with buckets and the VAE's latent sampling: the same as an uninterrupted run."""
    def argv(run_dir, *extra):
        return ["trainer/train_pretrain.py", "--base", sd3, "--data", str(photos), *FAST[2:], "--max_steps", "6",
                "--accumulation_steps", "2", "--save_interval", "2", "--ema_decay", "0.9", *dirs(run_dir), *extra]

    def run_pretrain(run_dir, *extra, signal_at=None):
        # the signal comes at a fetch from the cache (the training data), not while the cache is built
        monkeypatch.setattr(dataset.training_data, "build_cache",
                            SignalAt(signal_at).wrap(dataset.training_data.build_cache))
        monkeypatch.setattr("sys.argv", argv(run_dir, *extra))
        train_pretrain.main()

    def export(run_dir):
        stem = str(run_dir / "out" / "pretrain_sd3-tiny")
        return load_safetensors(checkpoint.checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))

    run_pretrain(tmp_path / "whole")
    run_pretrain(tmp_path / "cut", signal_at=4 * 3 + 1)  # in step 4 (4 samples a step)
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / "pretrain_sd3-tiny_resume"), "resume")["step"] == 4
    run_pretrain(tmp_path / "cut", "--from_resume", "1")
    whole = final_state(tmp_path / "whole", "pretrain_sd3-tiny", export)
    cut = final_state(tmp_path / "cut", "pretrain_sd3-tiny", export)
    assert whole["step"] == 6 and whole["epoch"] >= 2  # 5 images in 3 buckets: 2 steps an epoch
    for key in ("model", "ema", "optimizer", "rng", "export", "step", "epoch", "consumed", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"]
    # the epochs of bucketed data are planned in micro-batches: another batch size cannot continue them
    with pytest.raises(UserError, match="cannot resume bucketed data with --batch_size 1"):
        run_pretrain(tmp_path / "cut", "--from_resume", "1", "--batch_size", "1", "--force_resume", "1")


@pytest.mark.slow
def test_the_cache_is_built_by_every_process_under_torchrun(tmp_path, sd3, capsys):
    """Shard k is encoded by rank k mod 2; the index commits both, and a single process then reuses them."""
    args = ["trainer/train_pretrain.py", "--base", sd3, "--preset", "sd3-tiny", "--num_samples", "300", "--cache_only",
            *dirs(tmp_path)]
    built = run(args, torchrun=2)
    assert "encoding 300 samples into 2 shards" in built.stdout
    index = json.loads(next((tmp_path / "cache").glob("*/index.json")).read_text())
    assert [shard["count"] for shard in index["shards"]] == [256, 44]
    assert "reusing 300 samples in 2 shards" in run_here(train_pretrain, args[1:], capsys).stdout


def test_a_preset_sets_the_size_and_the_components_set_the_widths(tmp_path, sd3, monkeypatch):
    """Any preset pretrains on any components (here the built-in presets on SD3's, and on an SD3-style folder with a
    4-channel VAE): its channels and text widths come from the components and are recorded. Weights whose widths do
    not fit the components they are fine-tuned on are a one-line error."""
    four = build_folder(str(tmp_path / "four-channel"), with_t5=False, latent_channels=4)
    for base, channels in ((sd3, 16), (four, 4)):
        out = tmp_path / f"out{channels}"
        run_in_process(train_pretrain, ["--base", base, "--preset", "tiny", *FAST[:-4], "--num_samples", "8",
                                        "--out_dir", str(out), "--save_dir", str(out), "--cache_dir",
                                        str(tmp_path / "cache")], monkeypatch)
        record = json.loads((out / "pretrain_tiny.json").read_text())
        widths = {k: record["transformer"][k] for k in ("in_channels", "out_channels", "pooled_projection_dim")}
        assert record["preset"] == "tiny" and record["transformer"]["num_layers"] == 6
        assert widths == {"in_channels": channels, "out_channels": channels, "pooled_projection_dim": 2048}
    with pytest.raises(UserError, match=r"does not fit the components \(sd3\): in_channels 16 \(components: 4\)") \
            as error:
        run_in_process(train_full_sft, ["--base", four, "--from_weight", str(tmp_path / "out16" / "pretrain_tiny.json"),
                                        "--max_steps", "1", "--out_dir", str(tmp_path / "sft")], monkeypatch)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_own_data_on_sd3_components_caches_each_variant_once_and_validates(tmp_path, sd3, photos, capsys):
    folder = tmp_path / "data" / "3_photos"  # seen three times an epoch
    shutil.copytree(photos, folder)
    Image.fromarray(np.full((40, 40), 255, np.uint8)).save(folder / "p3.mask.png")
    args = ["--base", sd3, "--from_weight", "base", "--data", str(tmp_path / "data"), "--caption_prefix", "sks, ",
            "--random_flip", "0.5", "--val_fraction", "0.2", "--val_interval", "1", *FAST, *dirs(tmp_path)]
    first = run_here(train_lora, args, capsys)
    # 4 images train (one held out), 3 times an epoch; each is cached as it is and mirrored, with the mask's latents
    assert "an epoch shows 12 samples drawn from 8 variants" in first.stdout
    assert "validation: 1 images of --data every 1 steps" in first.stdout
    second = run_here(train_lora, args, capsys)
    assert "reusing 8 samples" in second.stdout
    third = run_here(train_lora, args[:args.index("--caption_prefix")] + args[args.index("--caption_prefix") + 2:] +
                     ["--out_dir", str(tmp_path / "out3"), "--save_dir", str(tmp_path / "ckpt3")], capsys)
    assert "is stale (changed: captions" in third.stdout  # no trigger word: other text features, encoded again
    with open(tmp_path / "out" / "lora_demo_sd3-tiny_metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [0, 1, 2] and all(math.isfinite(row["val_loss"]) for row in rows)
    assert (tmp_path / "out" / "samples" / "lora_demo_sd3-tiny_metrics.png").is_file()


@pytest.mark.slow
def test_text_encoder_lora_trains_clip_from_cached_ids_and_diffusers_encodes_prompts_as_we_do(tmp_path, sd3, capsys):
    from diffusers import StableDiffusion3Pipeline

    from model.model_lora import read_lora_file

    args = ["--base", sd3, "--from_weight", "base", "--data", "builtin", "--num_samples", "8", *FAST, *dirs(tmp_path),
            "--prior_data", "none", "--train_text_encoders", "clip_l,clip_g", "--text_encoder_lr", "0.05,0.02"]
    lora = run_here(train_lora, args, capsys)
    assert "encoding 8 samples" in lora.stdout and "LoRA rank 8 on 12 layers of the text encoder clip_g" in lora.stdout
    path = tmp_path / "out" / "lora" / "lora_demo_sd3-tiny.safetensors"
    state, config, _ = read_lora_file(str(path))
    assert sorted(config["text"]) == ["text_encoder.", "text_encoder_2."]
    clip_l = [k for k in state if k.startswith("text_encoder.text_model.encoder.layers.")]
    assert clip_l and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in clip_l)
    # the cache keeps the trained encoders' token ids, and T5's output (it does not train)
    cached = next((tmp_path / "cache").rglob("*.safetensors"))
    with safe_open(str(cached), framework="pt") as f:
        keys = set(f.keys())
    assert any("clip_l_ids" in k for k in keys) and any("t5_tokens" in k for k in keys)
    assert not any("clip_l_tokens" in k for k in keys)

    # our sampler's prompt embeddings with the file, and diffusers' (load_lora_weights: the CLIP parts)
    _, components, _, _ = load_for_sampling(None, str(tmp_path / "out"), "cpu", lora=str(path))
    prompts = ["a large red circle in the center", ""]
    ours = components.encode_prompts(prompts)
    pipeline = StableDiffusion3Pipeline.from_pretrained(sd3)
    before = pipeline.encode_prompt(prompts, prompts, prompts, do_classifier_free_guidance=False,
                                    max_sequence_length=77)
    pipeline.load_lora_weights(str(path))
    theirs = pipeline.encode_prompt(prompts, prompts, prompts, do_classifier_free_guidance=False,
                                    max_sequence_length=77)
    for k, ours_part in ((0, ours[0]), (2, ours[1])):  # (prompt_embeds, _, pooled, _)
        assert (ours_part - theirs[k]).abs().max() <= 1e-5 * theirs[k].abs().max()
        assert (theirs[k] - before[k]).abs().max() > 1e-3  # the adapters trained


@pytest.mark.slow
def test_t5_lora_trains_from_cached_ids_and_is_saved_in_the_names_comfyui_maps(tmp_path, sd3, capsys):
    from transformers import T5EncoderModel

    args = ["--base", sd3, "--from_weight", "base", "--data", "builtin", "--num_samples", "4", *FAST, *dirs(tmp_path),
            "--prior_data", "none", "--train_text_encoders", "t5", "--text_encoder_lr", "0.01", "--lora_alpha", "16"]
    lora = run_here(train_lora, args, capsys)
    assert "LoRA rank 8 on 7 layers of the text encoder t5" in lora.stdout  # q, k, v, o, wi_0, wi_1, wo
    cached = next((tmp_path / "cache").rglob("*.safetensors"))
    with safe_open(str(cached), framework="pt") as f:
        keys = set(f.keys())
    assert any("t5_ids" in k for k in keys) and not any("t5_tokens" in k for k in keys)
    assert any("clip_l_tokens" in k for k in keys)  # the CLIP encoders, which do not train, stay cached
    # kohya's names, which ComfyUI maps for SD3's T5: lora_te3_ and T5's module path, dots as underscores
    path = tmp_path / "out" / "lora" / "lora_demo_sd3-tiny.safetensors"
    with safe_open(str(path), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys() if k.startswith("lora_te3_")}
    base = T5EncoderModel.from_pretrained(os.path.join(sd3, "text_encoder_3")).eval()
    comfyui = {"lora_te3_" + k[:-len(".weight")].replace(".", "_"): k for k in base.state_dict()
               if k.endswith(".weight")}
    stems = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in raw}
    assert len(stems) == 7 and stems <= comfyui.keys() and len(raw) == 3 * len(stems)
    merged = base.state_dict()
    for stem in stems:  # W + up @ down * alpha / rank, as ComfyUI applies it (alpha 16 / rank 8: folded into up)
        down, up, alpha = raw[f"{stem}.lora_down.weight"], raw[f"{stem}.lora_up.weight"], raw[f"{stem}.alpha"]
        weight = merged[comfyui[stem]]
        assert down.shape == (8, weight.shape[1]) and up.shape == (weight.shape[0], 8) and alpha.item() == 8.0
        merged[comfyui[stem]] = weight + (up.float() @ down.float()) * alpha.item() / 8
    # our sampler applies them: its T5 tokens are those of the weights merged by hand, and moved from the base's
    _, components, _, _ = load_for_sampling(None, str(tmp_path / "out"), "cpu", lora=str(path))
    prompts = ["a large red circle in the center", "two blue squares"]
    ids = components.tokenizers["t5"](prompts, padding="max_length", max_length=components.t5_max_length,
                                      truncation=True, return_tensors="pt").input_ids
    ours = components.encode_prompts(prompts)[0][:, 77:]  # after CLIP's 77 tokens
    with torch.no_grad():
        before = base(ids)[0]
        base.load_state_dict(merged)
        by_hand = base(ids)[0]
    assert (ours - by_hand).abs().max() <= 1e-5 * by_hand.abs().max()
    assert (by_hand - before).abs().max() > 1e-3  # the adapters trained
    # diffusers loads the file (its transformer part) and passes over T5's: its T5 output stays the base's
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(sd3)
    pipeline.load_lora_weights(str(path))
    theirs = pipeline.encode_prompt(prompts, prompts, prompts, do_classifier_free_guidance=False,
                                    max_sequence_length=components.t5_max_length)[0][:, 77:]
    assert torch.allclose(theirs, before, atol=1e-5)
