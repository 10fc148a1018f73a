"""Your own images: a trigger word, repeats, flips, several captions, shuffled tags and masks change what trains
as they say, and survive a stop/resume bitwise; validation while training agrees with eval_loss; the curves are
drawn; bad input is one line."""
import json
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

import dataset.samples
from eval.plot_metrics import TIMING
import trainer.train_lora as train_lora
import trainer.train_pretrain as train_pretrain
from dataset.image_folder import CaptionOptions, DatasetError, ImageCaptionDataset
from dataset.samples import EpochSamples, shuffled_tags
from dataset.shapes import GRAMMAR_WORDS, ShapesDataset
from dataset.training_data import DataSettings, cached_dataset
from eval.eval_loss import quantile_losses
from eval.plot_metrics import plot_runs
from model.checkpoint import first_difference, load_torch, read_manifest
from model import checkpoint
from model.components import BuiltinComponents
from model.errors import UserError
from model.model_lora import read_lora_file
from model.rectified_flow import flow_loss
from model.weights import load_weights

from tests.scripts import REPO, run_in_process
from tests.conftest import QUIET
from tests.conftest import CAT, noise_image, save_array_png as save_png


@pytest.fixture
def folder(tmp_path):
    """3_cat: two images seen three times an epoch, two caption lines each, one with a mask (left half trains);
    1_misc: two images seen once, one caption each."""
    root = tmp_path / "data"
    for i, caption in enumerate(CAT):
        save_png(str(root / "3_cat" / f"cat{i}.png"), noise_image(i))
        (root / "3_cat" / f"cat{i}.txt").write_text(caption + "\n")
    mask = np.zeros((40, 40), np.uint8)
    mask[:, :20] = 255
    save_png(str(root / "3_cat" / "cat0.mask.png"), mask)
    for i in range(2):
        save_png(str(root / "1_misc" / f"misc{i}.png"), noise_image(10 + i))
        (root / "1_misc" / f"misc{i}.txt").write_text(f"misc, thing {i}")
    return root


def user_data(folder, prefix="sks, ", **kwargs):
    return ImageCaptionDataset(str(folder), 32, log=lambda line: None,
                               captions=CaptionOptions(prefix, "", per_line=True), **kwargs)


# ------------------------------------------------------------------------------------------------------------
# What an epoch shows


def test_repeats_prefix_and_caption_lines_shape_the_epoch(folder):
    lines = []
    data = ImageCaptionDataset(str(folder), 32, log=lines.append, captions=CaptionOptions("sks, ", per_line=True))
    assert [os.path.basename(path) for path, _ in data.items] == ["misc0.png", "misc1.png", "cat0.png", "cat1.png"]
    assert data.repeats == [1, 1, 3, 3] and "8 samples an epoch with repeats" in lines[0]
    assert data.captions[2] == ["sks, cat, red, big, round, soft", "sks, cat, small, blue"]
    assert data.captions[0] == ["sks, misc, thing 0"]
    samples = EpochSamples([data], 32, seed=0)
    assert len(samples) == 8  # 2 x 3 + 2 x 1
    first_image = {}
    for epoch in range(30):
        view = samples.for_epoch(epoch)
        captions = [view[slot]["caption"] for slot in range(len(view))]
        assert sum(c.startswith("sks, cat") for c in captions) == 6  # the cats' share is tripled
        first_image.setdefault(captions[2], epoch)  # slot 2: cat0's first showing
        assert all(c.startswith("sks, ") for c in captions)  # the trigger word is on every caption
    assert set(first_image) == set(data.captions[2])  # each line of cat0's caption file is drawn
    joined = ImageCaptionDataset(str(folder), 32, log=lambda line: None, captions=CaptionOptions())
    assert joined.captions[2] == ["cat, red, big, round, soft cat, small, blue"]


def test_the_trigger_word_reaches_the_text_encoder(folder, tmp_path, monkeypatch):
    seen = []
    encode = BuiltinComponents.encode

    def watch(components, images, captions):
        seen.extend(captions)
        return encode(components, images, captions)

    monkeypatch.setattr(BuiltinComponents, "encode", watch)
    run_in_process(train_pretrain, ["--data", str(folder), "--caption_prefix", "sks, ", "--batch_size", "2",
                                    "--max_steps", "2", "--sample_interval", "0", *QUIET,
                                    "--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt")],
                   monkeypatch)
    assert len(seen) == 4 and all(caption.startswith("sks, ") for caption in seen)


