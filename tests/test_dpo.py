"""The preference stage (Flow-DPO): the loss is the formula, a pair of one image twice teaches nothing, the
reference never changes, LoRA trains only its adapters, the pairs it draws never hold a held-out prompt, a
manifest's bad lines are counted and passed over, the run resumes bitwise, shards like DDP on two processes, and
runs on SD3 components."""
import hashlib
import json
import math
import os
import signal

import numpy as np
import pytest
import torch

from eval.plot_metrics import TIMING
import trainer.train_dpo as train_dpo
from dataset.training_data import DataSettings
from dataset.shapes import GRAMMAR_WORDS, HELD_OUT_PAIRS, ShapesDataset
from eval.eval_geneval import TASKS, all_prompts, clauses_held, ground_truth_image, prompt_set, training_prompts
from eval.shape_scorer import find_objects
from model.checkpoint import checkpoint_file, first_difference, load_safetensors, load_torch, read_manifest
from model.components import BuiltinComponents
from model.model_lora import ADAPTER_KINDS, read_lora_file
from trainer import preference
from trainer.preference import (
    DPO_VALUES, DPORecipe, dpo_loss_of, flow_dpo_loss, frozen_copy_reference, pair_indices, pair_inputs,
)

from tests.dpo_stand_in import brightness_scores
from tests.scripts import run, run_here, run_in_process, run_many, run_script_here
from tests.conftest import GRID, dirs, shape_pairs

FAST = ["--batch_size", "2", "--pair_prompts", "6", "--pair_images", "3", "--pair_refresh", "2",
        "--pair_sample_steps", "2", "--warmup_steps", "2", "--sample_steps", "1", *GRID]


@pytest.fixture(scope="module")
def start(pretrained):
    return pretrained


def argv(run_dir, start_path, *extra):
    return ["--from_weight", start_path, *FAST, "--out_dir", str(run_dir / "out"), "--save_dir",
            str(run_dir / "ckpt"), "--cache_dir", str(run_dir / "cache"), *extra]


class Scale(torch.nn.Module):
    """A stand-in velocity model: v = w * x_t (prediction "v")."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(float(w)))

    def forward(self, x, tokens, pooled, t):
        return self.w * x


def recipe(**kw):
    return DPORecipe(**{"dpo_beta": 50.0, "sigma_scheme": "uniform", "logit_mean": 0.0, "logit_std": 1.0,
                        "train_shift": 1.0, "prediction": "v", "autocast": None, **kw})


def cached_pairs(chosen, rejected):
    return {"chosen_latents": chosen, "rejected_latents": rejected, "text_tokens": torch.ones(len(chosen), 3, 128),
            "text_pooled": torch.ones(len(chosen), 128)}


def test_the_loss_is_the_flow_dpo_formula():
    g = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(2, 12, 4, 4, generator=g), torch.randn(2, 12, 4, 4, generator=g)
    components = BuiltinComponents(GRAMMAR_WORDS)
    policy, reference = Scale(0.3), Scale(-0.2)
    out = flow_dpo_loss(policy, frozen_copy_reference(reference), components, cached_pairs(chosen, rejected),
                        torch.Generator().manual_seed(7), recipe())
    # by hand: the same draws (shared noise, then shared uniform sigmas), x_t, v = noise - x0, the four losses
    draws = torch.Generator().manual_seed(7)
    noise, s = torch.randn(chosen.shape, generator=draws), torch.rand(2, generator=draws).view(-1, 1, 1, 1)

    def loss(w, x0):
        return ((w * ((1 - s) * x0 + s * noise) - (noise - x0)) ** 2).flatten(1).mean(1)

    inside = -0.5 * 50.0 * ((loss(0.3, chosen) - loss(-0.2, chosen)) - (loss(0.3, rejected) - loss(-0.2, rejected)))
    expected = -torch.log(torch.sigmoid(inside)).mean()
    assert torch.allclose(out["dpo"], expected, atol=1e-6, rtol=1e-5)
    assert out["reward_accuracy"].item() == pytest.approx((inside > 0).float().mean().item())
    assert out["reward_margin"].item() == pytest.approx(inside.mean().item(), rel=1e-5)
    out["dpo"].backward()
    assert policy.w.grad is not None and reference.w.grad is None


def test_the_loss_is_its_host_draws_then_device_work_that_draws_nothing():
    """What --cuda_graph captures is dpo_loss_of: given pair_inputs' draws it reads no random state (a replay
    would repeat a draw made at capture), so it gives the same on the same inputs; the draws are those the
    formula's test makes by hand (the noise, then the sigmas), shared by the two sides and held once."""
    g = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(2, 12, 4, 4, generator=g), torch.randn(2, 12, 4, 4, generator=g)
    components, policy, reference = BuiltinComponents(GRAMMAR_WORDS), Scale(0.3), frozen_copy_reference(Scale(-0.2))
    draws = torch.Generator().manual_seed(7)
    inputs = pair_inputs(policy, components, cached_pairs(chosen, rejected), draws, recipe())
    by_hand = torch.Generator().manual_seed(7)
    assert torch.equal(inputs["latents"], torch.cat([chosen, rejected]))
    assert torch.equal(inputs["noise"], torch.randn(chosen.shape, generator=by_hand))
    assert torch.equal(inputs["sigmas"], torch.rand(2, generator=by_hand)) and inputs["tokens"].shape[0] == 2
    after_draws, host = draws.get_state(), torch.get_rng_state()
    out = dpo_loss_of(policy, reference, inputs, recipe())
    assert torch.equal(draws.get_state(), after_draws) and torch.equal(torch.get_rng_state(), host)
    again = dpo_loss_of(policy, reference, inputs, recipe())
    assert list(out) == list(DPO_VALUES) and all(torch.equal(out[name], again[name]) for name in DPO_VALUES)


