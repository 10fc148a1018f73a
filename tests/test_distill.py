"""The distillation stage (DMD2): the generator's gradient is DMD2's, each network trains only on its own terms,
the teacher never changes, the run resumes bitwise, shards like DDP, and its export samples in its own few steps,
in diffusers too."""
import hashlib
import json

import numpy as np
import pytest
import torch
from torch import nn

from eval.plot_metrics import TIMING
import trainer.train_distill as train_distill
from eval.sampling import load_for_sampling, sample_images
from model.checkpoint import checkpoint_file, first_difference, load_safetensors, load_torch, read_manifest
from model.diffusers_io import scheduler_settings
from model.rectified_flow import Sampler, sampling_sigmas
from trainer import distillation
from trainer.distillation import DistillRecipe, Networks, dmd_loss, generator_sigmas

import eval.eval_sample as eval_sample
import trainer.train_lora as train_lora
from tests.scripts import run, run_here, run_many, run_script_here
from tests.conftest import run_stage
from tests.conftest import GRID, dirs

FAST = ["--warmup_steps", "2", "--gen_steps", "2", "--gen_update_ratio", "2", "--batch_size", "2",
        "--num_samples", "16", "--sample_interval", "0", *GRID]


@pytest.fixture(scope="module")
def teacher(pretrained):
    return pretrained


def argv(run_dir, teacher_path, *extra):
    return ["--from_weight", teacher_path, *FAST, "--out_dir", str(run_dir / "out"), "--save_dir",
            str(run_dir / "ckpt"), *extra]


def digest(module):
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    return h.hexdigest()


class Answers(nn.Module):
    """A stand-in score that predicts x0 (prediction "x"): `cond` for conditioned rows, `uncond` for rows whose text
    is zero."""

    def __init__(self, cond, uncond=None):
        super().__init__()
        self.cond, self.uncond = cond, uncond if uncond is not None else cond

    def forward(self, x, tokens, pooled, t):
        unconditional = (pooled.abs().sum(1) == 0).view(-1, 1, 1, 1)
        n = len(x) // len(self.cond)
        return torch.where(unconditional, self.uncond.repeat(n, 1, 1, 1), self.cond.repeat(n, 1, 1, 1))


def distill_recipe(guidance, interval):
    """The losses' recipe of an x-predicting teacher in fp32, guided by `guidance` at sigmas in `interval`."""
    return DistillRecipe(prediction="x", autocast=None, gen_steps=4, gen_shift=3.0, score_shift=3.0,
                         real_guidance=guidance, guidance_interval=interval, min_sigma=0.02, max_sigma=0.98,
                         gan_weight=0.0, gan_d_weight=1e-2)


def test_the_generator_gradient_is_dmd2s_normalised_direction():
    g = torch.Generator().manual_seed(0)
    x0_gen = torch.randn(2, 3, 4, 4, generator=g).requires_grad_(True)
    real_cond, real_uncond, fake = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    guidance = 3.0
    nets = Networks(teacher=Answers(real_cond, real_uncond), generator=None, generator_train=None,
                    fake=Answers(fake), fake_train=None)
    args = distill_recipe(guidance, (0.0, 1.0))
    s = torch.tensor([0.3, 0.7])
    loss = dmd_loss(nets, x0_gen, torch.ones(2, 5, 8), torch.ones(2, 8), s, torch.randn(2, 3, 4, 4), args)
    loss.backward()
    # by hand: the guided teacher's x0, then (p_real - p_fake) / mean|p_real| per sample, over the element count
    x = x0_gen.detach()
    x0_real = real_uncond + guidance * (real_cond - real_uncond)
    p_real, p_fake = x - x0_real, x - fake
    expected = (p_real - p_fake) / p_real.abs().mean(dim=(1, 2, 3), keepdim=True) / x.numel()
    assert torch.allclose(x0_gen.grad, expected, atol=1e-7)
    # it points from the teacher's estimate to the fake score's: descending moves towards the teacher
    direction = (fake - x0_real).flatten(1)
    assert (torch.nn.functional.cosine_similarity(x0_gen.grad.flatten(1), direction) > 0.999).all()


def test_the_teachers_guidance_applies_only_inside_its_interval():
    g = torch.Generator().manual_seed(1)
    x_t, cond, uncond = (torch.randn(4, 3, 4, 4, generator=g) for _ in range(3))
    teacher, s = Answers(cond, uncond), torch.tensor([0.1, 0.5, 0.6, 0.9])
    tokens, pooled = torch.ones(4, 5, 8), torch.ones(4, 8)
    guided_everywhere = uncond + 3.0 * (cond - uncond)
    inside = distillation.guided_x0(teacher, x_t, tokens, pooled, s, distill_recipe(3.0, (0.2, 0.7)))
    assert torch.allclose(inside[[0, 3]], cond[[0, 3]], atol=1e-6)  # outside (0.2, 0.7]: the plain conditional estimate
    assert torch.allclose(inside[1:3], guided_everywhere[1:3], atol=1e-6)
    assert torch.allclose(distillation.guided_x0(teacher, x_t, tokens, pooled, s, distill_recipe(3.0, (0.0, 1.0))),
                          guided_everywhere, atol=1e-6)
    nowhere = distillation.guided_x0(teacher, x_t, tokens, pooled, s, distill_recipe(3.0, (0.9, 1.0)))
    assert torch.allclose(nowhere, cond, atol=1e-6)