def test_a_flipped_variant_is_the_mirror_and_its_latents_are_cached(folder, tmp_path):
    data = user_data(folder)
    samples = EpochSamples([data], 32, flip=0.5, seed=0)
    assert len(samples.keys) == 2 * (2 * 2 + 2 * 1)  # every (image, caption) twice: as it is and mirrored
    plain, mirrored = samples.keys.index((0, 2, 0, False)), samples.keys.index((0, 2, 0, True))  # cat0
    a, b = samples.variants[plain], samples.variants[mirrored]
    assert torch.equal(b["image"], a["image"].flip(-1)) and torch.equal(b["mask"], a["mask"].flip(-1))
    assert a["mask"][0, :, :14].min() == 1 and a["mask"][0, :, 18:].max() == 0  # the left half trains (resized)
    flips = [samples.keys[samples.variant_of(epoch, 2)][3] for epoch in range(40)]
    assert 10 < sum(flips) < 30  # about half the epochs show it mirrored

    components = BuiltinComponents(GRAMMAR_WORDS)
    args = DataSettings(resolution=32, seed=0, val_data=None, val_samples=64, val_interval=100, cache="1",
                        cache_dir=str(tmp_path / "cache"), cache_only=False, encode_batch_size=4)
    info = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    cache = cached_dataset(args, samples, components, info, log=lambda line: None)
    features = cache.source  # the variants, encoded once each
    assert len(features) == len(samples.keys)
    assert torch.equal(features[mirrored]["latents"], components.encode_images(b["image"][None])[0])
    assert features[plain]["mask"].shape == (1, 16, 16)  # the mask at the latents' size
    assert torch.equal(features[mirrored]["mask"], features[plain]["mask"].flip(-1))


def test_shuffled_tags_keep_the_first_n_and_change_per_epoch(folder):
    draw = __import__("random").Random(0)
    assert shuffled_tags("a, b, c, d, e", 2, draw).startswith("a, b, ")
    data = user_data(folder)
    samples = EpochSamples([data], 32, shuffle_tags=True, keep_tags=2, seed=0)
    slot = 2  # cat0: its caption lines are "sks, cat, ..." whatever the epoch draws
    orders = set()
    for epoch in range(12):
        caption = samples.for_epoch(epoch)[slot]["caption"]
        tags = caption.split(", ")
        assert tags[:2] == ["sks", "cat"]
        original = next(c for c in data.captions[2] if sorted(c.split(", ")) == sorted(tags))
        assert sorted(original.split(", ")[2:]) == sorted(tags[2:])
        orders.add(caption)
    assert len(orders) > 2  # the rest is shuffled, differently from epoch to epoch


def test_a_black_mask_gives_zero_loss_and_no_gradient_from_its_region():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    pred = torch.randn(2, 4, 8, 8, generator=g, requires_grad=True)
    s = torch.tensor([0.3, 0.7])
    mask = torch.ones(2, 1, 32, 32)
    mask[:, :, :, :16] = 0  # the left half is ignored (image size: averaged down to the latents')
    loss = flow_loss(pred, x0, noise, s, mask=mask)
    loss.backward()
    assert pred.grad[..., :4].abs().max() == 0 and pred.grad[..., 4:].abs().min() > 0
    changed = pred.detach().clone()
    changed[..., :4] += 5.0
    assert flow_loss(changed, x0, noise, s, mask=mask) == loss.detach()  # what is masked out does not count
    right = flow_loss(pred.detach()[..., 4:], x0[..., 4:], noise[..., 4:], s)
    torch.testing.assert_close(loss.detach(), right)  # the weighted mean over what trains
    assert flow_loss(pred.detach(), x0, noise, s, mask=torch.zeros(2, 1, 32, 32)) == 0
    grey = flow_loss(pred.detach(), x0, noise, s, mask=torch.full((2, 1, 32, 32), 0.5))
    torch.testing.assert_close(grey, flow_loss(pred.detach(), x0, noise, s))  # uniform weight: the plain mean


# ------------------------------------------------------------------------------------------------------------
# Stop and resume, validation, plots


@pytest.fixture(scope="module")
def base(pretrained):
    return pretrained