def test_a_pair_of_one_image_twice_gives_log_2_and_no_gradient(start):
    from eval.sampling import load_for_sampling

    policy, components, _, _ = load_for_sampling(start, os.path.dirname(start), "cpu")
    reference, _, _, _ = load_for_sampling(start, os.path.dirname(start), "cpu")
    # a policy that has moved away from the reference, by its own seeded noise (loading draws no random numbers
    # any more, so torch's stream is no longer where it was; some draws, e.g. seed 0, saturate the loss of both
    # flipped pairs, and their gradient vanishes too)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=noise))
    images = torch.stack([ShapesDataset(num_samples=2)[k]["image"] for k in range(2)])
    args = recipe(dpo_beta=1000.0, prediction="x", sigma_scheme="logit_normal")

    def gradient(chosen, rejected):  # -> the loss, the largest gradient entry
        policy.zero_grad()
        out = flow_dpo_loss(policy.train(), frozen_copy_reference(reference), components,
                            {"caption": ["a red star", "two blue squares"], "chosen": chosen, "rejected": rejected},
                            torch.Generator().manual_seed(0), args)
        out["dpo"].backward()
        return out, max(p.grad.abs().max().item() for p in policy.parameters() if p.grad is not None)

    same, none = gradient(images, images.clone())
    assert same["dpo"].item() == pytest.approx(math.log(2), abs=1e-6) and same["reward_accuracy"].item() == 0.5
    _, some = gradient(images, images.flip(0))
    assert none < 1e-5 * some  # zero but for float rounding: the two sides' gradients cancel


def test_the_clause_score_grades_images_and_is_full_for_the_truth():
    import random

    rng = random.Random(0)
    for task in TASKS:
        for spec in prompt_set(task, "train", 6):
            truth = ground_truth_image(spec, 32, rng)
            held, total = clauses_held(spec, find_objects(truth))
            assert held == total >= 4, (task, spec["caption"])
            blank = np.full_like(truth, 96)  # the background alone: no clause holds
            assert clauses_held(spec, find_objects(blank))[0] == 0


def test_a_prompts_images_pair_best_with_worst_or_every_two_that_differ():
    scores = np.array([0.4, 0.8, 0.4, 0.2])
    assert pair_indices(scores, "best_worst") == [(1, 3)]
    assert sorted(pair_indices(scores, "all")) == [(0, 3), (1, 0), (1, 2), (1, 3), (2, 3)]  # the 0.4s tie: no pair
    assert pair_indices(np.full(4, 0.5), "all") == pair_indices(np.full(4, 0.5), "best_worst") == []