def test_diffusers_schedules_the_generators_steps_when_its_scheduler_is_set():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for steps in (1, 2, 3, 4, 8):
        for shift in (1.0, 3.0, 6.0):
            scheduler = FlowMatchEulerDiscreteScheduler(**scheduler_settings(
                {"steps": steps, "shift": shift, "renoise": True}))
            scheduler.set_timesteps(steps)
            assert torch.allclose(scheduler.sigmas, sampling_sigmas(steps, shift), atol=1e-6), (steps, shift)
    assert generator_sigmas(4, 3.0).tolist() == pytest.approx([1.0, 0.9, 0.75, 0.5])


def test_each_network_trains_on_its_own_terms_and_the_teacher_never_changes(tmp_path, teacher, monkeypatch):
    seen = []  # per step: whether the generator updates, the three networks' digests, fake-score inputs
    losses = distillation.distillation_losses

    def watched(nets, components, batch, rng, k, update, args):
        if not seen:
            nets.fake.register_forward_pre_hook(lambda m, inputs: fake_inputs.append(inputs[0].requires_grad))
        seen.append((update, digest(nets.teacher), digest(nets.generator), digest(nets.fake)))
        return losses(nets, components, batch, rng, k, update, args)

    fake_inputs = []
    monkeypatch.setattr(train_distill, "distillation_losses", watched)
    run_stage(train_distill, argv(tmp_path, teacher, "--max_steps", "6"), monkeypatch)
    teacher_weights, *_ = load_for_sampling(teacher, str(tmp_path), "cpu")
    assert len(seen) == 6 and [u for u, *_ in seen] == [False, True] * 3
    assert {t for _, t, _, _ in seen} == {digest(teacher_weights)}  # the teacher: never
    for (update, _, gen, fake), (_, _, gen_next, fake_next) in zip(seen, seen[1:]):
        assert (gen != gen_next) == update  # the generator: on its update steps only
        assert fake != fake_next  # the fake score: every step
    assert fake_inputs and not any(fake_inputs)  # it only ever reads detached samples


def test_a_stopped_run_resumes_bitwise_exactly_with_the_gan_on(tmp_path, teacher, monkeypatch):
    extra = ["--accumulation_steps", "2", "--max_steps", "7", "--save_interval", "3", "--gan_weight", "0.1"]
    run_stage(train_distill, argv(tmp_path / "whole", teacher, *extra), monkeypatch)
    # the signal comes while step 4's first micro-batch is fetched (4 samples a step): the step completes first
    run_stage(train_distill, argv(tmp_path / "cut", teacher, *extra), monkeypatch, signal_at=3 * 4 + 1)
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / "distill_tiny_resume"), "resume")["step"] == 4
    run_stage(train_distill, argv(tmp_path / "cut", teacher, *extra, "--from_resume", "1"), monkeypatch)

    def state(run_dir):
        stem, resume_stem = str(run_dir / "out" / "distill_tiny"), str(run_dir / "ckpt" / "distill_tiny_resume")
        resume = load_torch(checkpoint_file(resume_stem, read_manifest(resume_stem, "resume"), ".pt"))
        resume["export"] = load_safetensors(checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))
        with open(run_dir / "out" / "distill_tiny_metrics.jsonl") as f:
            resume["rows"] = [json.loads(line) for line in f]
        for row in resume["rows"]:
            for name in TIMING:
                del row[name]
        return resume

    whole, cut = state(tmp_path / "whole"), state(tmp_path / "cut")
    assert whole["step"] == 7 and "gan_d" in whole["rows"][0] and "gan_g" in whole["rows"][1]
    for key in ("generator", "fake_score", "gan_head", "ema", "generator_optimizer", "fake_score_optimizer",
                "gan_head_optimizer", "rng", "export", "samples_seen", "rows"):
        assert first_difference(whole[key], cut[key], key) is None, key