def lora_argv(base, folder, run_dir, *extra):
    return ["--from_weight", base, "--data", str(folder), "--caption_prefix", "sks, ", "--random_flip", "0.5",
            "--val_fraction", "0.25", "--val_interval", "2", "--lora_alpha", "4", "--ema_decay", "0.9",
            "--batch_size", "2", "--max_steps", "8", "--save_interval", "3", *QUIET, "--out_dir",
            str(run_dir / "out"), "--save_dir", str(run_dir / "ckpt"), *extra]


def run_lora(argv, monkeypatch, signal_at=None):
    """train_lora's main() here; with `signal_at`, the signal_at-th sample fetched sends SIGTERM mid-step."""
    fetched = [0]
    getitem = dataset.samples.EpochView.__getitem__

    def counting(view, slot):
        fetched[0] += 1
        if fetched[0] == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return getitem(view, slot)

    with monkeypatch.context() as patch:
        patch.setattr(dataset.samples.EpochView, "__getitem__", counting)
        return run_in_process(train_lora, argv, patch)


def lora_final(run_dir):
    resume = str(run_dir / "ckpt" / "lora_demo_tiny_resume")
    state = load_torch(checkpoint.checkpoint_file(resume, read_manifest(resume, "resume"), ".pt"))
    state["export"] = read_lora_file(str(run_dir / "out" / "lora" / "lora_demo_tiny.safetensors"))[0]
    with open(run_dir / "out" / "lora_demo_tiny_metrics.jsonl") as f:
        state["logged"] = [{k: v for k, v in row.items() if k not in TIMING} for row in map(json.loads, f)]
    return state


@pytest.mark.parametrize("mode", ["live", "cached"])
def test_own_data_lora_stops_and_resumes_bitwise_with_validation(tmp_path, base, folder, monkeypatch, mode):
    # live: the text encoder runs every step, tags shuffled; cached: every variant encoded once, read back
    extra = ["--shuffle_tags", "1", "--keep_tags", "2"] if mode == "live" else ["--cache", "1", "--cache_dir",
                                                                                 str(tmp_path / "cache")]
    _, messages = run_lora(lora_argv(base, folder, tmp_path / "whole", *extra), monkeypatch)
    assert any(m.startswith("validation: 1 images of --data every 2 steps") for m in messages)
    # the signal comes while step 5's first sample is fetched (2 a step): the step completes and is saved first
    run_lora(lora_argv(base, folder, tmp_path / "cut", *extra), monkeypatch, signal_at=2 * 4 + 1)
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / "lora_demo_tiny_resume"), "resume")["step"] == 5
    run_lora(lora_argv(base, folder, tmp_path / "cut", *extra, "--from_resume", "1"), monkeypatch)
    whole, cut = lora_final(tmp_path / "whole"), lora_final(tmp_path / "cut")
    for key in ("model", "ema", "optimizer", "rng", "export", "step", "epoch", "consumed", "samples_seen"):
        assert first_difference(whole[key], cut[key], key) is None, key
    assert whole["logged"] == cut["logged"] and [r["step"] for r in cut["logged"]] == list(range(0, 9))
    # the base model's at step 0, then every --val_interval steps and at the end
    assert [r["step"] for r in whole["logged"] if "val_loss" in r] == [0, 2, 4, 6, 8]
    plot = tmp_path / "whole" / "out" / "samples" / "lora_demo_tiny_metrics.png"
    assert plot.is_file()
    # alpha 4 on rank 8 is folded into B: the file says alpha = rank, and every loader applies the same strength
    config = read_lora_file(str(tmp_path / "whole" / "out" / "lora" / "lora_demo_tiny.safetensors"))[1]
    assert config["rank"] == 8 and config["alpha"] == 8