def test_the_drawn_prompts_never_hold_a_held_out_pair_or_a_scored_prompt():
    scored = {spec["caption"] for spec in all_prompts(24)}
    held_out = [f"{color} {shape}" for color, shape in HELD_OUT_PAIRS]
    for seed in range(20):
        specs = training_prompts(60, seed, avoid=scored)
        assert len(specs) == 60 and {s["task"] for s in specs} == set(TASKS)
        for spec in specs:
            assert not set(spec["objects"]) & HELD_OUT_PAIRS and spec["caption"] not in scored
            assert not any(words in spec["caption"] for words in held_out)
    assert training_prompts(12, 3) == training_prompts(12, 3) != training_prompts(12, 4)


class Watch:
    """Wraps the stage's loss: records per call the reference's answer to a probe and digests of the policy's
    weights (adapters, the rest), and sends SIGTERM to this process at the `stop_at`-th call (as a scheduler would
    in the middle of a step); and its draws: the captions of each micro-batch trained on."""

    def __init__(self, stop_at=None):
        self.stop_at, self.calls, self.captions = stop_at, [], []

    def __call__(self, policy, reference, inputs, recipe):
        module = getattr(policy, "module", policy)
        with reference() as reference_model, torch.no_grad():
            answer = reference_model(*probe(reference_model.config))  # what the reference computes
            self.calls.append({"reference": answer.numpy().tobytes(), "base": digest_of(module, adapters=False),
                               "adapters": digest_of(module, adapters=True)})
        if len(self.calls) == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return dpo_loss_of(policy, reference, inputs, recipe)

    def draws(self, policy, components, batch, generator, recipe):
        self.captions.append(list(batch["caption"]))
        return pair_inputs(policy, components, batch, generator, recipe)


def probe(config):
    """A fixed input of the model: noisy latents, text tokens, pooled text, timesteps."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, config.in_channels, 16, 16, generator=g), torch.randn(1, 4, config.joint_attention_dim,
            generator=g), torch.randn(1, config.pooled_projection_dim, generator=g), torch.tensor([500.0]))


ADAPTER_PARTS = ("lora_", "lokr_", "dora_scale")  # in the names of LoRA's, LoKr's and DoRA's tensors


def digest_of(module, adapters):
    """A digest of the module's adapter weights, or of all the others."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if any(part in name for part in ADAPTER_PARTS) == adapters:
            h.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def run_watched(run_dir, start_path, monkeypatch, *extra, stop_at=None):
    """Run the stage here with its loss watched, the pairs scored by the stand-in verifier (brightness)."""
    watch = Watch(stop_at)
    monkeypatch.setattr(train_dpo, "dpo_loss_of", watch)
    monkeypatch.setattr(preference, "pair_inputs", watch.draws)  # (step_pairs' calls)
    monkeypatch.setattr(preference, "score_images", brightness_scores)
    _, messages = run_in_process(train_dpo, argv(run_dir, start_path, *extra), monkeypatch)
    return watch, messages


def test_the_reference_never_changes_and_the_policy_does(tmp_path, start, monkeypatch):
    watch, messages = run_watched(tmp_path, start, monkeypatch, "--max_steps", "4", "--dtype", "fast")
    assert len(watch.calls) == 4 and len({c["reference"] for c in watch.calls}) == 1
    assert len({c["base"] for c in watch.calls}) == 4  # all weights train
    assert sum("pairs, round" in m for m in messages) == 2  # steps 1 and 3
    # bf16's rounding is the loss's size: fast stays fp32 on a CPU here
    assert "computing in fp32 (fast: bf16 is not taken on a CPU in this stage)" in messages
    rows = [json.loads(line) for line in open(tmp_path / "out" / "dpo_tiny_metrics.jsonl")]
    assert all({"dpo", "reward_accuracy", "reward_margin"} <= set(row) for row in rows)
    assert "pair_score" in rows[0] and "pair_score" in rows[2] and "pair_score" not in rows[1]


@pytest.mark.parametrize("adapter,keys", [("lora", (".lora_A.", ".lora_B.")), ("lokr", (".lokr_w1", ".lokr_w2")),
                                          ("dora", (".lora_A.", ".lora_B.", ".dora_scale"))])
