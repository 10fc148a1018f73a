"""Pretraining end to end: real scripts, tiny sizes, few steps."""
import json
import os

import pytest
import torch
from PIL import Image

from dataset.shapes import GRAMMAR_WORDS, ShapesDataset
from model.components import BuiltinComponents
from model.model_sd3light import SD3Light, SD3LightConfig
from model.rectified_flow import Sampler, add_noise, euler_sample, flow_loss, sample_sigmas, to_velocity
import trainer.train_pretrain as train_pretrain
from trainer.mechanics.position import BucketSampler, EpochSampler
from model import precision
from model.precision import autocast_dtype
from model.errors import UserError
from model.weights import load_weights
from model.rectified_flow import FlowRecipe, flow_matching_loss
from trainer.mechanics.ema import EMA
from trainer.mechanics.optimizers import SkippingMuon
from trainer.trainer_utils import lr_at

import eval.eval_loss as eval_loss
import eval.eval_sample as eval_sample
from tests.scripts import run, run_here, run_in_process, run_many, run_outputs
from tests.conftest import GRID, metric_steps, narrow_tiny

SMALL_RUN = ["--num_samples", "64", "--batch_size", "4", "--warmup_steps", "2", "--save_interval", "2",
             "--sample_interval", "0", "--sample_steps", "2", *GRID]