def test_validation_loss_equals_eval_loss_on_the_same_weights(tmp_path, monkeypatch):
    out = tmp_path / "out"
    run_in_process(train_pretrain, ["--num_samples", "16", "--batch_size", "4", "--max_steps", "3",
                                    "--val_data", "builtin", "--val_samples", "6", "--val_interval", "3",
                                    "--ema_decay", "0.9", "--save_dtype", "fp32", "--sample_interval", "0", *QUIET,
                                    "--out_dir", str(out), "--save_dir", str(tmp_path / "ckpt")], monkeypatch)
    with open(out / "pretrain_tiny_metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    logged = [row["val_loss"] for row in rows if "val_loss" in row]
    assert [row["step"] for row in rows if "val_loss" in row] == [3]
    model, components, record = load_weights("pretrain_tiny", str(out))  # the exported (EMA) weights
    data = ShapesDataset("heldout", 6, 32, seed=0)
    losses = quantile_losses(model, components, data, 6, 4, torch.device("cpu"), record["prediction"])
    assert logged[0] == pytest.approx(sum(losses.values()) / len(losses), rel=1e-6)


def test_the_curves_are_drawn_for_one_run_or_several(tmp_path):
    for name, scale in (("one", 1.0), ("two", 0.5)):
        with open(tmp_path / f"{name}_metrics.jsonl", "w") as f:
            for step in range(1, 41):
                row = {"step": step, "epoch": 0, "loss": scale / step, "lr": 1e-4, "grad_norm": 1.0 + step % 3,
                       "images_per_s": 10.0, "samples_seen": 4 * step}
                if step % 10 == 0:
                    row["val_loss"] = scale * 2 / step
                f.write(json.dumps(row) + "\n")
        f = open(tmp_path / f"{name}_metrics.jsonl", "a")
        f.write('{"step": 41, "lo')  # a last line cut short by a kill is passed over
        f.close()
    path = plot_runs([str(tmp_path / "one_metrics.jsonl")], str(tmp_path / "one.png"))
    pixels = np.asarray(Image.open(path).convert("RGB"))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert pixels.std() > 10 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # drawn, not blank
    result = subprocess.run([sys.executable, "eval/plot_metrics.py", str(tmp_path / "one_metrics.jsonl"),
                             str(tmp_path / "two_metrics.jsonl"), "--out", str(tmp_path / "both.png")], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert np.asarray(Image.open(tmp_path / "both.png").convert("RGB")).std() > 10
    result = subprocess.run([sys.executable, "eval/plot_metrics.py", "nothing_here", "--out_dir", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1 and "no metrics" in result.stderr


# ------------------------------------------------------------------------------------------------------------
# Bad input: one line


def test_bad_masks_and_folder_prefixes_are_one_line_errors_or_counted_warnings(folder):
    save_png(str(folder / "1_misc" / "misc0.mask.png"), np.zeros((20, 40), np.uint8))
    with pytest.raises(DatasetError, match=r"mask .*misc0.mask.png is 40x20 but its image is 40x40") as e:
        user_data(folder)
    assert "\n" not in str(e.value)
    (folder / "1_misc" / "misc0.mask.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match=r"misc0.mask.png is not an image"):
        user_data(folder)
    os.remove(folder / "1_misc" / "misc0.mask.png")
    save_png(str(folder / "0_never" / "a.png"), noise_image(20))
    with pytest.raises(DatasetError, match=r"0_never: a 0_ prefix would never show its images"):
        user_data(folder)
    os.rename(folder / "0_never", folder / "x_odd")
    lines = []
    ImageCaptionDataset(str(folder), 32, log=lines.append)
    assert any(line.startswith("warning: 1 folder(s) have no N_ repeat prefix (x_odd)") for line in lines)


def bad_run(tmp_path, monkeypatch, *extra, data=None):
    argv = ["--data", str(data), "--batch_size", "2", "--max_steps", "1", "--sample_interval", "0", *QUIET,
            "--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt"), *extra]
    with pytest.raises(UserError) as e:
        run_in_process(train_pretrain, argv, monkeypatch)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_data_arguments_are_one_line(folder, tmp_path, monkeypatch):
    assert "hold out every image" in bad_run(tmp_path, monkeypatch, "--val_fraction", "1", data=folder)
    (tmp_path / "empty").mkdir()
    assert "--val_data" in bad_run(tmp_path, monkeypatch, "--val_data", str(tmp_path / "empty"), data=folder)
    assert "--cache 0" in bad_run(tmp_path, monkeypatch, "--shuffle_tags", "1", "--cache", "1", data=folder)
    assert "your own images" in bad_run(tmp_path, monkeypatch, "--random_flip", "0.5", data="builtin")
    # --keep_tags beyond a caption's tags: a counted warning, and the run goes on
    _, messages = run_in_process(train_pretrain, ["--data", str(folder), "--shuffle_tags", "1", "--keep_tags", "4",
                                                  "--batch_size", "2", "--max_steps", "1", "--sample_interval", "0",
                                                  *QUIET, "--out_dir", str(tmp_path / "out"), "--save_dir",
                                                  str(tmp_path / "ckpt")], monkeypatch)
    assert "warning: 4 caption(s) have no more than --keep_tags 4 tags" in "\n".join(messages)