def test_with_adapters_only_they_train_against_the_adapters_off(tmp_path, start, monkeypatch, adapter, keys):
    watch, messages = run_watched(tmp_path, start, monkeypatch, "--max_steps", "3", "--lora_rank", "4",
                                  "--adapter", adapter)
    assert len({c["base"] for c in watch.calls}) == 1 and len({c["adapters"] for c in watch.calls}) == 3
    assert len({c["reference"] for c in watch.calls}) == 1  # the base, adapters off, never changes
    state, config, record = read_lora_file(str(tmp_path / "out" / "lora" / "lora_dpo_tiny.safetensors"))
    assert config["rank"] == 4 and record["stage"] == "dpo" and config["kind"] == adapter
    assert all(any(k.endswith(".alpha") or part in k for part in keys) for k in state)
    assert all(any(part in k for k in state) for part in keys)
    assert any(m.startswith(f"policy {ADAPTER_KINDS[adapter]} rank 4 on ") for m in messages)


def test_an_adapter_kind_without_a_rank_is_a_one_line_error(tmp_path, start, capsys):
    """Run here as the script's __main__ runs it (no usable pairs, below, in a process of its own)."""
    result = run_script_here(train_dpo, [*argv(tmp_path, start), "--adapter", "lokr"], capsys)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --adapter lokr trains adapters: give their --lora_rank too (0 tunes all weights) (see --help)"]


def test_a_stopped_run_resumes_bitwise_on_the_same_pairs(tmp_path, start, monkeypatch):
    extra = ["--max_steps", "5", "--save_interval", "3", "--accumulation_steps", "2"]
    run_watched(tmp_path / "whole", start, monkeypatch, *extra)
    # the signal comes in step 3's second micro-batch (round 1 drawn at step 3): the step completes and saves
    run_watched(tmp_path / "cut", start, monkeypatch, *extra, stop_at=6)
    assert read_manifest(str(tmp_path / "cut" / "ckpt" / "dpo_tiny_resume"), "resume")["step"] == 3
    resumed, messages = run_watched(tmp_path / "cut", start, monkeypatch, *extra, "--from_resume", "1")
    assert sum("pairs, round" in m for m in messages) == 1  # round 2 only: round 1 came back with the checkpoint

    def state(run_dir):
        stem, resume_stem = str(run_dir / "out" / "dpo_tiny"), str(run_dir / "ckpt" / "dpo_tiny_resume")
        resume = load_torch(checkpoint_file(resume_stem, read_manifest(resume_stem, "resume"), ".pt"))
        resume["export"] = load_safetensors(checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))
        with open(run_dir / "out" / "dpo_tiny_metrics.jsonl") as f:
            resume["rows"] = [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]
        return resume

    whole, cut = state(tmp_path / "whole"), state(tmp_path / "cut")
    assert whole["step"] == 5 and whole["pairs"]["round"] == 2 and len(whole["rows"]) == 5
    for key in ("model", "optimizer", "pairs", "rng", "export", "samples_seen", "rows"):
        assert first_difference(whole[key], cut[key], key) is None, key
    held_out = [f"{color} {shape}" for color, shape in HELD_OUT_PAIRS]
    assert not any(words in caption for caption in whole["pairs"]["captions"] for words in held_out)


def write_manifest(folder):
    """Five good pairs and one line of each kind of bad one -> (the manifest's path, the good pairs' prompts)."""
    data, lines = ShapesDataset(num_samples=10), shape_pairs(folder, 5)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    lines += [json.dumps({"prompt": "a red star", "chosen": "gone.png", "rejected": "chosen0.png"}),
              json.dumps({"prompt": "a red star", "chosen": "chosen0.png", "rejected": "broken.png"}),
              json.dumps({"prompt": "  ", "chosen": "chosen0.png", "rejected": "rejected0.png"}),
              '{"prompt": "a red star", "chosen": ', json.dumps(["not", "an", "object"])]
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines[:2] + lines[5:] + lines[2:5]) + "\n")
    return str(path), {data.sample(2 * i)[1] for i in range(5)}


def test_a_manifest_trains_on_its_good_lines_and_reports_the_rest_in_one_line(tmp_path, start, monkeypatch):
    pairs, good = write_manifest(tmp_path)
    watch, messages = run_watched(tmp_path, start, monkeypatch, "--pairs", pairs, "--max_steps", "3")
    summary = [m for m in messages if m.startswith(f"pairs {pairs}")]
    assert summary == [f"pairs {pairs}: 5 pairs, 5 skipped: 2 malformed (line 6, 7); 1 empty prompt (line 5); "
                       "1 missing image (line 3); 1 unreadable image (line 4)"]
    assert {c for captions in watch.captions for c in captions} <= good and len(watch.calls) == 3
    assert len(watch.captions) == 3  # a micro-batch's draws a step
    assert (tmp_path / "out" / "dpo_tiny.json").is_file()