@pytest.mark.slow
def test_pretrain_under_torchrun_saves_resumes_and_samples(tmp_path, capsys):
    """One torchrun launch: a run of 4 steps, then a copy of its folders resumed to 6 steps (the first run's
    folders keep what it left, to check here)."""
    def folders(name):
        return ["--out_dir", str(tmp_path / name / "out"), "--save_dir", str(tmp_path / name / "ckpt")]

    result = run_many("trainer.train_pretrain", [
        SMALL_RUN + folders("first") + ["--max_steps", "4", "--ema_decay", "0.9"],
        ["--copy", str(tmp_path / "first"), str(tmp_path / "resumed")],
        # resumed to run longer (--force_resume is no longer needed for that, and changes nothing here)
        SMALL_RUN + folders("resumed") + ["--max_steps", "6", "--ema_decay", "0.9", "--from_resume", "1",
                                          "--force_resume", "1"]])
    outputs = run_outputs(result.stdout)
    assert len(outputs) == 2
    out, ckpt = str(tmp_path / "first" / "out"), str(tmp_path / "first" / "ckpt")
    for name in ("pretrain_tiny.json", "pretrain_tiny.step00000004.safetensors",
                 "pretrain_tiny.step00000004.components.safetensors", "pretrain_tiny_metrics.jsonl",
                 "samples/pretrain_tiny_step000004.png"):
        assert os.path.exists(os.path.join(out, name)), name
    assert not [n for n in os.listdir(out) if ".step00000002." in n]  # the step-2 save was replaced
    state = torch.load(os.path.join(ckpt, "pretrain_tiny_resume.step00000004.pt"), weights_only=True)
    assert state["step"] == 4 and state["world_size"] == 2 and state["samples_seen"] == 4 * 4 * 2
    assert len(state["rng"]) == 2 and all(v.dtype == torch.float32 for v in state["model"].values())
    record = json.load(open(os.path.join(out, "pretrain_tiny.json")))
    assert record["step"] == 4 and record["transformer"]["num_layers"] == 6 and record["ema"]
    assert record["prediction"] == "x"  # the default; sampling and held-out loss read it from here

    out, ckpt = str(tmp_path / "resumed" / "out"), str(tmp_path / "resumed" / "ckpt")
    assert "at step 4" in outputs[1]
    assert metric_steps(os.path.join(out, "pretrain_tiny_metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
    assert json.load(open(os.path.join(ckpt, "pretrain_tiny_resume.json")))["step"] == 6
    assert sorted(os.listdir(ckpt)) == ["pretrain_tiny_resume.json", "pretrain_tiny_resume.step00000006.pt"]

    grid = tmp_path / "grid.png"
    sampled = run_here(eval_sample, ["--weights", os.path.join(out, "pretrain_tiny"), "--prompt",
                                     "a large red circle in the center", "--prompt", "two green stars", "--seeds", "2",
                                     "--steps", "3", "--out", str(grid)], capsys)
    assert "4 images" in sampled.stdout and "from step 6" in sampled.stdout
    image = Image.open(grid)
    assert image.width >= 4 * 64 and image.mode == "RGB"

    report = tmp_path / "loss.json"
    evaluated = run_here(eval_loss, ["--weights", os.path.join(out, "pretrain_tiny"), "--num_samples", "8", "--json",
                                     str(report)], capsys)
    assert evaluated.stdout.strip().splitlines()[-1].startswith("mean held-out loss: ")
    losses = json.load(open(report))["losses"]
    assert len(losses) == 9 and all(0 < v < 10 for v in losses.values())

    # a fresh run (no --from_resume) into the same folders starts its own metrics file
    run_here(train_pretrain, SMALL_RUN + folders("resumed") + ["--max_steps", "2"], capsys)
    assert metric_steps(os.path.join(out, "pretrain_tiny_metrics.jsonl")) == [1, 2]


def write_png(path, image):
    image.save(path)
    return path


@pytest.mark.slow
def test_folder_dataset_with_bad_files_trains_and_reports_them(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        write_png(data / f"good{i}.png", Image.new("RGB", (40, 48), (30 * i, 100, 200)))
        (data / f"good{i}.txt").write_text(f"a blue square number {i}" + " and more" * 10 * (i == 0))
    rgba = Image.new("RGBA", (32, 32), (255, 0, 0, 0))
    write_png(data / "rgba.png", rgba)
    write_png(data / "palette.png", Image.new("P", (32, 32), 3))
    write_png(data / "sixteen.png", Image.new("I;16", (32, 32), 30000))
    (data / "zero.png").write_bytes(b"")
    (data / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    out = run_here(train_pretrain, ["--data", str(data), "--batch_size", "3", "--accumulation_steps", "2",
                                    "--max_steps", "3",  # 9 images, 6 per step: every step starts a new epoch
                                    "--sample_interval", "0", "--sample_steps", "1", "--out_dir",
                                    str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt")], capsys)
    text = out.stdout + out.stderr
    assert "9 images" in text and "2 skipped" in text and "zero.png" in text and "corrupt.png" in text
    assert "warning: 1 caption(s) have more than 22 words" in text  # good0's 25, counted
    assert os.path.exists(tmp_path / "out" / "pretrain_tiny.step00000003.safetensors")


@pytest.mark.parametrize("make", ["empty", "missing"])
def test_empty_or_missing_data_is_a_one_line_error(tmp_path, make):
    path = tmp_path / "data"
    if make == "empty":
        path.mkdir()
    result = run(["trainer/train_pretrain.py", "--data", str(path), "--out_dir", str(tmp_path)], check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]
    assert "Traceback" not in result.stderr


def test_loss_falls_when_overfitting_a_fixed_batch():
    torch.manual_seed(0)
    config = SD3LightConfig(sample_size=16, patch_size=2, in_channels=12, out_channels=12, num_layers=2,
                            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=128,
                            caption_projection_dim=64, pooled_projection_dim=128, pos_embed_max_size=16)
    model, components = SD3Light(config), BuiltinComponents(GRAMMAR_WORDS)
    data = ShapesDataset("train", 8, 32)
    items = [data[i] for i in range(8)]
    batch = {"image": torch.stack([it["image"] for it in items]), "caption": [it["caption"] for it in items]}
    args = train_pretrain.parse_args(["--caption_dropout", "0", "--prediction", "x"])
    recipe = FlowRecipe(prediction=args.prediction, sigma_scheme=args.sigma_scheme, logit_mean=args.logit_mean,
                        logit_std=args.logit_std, train_shift=args.train_shift, loss=args.loss,
                        weighting=args.weighting, caption_dropout=args.caption_dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for step in range(80):
        generator = torch.Generator().manual_seed(step % 4)  # the same few noise draws again and again
        loss = flow_matching_loss(model, components, batch, generator, recipe)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-8:]) / 8 < 0.5 * sum(losses[:8]) / 8


def flat(batches):
    return [i for batch in batches for i in batch]


def test_epoch_sampler_deals_one_permutation_and_resumes_mid_epoch():
    whole = [flat(EpochSampler(20, r, 2, seed=3).rank_batches(0, 0, 2, 4)) for r in range(2)]
    assert sorted(whole[0] + whole[1]) == list(range(20))
    # 8 samples of the epoch already consumed (by any world size)
    resumed = [flat(EpochSampler(20, r, 2, seed=3).rank_batches(0, 8, 2, 4)) for r in range(2)]
    assert resumed[0] == whole[0][4:] and resumed[1] == whole[1][4:]
    one = flat(EpochSampler(20, 0, 1, seed=3).rank_batches(0, 8, 2, 2))
    assert sorted(one) == sorted(whole[0][4:] + whole[1][4:])  # 2 -> 1 process: the same rest of the epoch
    assert EpochSampler(20, 0, 2).steps_left(8, 4) == 3 and EpochSampler(20, 0, 2).steps_left(20, 4) == 0


def test_bucket_sampler_uses_every_image_and_resumes_with_another_world_size():
    bucket_of = [0] * 7 + [1] * 3 + [2] * 1  # 11 images in 3 buckets; batch 2 -> 4 + 2 + 1 = 7 micro-batches
    two = [BucketSampler(bucket_of, r, 2, batch_size=2, seed=1) for r in range(2)]
    assert two[0].steps_left(0, 4) == 4  # 7 micro-batches in steps of 2 x 2: the last step is filled from the start
    epoch = [two[r].rank_batches(0, 0, 2, 4) for r in range(2)]
    seen = flat(epoch[0]) + flat(epoch[1])
    assert set(seen) == set(range(11))
    for batch in epoch[0] + epoch[1]:
        assert len({bucket_of[i] for i in batch}) == 1  # one bucket (one image size) per micro-batch
    plan = two[0].plan.micro_batches(0)
    # after one step (4 samples) of 2 processes, 1 process continues with exactly the rest of the list
    assert epoch[0] == plan[0::2] and epoch[1] == plan[1::2] + plan[:1]  # dealt round-robin, last step filled
    one = BucketSampler(bucket_of, 0, 1, batch_size=2, seed=1)
    assert one.rank_batches(0, 4, 2, 2) == plan[2:] and one.steps_left(4, 2) == 5


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_sigma_schemes_and_losses():
    g = torch.Generator().manual_seed(0)
    for scheme in ("logit_normal", "uniform", "mode"):
        s = sample_sigmas(1000, scheme, generator=g)
        assert 0 <= s.min() and s.max() <= 1
    assert sample_sigmas(1000, shift=3.0, generator=g).mean() > sample_sigmas(1000, generator=g).mean()
    x0, noise, s = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8), torch.rand(4)
    perfect = noise - x0
    for loss_type in ("mse", "huber"):
        for weighting in ("none", "sigma_sqrt", "cosmap"):
            assert flow_loss(perfect, x0, noise, s, loss_type, weighting).item() == pytest.approx(0, abs=1e-6)


def test_a_new_loss_is_one_entry_in_the_loss_table(monkeypatch):
    from model import rectified_flow

    x0, noise, s = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8), torch.rand(4)
    pred = noise - x0 + 0.5
    monkeypatch.setitem(rectified_flow.LOSSES, "l1", torch.abs)  # the one entry
    args = train_pretrain.parse_args(["--loss", "l1"])  # the option takes it
    assert args.loss == "l1" and flow_loss(pred, x0, noise, s, args.loss).item() == pytest.approx(0.5)
    assert flow_loss(pred, x0, noise, s, "mse").item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="unknown loss 'l2': use mse, huber, l1"):
        flow_loss(pred, x0, noise, s, "l2")


def test_x_prediction_stands_for_the_true_velocity():
    # a model that outputs the clean latent exactly gives the exact velocity, down to the clamp at s = 0.05
    x0, noise = torch.randn(5, 3, 8, 8), torch.randn(5, 3, 8, 8)
    s = torch.tensor([1.0, 0.7, 0.3, 0.1, 0.05])
    v = to_velocity(x0, add_noise(x0, noise, s), s, "x")
    torch.testing.assert_close(v, noise - x0, rtol=0, atol=1e-5)
    assert flow_loss(v, x0, noise, s).item() == pytest.approx(0, abs=1e-9)
    assert to_velocity(x0, x0 + noise, s, "v") is x0  # "v": the output is already the velocity
    # below the clamp the division stays bounded: no huge velocities from a tiny s
    tiny = torch.tensor([1e-6])
    assert to_velocity(x0[:1], add_noise(x0[:1], noise[:1], tiny), tiny, "x").abs().max() < 1
    with pytest.raises(ValueError, match="unknown prediction"):
        to_velocity(x0, x0, s, "eps")


def test_euler_sampler_follows_an_exact_velocity_field():
    # for a model that predicts the true velocity towards a fixed x0, Euler lands exactly on x0
    x0 = torch.randn(2, 3, 4, 4)

    def model(x, tokens, pooled, t):
        s = (t / 1000).view(-1, 1, 1, 1)
        return (x - x0.repeat(x.shape[0] // 2, 1, 1, 1)) / s.clamp(min=1e-6)

    out = euler_sample(model, torch.randn(2, 3, 4, 4), torch.zeros(2, 5, 8), torch.zeros(2, 8),
                       Sampler(4, steps=10, cfg=3.0, shift=3.0, prediction="v"))
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-4)

    # the same for a model that outputs x0 itself (x-prediction): its last step lands on its output
    def x_model(x, tokens, pooled, t):
        return x0.repeat(x.shape[0] // 2, 1, 1, 1)

    out = euler_sample(x_model, torch.randn(2, 3, 4, 4), torch.zeros(2, 5, 8), torch.zeros(2, 8),
                       Sampler(4, steps=10, cfg=3.0, shift=3.0, prediction="x"))
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)


class NaNImages(torch.utils.data.Dataset):
    """Plain images, except that the listed indices are NaN."""

    def __init__(self, n, bad):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        value = float("nan") if i in self.bad else 0.5
        return {"image": torch.full((3, 32, 32), value), "caption": "a large red circle in the center"}

    def sample_prompts(self):
        return ["a red circle"]


def _train_tiny(tmp_path, dataset, steps, monkeypatch):
    _, messages = run_in_process(train_pretrain, [
        "--batch_size", "4", "--max_steps", str(steps), "--save_interval", "100", "--sample_interval", "0",
        "--sample_steps", "1", "--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt")],
        monkeypatch, build_dataset=lambda *args, **kwargs: dataset)
    return messages


def test_nan_steps_are_skipped_and_the_run_still_saves(tmp_path, monkeypatch):
    # one batch in four holds the NaN image
    messages = _train_tiny(tmp_path, NaNImages(16, bad=[3]), steps=8, monkeypatch=monkeypatch)
    skipped = [m for m in messages if "update skipped" in m]
    assert 1 <= len(skipped) < 8
    assert json.load(open(tmp_path / "out" / "pretrain_tiny.json"))["step"] == 8
    rows = [json.loads(line) for line in open(tmp_path / "out" / "pretrain_tiny_metrics.jsonl")]
    assert len(rows) == 8 - len(skipped) and all(r["loss"] == r["loss"] for r in rows)  # no NaN logged


def test_loss_nan_every_step_stops_with_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="not finite for 10 steps in a row"):
        _train_tiny(tmp_path, NaNImages(16, bad=range(16)), steps=20, monkeypatch=monkeypatch)


def test_a_log_step_checks_each_network_a_step_stepped_in_turn_and_logs_before_it_ends_the_run():
    """StepRows and write_steps (every stage's log step): the steps' values and their (loss, gradient norm) checks
    read at once; a step with any check not finite gets a warning for each such check, in the order the networks
    stepped, and no row; the guard counts the checks not finite in a row, across networks and steps, and at its
    limit ends the run with the warnings before it logged."""
    import math
    import time
    from types import SimpleNamespace

    from trainer.mechanics.metrics import StepRows
    from trainer.trainer_utils import NonFiniteSteps, write_steps

    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    stepped = [[(one, torch.tensor(2.0))], [(one, nan), (one, torch.tensor(3.0)), (nan, nan)], [(nan, nan), (nan, one)]]
    def added():  # the three steps, as a loop adds them
        rows = StepRows()
        for step, checks in enumerate(stepped, 1):
            rows.add(SimpleNamespace(step=step, epoch=0, samples_seen=2 * step), {"loss": checks[0][0], "lr": 0.1},
                     checks, 1.0, time.perf_counter())
        return rows

    read = added().read()
    assert [r.values["lr"] for r in read] == [0.1] * 3 and read[0].values["loss"] == 1.0
    assert read[0].checks == [(1.0, 2.0)] and read[1].checks[1] == (1.0, 3.0) and math.isnan(read[1].checks[2][0])
    lines, written = [], []
    metrics = SimpleNamespace(log=lines.append, write=lambda at, values, rate, skipped, ids: written.append(
        (at.step, skipped)))
    out = SimpleNamespace(metrics=metrics, throughput=SimpleNamespace(rates=lambda f, s: {}))
    with pytest.raises(UserError, match="not finite for 3 steps in a row"):
        write_steps(added(), NonFiniteSteps("ckpt", limit=3), out, None, 2)
    assert written == [(1, False), (2, True)]  # the third step ended the run before its row
    assert lines == ["warning: gradient norm is nan at step 2; update skipped (1 in a row)",
                     "warning: loss is nan at step 2; update skipped (1 in a row)",  # (the finite one between)
                     "warning: loss is nan at step 3; update skipped (2 in a row)"]


def test_muon_skips_its_step_where_the_loop_flags_it_not_finite():
    """--optimizer muon's Muon (SkippingMuon): where the loop's flag (found_inf) is 1, nothing moves, its momentum
    neither; where it is 0, its step is torch's Muon's, bit for bit."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    skipping, plain = SkippingMuon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    for flag in (0.0, 1.0, 1.0, 0.0):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(8, 4) if flag == 0 else torch.full((8, 4), float("nan"))
            b.grad = a.grad.clone()
        skipping.found_inf = torch.tensor(flag)
        skipping.step()
        if flag == 0:
            plain.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert all(torch.equal(skipping.state[a]["momentum_buffer"], plain.state[b]["momentum_buffer"])
               for a, b in zip(ours, theirs))


def test_ema_decay_warms_up_then_holds():
    """Early updates follow the weights closely ((1 + step) / (10 + step)); later ones use the set decay."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ema = EMA(model, decay=0.99)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(step=1)  # decay 2/11: the shadow moves 9/11 of the way
    assert torch.allclose(ema.shadow["weight"], torch.full((1, 2), 9 / 11))
    ema.update(step=10_000)  # decay capped at 0.99
    assert torch.allclose(ema.shadow["weight"], torch.full((1, 2), 9 / 11 + (2 / 11) * 0.01))


def test_built_in_components_train_the_same_from_the_cache(tmp_path, monkeypatch):
    """The built-in data and components go through the same cache code as SD3's (--cache 1): same losses."""
    losses = {}
    for cache in ("0", "1"):
        run_dir = tmp_path / cache
        run_in_process(train_pretrain, [
            "--num_samples", "16", "--batch_size", "4", "--max_steps", "4", "--sample_interval", "0",
            "--sample_steps", "1", "--cache", cache, "--out_dir", str(run_dir / "out"), "--save_dir",
            str(run_dir / "ckpt"), "--cache_dir", str(run_dir / "c")], monkeypatch)
        losses[cache] = [row["loss"] for row in map(json.loads, open(run_dir / "out" / "pretrain_tiny_metrics.jsonl"))]
    assert len(list((tmp_path / "1" / "c").glob("*/index.json"))) == 1 and not (tmp_path / "0" / "c").exists()
    assert len(losses["1"]) == 4 and losses["1"] == pytest.approx(losses["0"], rel=1e-5)


@pytest.mark.parametrize("module", ["train_pretrain", "train_full_sft", "train_lora"])
def test_a_bad_number_is_one_line_naming_the_argument(module, capsys):
    """Every numeric hyperparameter is checked where it is declared: no ZeroDivisionError or optimizer traceback
    later, and nothing to train (--epochs 0) is an error, not an export of untrained weights."""
    parse_args = __import__(f"trainer.{module}", fromlist=["parse_args"]).parse_args
    cases = [("--batch_size", "0"), ("--accumulation_steps", "0"), ("--learning_rate", "-1"), ("--epochs", "0"),
             ("--warmup_steps", "-3"), ("--caption_dropout", "1.5"), ("--ema_decay", "1"), ("--grad_clip", "nan"),
             ("--resolution", "0"), ("--save_interval", "0"), ("--buckets", "4"), ("--learning_rate", "fast")]
    for flag, value in cases:
        with pytest.raises(SystemExit) as exit_code:
            parse_args([flag, value])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_code.value.code == 2 and len(lines) == 1, (flag, lines)
        assert lines[0].startswith(f"error: argument {flag}: ") and value in lines[0], lines[0]


def test_a_bad_number_ends_the_script_with_one_line(tmp_path):
    result = run(["trainer/train_pretrain.py", "--batch_size", "0", "--out_dir", str(tmp_path)], check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["error: argument --batch_size: must be a whole number >= 1, got 0 "
                                                  "(see --help)"]
    assert not os.path.exists(tmp_path / "pretrain_tiny.json")


def test_an_error_or_a_warning_while_the_bar_is_drawn_reads_on_a_line_of_its_own(tmp_path, capsys):
    """The progress bar (tqdm, on stderr, redrawn in place with carriage returns) is ended before a UserError's
    line, which a full disk's save raises mid-run, and is not drawn again after it; a warning while it is drawn
    goes above it, on a line of its own."""
    import types
    import warnings

    from model.errors import run_main
    from trainer.mechanics.distributed import DistInfo
    from trainer.mechanics.metrics import MetricsLog

    def main():
        metrics = MetricsLog(DistInfo(), "pretrain", "run", str(tmp_path))
        metrics.open(0, 4, False)
        for step in (1, 2, 3):
            if step == 3:
                warnings.warn("a warning while the bar is drawn")
            at = types.SimpleNamespace(step=step, epoch=0, samples_seen=4 * step)
            metrics.write(at, {"loss": 0.5, "lr": 1e-3}, 20.0)
        raise UserError(f"cannot save into {tmp_path}: not enough free space")

    capsys.readouterr()
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_code:
        warnings.simplefilter("always")
        run_main(main)
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").split("\n")
    assert exit_code.value.code == 2
    assert f"error: cannot save into {tmp_path}: not enough free space" in lines, err  # a line of its own
    assert any(line.endswith("UserWarning: a warning while the bar is drawn") for line in lines), err
    error_at = err.index("error: cannot save")
    assert err[error_at - 1] == "\n" and "pretrain" not in err[error_at:], err  # the bar ended above it, not redrawn


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_ones_and_resume_and_export_alike(tmp_path, monkeypatch):
    """--compile 1 (inductor's CPU code for each block) computes what eager does: the same losses to tolerance, the
    same saved weights to tolerance, and its resume checkpoint and export load as eager ones do."""
    def train(name, *extra):
        out, ckpt = tmp_path / name / "out", tmp_path / name / "ckpt"
        argv = [*SMALL_RUN, "--max_steps", "3", "--out_dir", str(out), "--save_dir", str(ckpt), *extra]
        run_in_process(train_pretrain, argv, monkeypatch)
        with open(out / "pretrain_tiny_metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        resume = torch.load(ckpt / "pretrain_tiny_resume.step00000003.pt", weights_only=True)
        return rows, resume

    eager, eager_state = train("eager")
    compiled, compiled_state = train("compiled", "--compile", "1")
    assert [r["step"] for r in compiled] == [1, 2, 3]
    for e, c in zip(eager, compiled):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-4, abs=1e-5)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-3)
    assert compiled_state["model"].keys() == eager_state["model"].keys()  # no "_orig_mod" names in the state
    for name, tensor in eager_state["model"].items():
        torch.testing.assert_close(compiled_state["model"][name], tensor, rtol=1e-3, atol=1e-5)
    # the compiled run's resume goes on (eager or compiled alike), and its export loads strictly
    resumed = [*SMALL_RUN, "--max_steps", "4", "--out_dir", str(tmp_path / "compiled" / "out"), "--save_dir",
               str(tmp_path / "compiled" / "ckpt"), "--from_resume", "1"]
    assert run_in_process(train_pretrain, resumed, monkeypatch)[0] == 4
    model, _, record = load_weights(str(tmp_path / "compiled" / "out" / "pretrain_tiny.json"))
    assert record["step"] == 4 and isinstance(model, SD3Light)


def timed_as(monkeypatch, bf16_seconds):
    """The CPU bf16 check, told that an MLP step takes 1 s in fp32 and `bf16_seconds` in bf16."""
    monkeypatch.setattr(precision, "mlp_step", lambda x, up, down, bf16: bf16_seconds if bf16 else 1.0)
    precision.cpu_bf16_speedup.cache_clear()


def test_cpu_bf16_check_falls_back_to_fp32_where_bf16_is_slower(monkeypatch):
    cpu = torch.device("cpu")
    try:
        timed_as(monkeypatch, 1.5)  # emulated bf16: slower
        assert precision.resolve_dtype("fast", cpu)[0] == "fp32" and autocast_dtype("fast", cpu) is None
        timed_as(monkeypatch, 0.95)  # not clearly faster: fp32 still
        assert precision.resolve_dtype("fast", cpu)[0] == "fp32"
        timed_as(monkeypatch, 0.5)  # native bf16
        assert precision.resolve_dtype("fast", cpu) == ("bf16", "fast: bf16 ran at 2.00x fp32's speed here")
        assert autocast_dtype("fast", cpu) is torch.bfloat16
        assert precision.resolve_dtype("fast", cpu, several_processes=True)[0] == "fp32"  # torchrun on a CPU
        assert precision.resolve_dtype("fast", cpu, cpu_bf16=False)[0] == "fp32"  # DPO, distillation
        assert precision.resolve_dtype("auto", cpu) == ("fp32", "auto on a CPU")  # the default: no check decides
        assert precision.resolve_dtype("fp32", cpu)[0] == "fp32"  # asked for: no check decides
        assert precision.resolve_dtype("bf16", cpu)[0] == "bf16"
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # native bf16
        assert all(precision.resolve_dtype(d, torch.device("cuda"))[0] == "bf16" for d in ("auto", "fast"))
    finally:
        precision.cpu_bf16_speedup.cache_clear()
    assert precision.cpu_bf16_speedup() > 0  # the real check runs (what it finds depends on this CPU)


@pytest.mark.slow
def test_a_resumed_fast_run_keeps_the_precision_it_began_with(tmp_path, monkeypatch):
    """--dtype fast is decided by timing at start-up; a resume goes on in what the run began with even if today's
    check says otherwise, so the trajectory is the uninterrupted one's."""
    def train(name, steps, resume="0"):
        argv = [*SMALL_RUN, "--dtype", "fast", "--max_steps", "4", "--out_dir", str(tmp_path / name / "out"),
                "--save_dir", str(tmp_path / name / "ckpt"), "--from_resume", resume]
        if steps < 4:  # stopped after `steps`, as a stop signal would
            monkeypatch.setattr(train_pretrain.Position, "finished", property(lambda run: run.step >= steps))
        narrow_tiny(monkeypatch)  # its steps compute in bf16
        result = run_in_process(train_pretrain, argv, monkeypatch)
        monkeypatch.undo()
        with open(tmp_path / name / "out" / "pretrain_tiny_metrics.jsonl") as f:
            return result, [json.loads(line)["loss"] for line in f]

    try:
        timed_as(monkeypatch, 0.5)
        (_, messages), whole = train("whole", 4)
        assert "computing in bf16 (fast: bf16 ran at 2.00x fp32's speed here)" in messages
        timed_as(monkeypatch, 0.5)
        train("cut", 2)
        timed_as(monkeypatch, 1.5)  # today bf16 would lose: the resume still computes in bf16
        (step, messages), cut = train("cut", 4, resume="1")
        assert step == 4 and "computing in bf16, as the run it resumes did" in messages
        assert cut == whole
        timed_as(monkeypatch, 1.5)
        (_, messages), fp32 = train("fp32", 4)
        assert "computing in fp32" in messages[0] and fp32[1:] != whole[1:]  # the choice changes the numbers
    finally:
        precision.cpu_bf16_speedup.cache_clear()