def test_the_export_samples_in_the_generators_steps_without_being_told(tmp_path, teacher, monkeypatch, capsys):
    run_stage(train_distill, argv(tmp_path, teacher, "--max_steps", "2"), monkeypatch)
    record = json.loads((tmp_path / "out" / "distill_tiny.json").read_text())
    assert record["sampling"] == {"steps": 2, "cfg": 1.0, "shift": 3.0, "renoise": True}
    assert record["generator_sigmas"] == [1.0, 0.75] and record["teacher"]["step"] == 2
    out = tmp_path / "grid.png"
    result = run_here(eval_sample, ["--weights", str(tmp_path / "out" / "distill_tiny.json"), "--prompt",
                                    "a red circle", "--out", str(out)], capsys)
    assert "(2 steps, cfg 1.0, shift 3.0" in result.stdout and out.is_file()


@pytest.mark.parametrize("bad, message", [
    (["--preset", "small"], "holds 'tiny' weights, not --preset small"),
    (["--gen_steps", "0"], "argument --gen_steps: must be a whole number >= 1, got 0"),
    (["--guidance_interval", "0.6", "0.4"], "--guidance_interval 0.6 0.4 is empty: LOW must be below HIGH"),
])
def test_bad_settings_are_one_line_errors(tmp_path, teacher, bad, message, capsys):
    """Run here as the script's __main__ runs it (a LoRA file as the teacher, below, in a process of its own)."""
    result = run_script_here(train_distill, argv(tmp_path, teacher, *bad), capsys)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_lora_file_as_teacher_is_a_one_line_error(tmp_path, teacher, capsys):
    run_here(train_lora, ["--from_weight", teacher, "--num_samples", "4", "--prior_data", "none", "--batch_size", "2",
                          "--max_steps", "1", "--sample_steps", "1", "--out_dir", str(tmp_path / "out"), "--save_dir",
                          str(tmp_path / "ckpt")], capsys)
    lora = str(tmp_path / "out" / "lora" / "lora_demo_tiny.safetensors")
    result = run(["trainer/train_distill.py", *argv(tmp_path, lora)], check=False)
    assert result.returncode != 0 and "is a LoRA" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_two_processes_shard_like_ddp(tmp_path, pretrained_small):
    """On the 2-block sd3-tiny preset: sharding the three networks works alike at any size."""
    modes, teacher = ("ddp", "fsdp"), pretrained_small
    run_many("trainer.train_distill", [argv(tmp_path / mode, teacher, "--preset", "sd3-tiny", "--max_steps", "4",
                                            "--save_dtype", "fp32", "--fsdp", str(int(mode == "fsdp")))
                                       for mode in modes])
    exports = {}
    for mode in modes:
        stem = str(tmp_path / mode / "out" / "distill_sd3-tiny")
        exports[mode] = load_safetensors(checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))
    for key, value in exports["ddp"].items():
        assert torch.allclose(value, exports["fsdp"][key], atol=1e-5), key
    assert any(not torch.equal(v, w) for v, w in zip(exports["ddp"].values(), load_safetensors(
        checkpoint_file(teacher[:-5], read_manifest(teacher[:-5], "weights"), ".safetensors")).values()))


@pytest.mark.slow
def test_a_distilled_sd3_transformer_samples_in_diffusers_with_the_recorded_steps(tmp_path, sd3, capsys):
    from diffusers import StableDiffusion3Pipeline

    run_here(train_distill, ["--base", sd3, "--from_weight", "base", "--preset", "sd3-tiny", "--data", "builtin",
                             *FAST, "--max_steps", "2", "--export_pipeline", *dirs(tmp_path)], capsys)
    out = tmp_path / "out"
    record = json.loads((out / "distill_sd3-tiny.json").read_text())
    assert record["sampling"]["steps"] == 2 and record["sampling"]["renoise"] and record["prediction"] == "v"
    model, components, _, _ = load_for_sampling(str(out / "distill_sd3-tiny.json"), str(out), "cpu")
    prompt = "a large red circle in the center"
    ours = sample_images(model, components, [prompt], 5, Sampler(32, 2, 1.0, record["sampling"]["shift"], "v",
                                                                  renoise=True), torch.device("cpu"))[0]
    # the exported pipeline, asked for the recorded number of steps and no guidance, draws the same
    # (the SD3 pipeline draws the scheduler's fresh noise from torch's global stream; given the pipeline's generator,
    # as our sampler continues each prompt's own stream, it draws the same noise)
    pipeline = StableDiffusion3Pipeline.from_pretrained(str(out / "distill_sd3-tiny"))
    generator, step = torch.Generator().manual_seed(5), pipeline.scheduler.step
    pipeline.scheduler.step = lambda *a, **kw: step(*a, **kw, generator=generator)
    image = pipeline(prompt, height=32, width=32, num_inference_steps=record["sampling"]["steps"], guidance_scale=1.0,
                     generator=generator, max_sequence_length=77, output_type="pt").images[0]
    theirs = image * 2 - 1
    assert ours.abs().mean() > 0.01 and (ours - theirs).abs().max() < 1e-4
    assert np.isclose(pipeline.scheduler.sigmas[:-1].numpy(), record["generator_sigmas"], atol=1e-5).all()