def test_the_grids_draw_a_prompt_file_else_the_pairs_prompts(tmp_path):
    """--sample_prompts is read by Flow-DPO as by the other stages (it was once passed over for the pairs')."""
    pairs, good = write_manifest(tmp_path)
    (tmp_path / "prompts.txt").write_text("a blue square\n\na red star\n")
    for prompt_file, expected in ((None, None), (str(tmp_path / "prompts.txt"), ["a blue square", "a red star"])):
        settings = DataSettings(resolution=32, seed=0, val_data=None, val_samples=0, val_interval=0, cache="auto",
                                cache_dir=str(tmp_path / "cache"), cache_only=False, encode_batch_size=8,
                                sample_prompts=prompt_file)
        prompts = preference.preference_data(pairs, None, None, settings, print).prompts
        if expected is None:  # the pairs' own, spread over the file, and the unconditional
            assert prompts[-1] == "" and set(prompts[:-1]) <= good and len(prompts) > 2
        else:
            assert prompts == expected


def test_no_pairs_is_a_one_line_error(tmp_path, start):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a red star", "chosen": "gone.png", "rejected": "gone2.png"}) + "\n")
    result = run(["trainer/train_dpo.py", *argv(tmp_path, start, "--pairs", str(path))], check=False)
    assert result.returncode != 0 and "no usable pairs" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_no_builtin_pairs_is_a_one_line_error(tmp_path, start, capsys):
    # the start draws no shapes yet: the shape scorer finds all of a prompt's images alike
    result = run_script_here(train_dpo, argv(tmp_path, start, "--max_steps", "2"), capsys)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "no preference pairs: all 3 images of each of the 6 prompts scored alike" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_two_processes_draw_the_same_pairs_and_shard_like_ddp(tmp_path, pretrained_small):
    """--dpo_beta 1: the loss in its smooth range, where the two modes' rounding stays rounding (at the default
    1000, its steep sigmoid and AdamW turned DDP's and FSDP's last-bit differences into 1.3e-5 of weight after
    three steps on an AVX2 CPU). On the 2-block sd3-tiny preset: pairs and sharding work alike at any size."""
    modes, start = ("ddp", "fsdp"), pretrained_small
    run_many("tests.dpo_stand_in", [argv(tmp_path / mode, start, "--preset", "sd3-tiny", "--max_steps", "3",
                                         "--save_dtype", "fp32", "--dpo_beta", "1", "--fsdp", str(int(mode == "fsdp")))
                                    for mode in modes])
    exports = {}
    for mode in modes:
        resume_stem = str(tmp_path / mode / "ckpt" / "dpo_sd3-tiny_resume")
        state = load_torch(checkpoint_file(resume_stem, read_manifest(resume_stem, "resume"), ".pt"))
        assert state["world_size"] == 2 and state["step"] == 3 and state["pairs"]["round"] == 1
        stem = str(tmp_path / mode / "out" / "dpo_sd3-tiny")
        exports[mode] = load_safetensors(checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))
    for key, value in exports["ddp"].items():
        assert torch.allclose(value, exports["fsdp"][key], atol=1e-5), key
    started = load_safetensors(checkpoint_file(start[:-5], read_manifest(start[:-5], "weights"), ".safetensors"))
    assert any((exports["ddp"][key] - value).abs().max() > 1e-5 for key, value in started.items())  # it trained


@pytest.mark.slow
def test_manifest_pairs_train_sd3_components_from_the_cache(tmp_path, sd3, capsys):
    pairs, _ = write_manifest(tmp_path)
    result = run_here(train_dpo, ["--base", sd3, "--from_weight", "base", "--preset", "sd3-tiny", "--pairs", pairs,
                                  "--batch_size", "2", "--max_steps", "2", "--sample_steps", "1", *dirs(tmp_path)],
                      capsys)
    assert "5 pairs, 5 skipped" in result.stdout
    assert any(name.startswith("pairs.jsonl-") for name in os.listdir(tmp_path / "cache"))
    record = json.loads((tmp_path / "out" / "dpo_sd3-tiny.json").read_text())
    assert record["prediction"] == "v" and record["stage"] == "dpo"
    assert (tmp_path / "out" / "dpo_sd3-tiny" / "transformer").is_dir()
