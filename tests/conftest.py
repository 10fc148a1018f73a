"""What several test modules share: small builders of inputs and files, a briefly pretrained model, stage runs in
this process (with a stop signal at a chosen fetch), readers of what a run left, and launchers of real processes.
Test modules import them from here (`from tests.conftest import ...`), never from one another.

Every test that runs a stage or a script end to end (itself or through a fixture) is marked `slow`, so
`pytest -m "not slow"` is the quick check of the pieces (a test module may mark more by hand).

The suite runs on every core (pytest-xdist, `-n auto` in the README's test command): what several tests read and
none changes (the briefly pretrained weights, the tiny SD3 folder, test_fsdp.py's runs) is made once for the whole
run, by the first worker that needs it (`shared`)."""
import compileall
import fcntl
import functools
import inspect
import json
import os
import random
import shutil
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from PIL import Image

import dataset.training_data
import trainer.train_pretrain as train_pretrain
from model import checkpoint
from model.checkpoint import load_safetensors, load_torch, read_manifest
from model.model_lora import read_lora_file
from model.model_sd3light import PRESETS, SD3Light, SD3LightConfig

from tests.scripts import ENV, REPO, command, run_in_process

# a call that runs a stage or a script, or pretrain_weights handed to `shared` (which runs it once for all)
RUNS_A_STAGE = re.compile(r"\b(run|run_here|run_many|run_script_here|run_stage|run_in_process|launch|main)\(|"
                          r"pretrain_weights\b")


def pytest_configure(config):
    """Under pytest-xdist the workers share the cores: each computes on its share of them. Before any starts (in
    the one process that starts them), the project's bytecode is written once: where PYTHONDONTWRITEBYTECODE is set
    every process the suite starts would compile the project's sources again (0.3 s of CPU each, measured)."""
    if not hasattr(config, "workerinput"):
        for folder in ("model", "trainer", "dataset", "eval", "bench", "tests"):
            compileall.compile_dir(os.path.join(REPO, folder), quiet=2)  # a read-only checkout: silent
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    """Mark `slow` what runs a stage or a script: the test's own code or a fixture it uses calls one."""
    for item in items:
        functions = [item.function] + [fixture.func for name in item.fixturenames
                                       for fixture in item._fixtureinfo.name2fixturedefs.get(name, ())]
        if any(RUNS_A_STAGE.search(_source(function)) for function in functions):
            item.add_marker(pytest.mark.slow)
    # the longest first, so that under pytest-xdist no worker is left with a long test at the end: the tests that
    # share a batch of runs (xdist_group), then the other slow ones, then the quick ones (a stable sort)
    items.sort(key=lambda item: 0 if item.get_closest_marker("xdist_group") else 1 if item.get_closest_marker("slow")
               else 2)


def _source(function):
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


# ----------------------------------------------------------------------------------------------------------------
# Made once for the whole run


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """shared(name, build) -> the folder `name`, filled by `build(folder)` once for the whole test run: under
    pytest-xdist the first worker that asks builds it while the others wait (a file lock), then all read it. What
    is shared is never changed by a test."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base folders are made in one folder of the run
    root = root / "shared"
    root.mkdir(exist_ok=True)

    def get(name, build):
        folder = root / name
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / ".built").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                (folder / ".built").touch()
        return folder

    return get


@pytest.fixture(scope="session")
def pretrained(shared):
    """The weights of pretrain_weights (x-prediction, 2 steps) -> their .json, made once for the whole run."""
    return str(shared("pretrained", pretrain_weights) / "pretrain_tiny.json")


@pytest.fixture(scope="session")
def pretrained_v(shared):
    """The same, v-prediction (with a diffusers transformer folder beside them) -> their .json."""
    return str(shared("pretrained_v", functools.partial(pretrain_weights, prediction="v")) / "pretrain_tiny.json")


PRETRAIN_SMALL = "pretrain_sd3-tiny"  # what a pretraining run of --preset sd3-tiny is called


@pytest.fixture(scope="session")
def pretrained_small(shared):
    """Briefly pretrained weights of the 2-block sd3-tiny preset (v-prediction, with a diffusers transformer folder
    beside them) -> their .json: for the runs of several processes (sharding, adapters, distillation, DPO work
    alike at any size), at a twentieth of tiny's size."""
    build = functools.partial(pretrain_weights, prediction="v", preset="sd3-tiny")
    return str(shared("pretrained_v_sd3-tiny", build) / f"{PRETRAIN_SMALL}.json")


@pytest.fixture(scope="session")
def sd3(shared):
    """A tiny SD3 pipeline folder (tests/tiny_sd3.py, seed 0) -> its path, made once for the whole run."""
    from tests.tiny_sd3 import build_folder

    return str(shared("tiny-sd3", lambda folder: build_folder(str(folder))))


# ----------------------------------------------------------------------------------------------------------------
# From test_dataset.py's tests and the others'


def save_image_png(path, image, **kwargs):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image.save(path, **kwargs)


def exif_jpeg(path):
    """40x20 JPEG, left half red, right half blue, tagged 'rotate 90 degrees clockwise to display' (orientation 6)."""
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    image.save(path, "JPEG", quality=95, exif=exif)


# ----------------------------------------------------------------------------------------------------------------
# From test_train.py's tests and the others'


def metric_steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


# ----------------------------------------------------------------------------------------------------------------
# From test_finetune.py's tests and the others'


# the sample grids of one prompt (--sample_prompts): the built-in data's 16 cost the tiny model 0.5 s a grid, more
# than the few steps of a test's run; what grids draw is checked where it is the subject (the built-in prompts in
# test_dataset.py, grids in parts in test_block_swap.py, eval/eval_sample.py's in test_eval_sample.py)
GRID = ["--sample_prompts", os.path.join(REPO, "tests", "grid_prompt.txt")]
QUIET = ["--warmup_steps", "2", "--sample_steps", "1", *GRID]


def narrow_tiny(monkeypatch):
    """The tiny preset cut to one block 64 wide for the rest of the test: for tests whose steps compute in bf16,
    which a CPU without AVX-512 BF16 emulates some 50x slower than fp32 (14 s a step of the tiny model under Muon's
    bf16 orthogonalisation). What they check (a bitwise resume, both optimizers' states, the dtype a run computes
    in) is the same on any size of model."""
    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "num_layers": 1, "num_attention_heads": 2,
                                          "caption_projection_dim": 64})


def pretrain_weights(out_dir, prediction="x", steps=2, preset="tiny"):
    """A briefly pretrained model of `preset` at out_dir/pretrain_<preset> (what the fine-tune stages start from)."""
    with pytest.MonkeyPatch.context() as patch:
        # like trained weights: no zero-initialised gates or output
        patch.setattr(train_pretrain, "SD3Light", lambda config, **kwargs: randomise(SD3Light(config, **kwargs)))
        run_in_process(train_pretrain, ["--num_samples", "8", "--batch_size", "2", "--max_steps", str(steps),
                                        "--sample_interval", "0", *QUIET, "--prediction", prediction, "--preset",
                                        preset, "--out_dir", str(out_dir), "--save_dir", str(out_dir / "ckpt")], patch)
    return os.path.join(str(out_dir), f"pretrain_{preset}.json")


class SignalAt:
    """Wraps the stage's datasets; the `at`-th item fetched from any of them sends SIGTERM to this process, as a
    scheduler would in the middle of a step."""

    def __init__(self, at):
        self.at, self.fetched = at, 0

    def wrap(self, build):
        def build_and_wrap(*args, **kwargs):
            return Fetching(build(*args, **kwargs), self)
        return build_and_wrap


class Fetching(torch.utils.data.Dataset):
    def __init__(self, data, counter):
        self.data, self.counter = data, counter
        if hasattr(data, "sample_prompts"):
            self.sample_prompts = data.sample_prompts

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.counter.fetched += 1
        if self.counter.fetched == self.counter.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.data[i]


def compiled_as_captured(monkeypatch):
    """--compile 1 from here on with torch.compile's "eager" backend: each block goes through Dynamo's capture as in
    a GPU run and computes bitwise what eager does, so a run resumed compiled is compared bitwise with an eager one
    (inductor's own code: test_train's compiled pretraining) -> Dynamo's counters, to see that it captured."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    return torch._dynamo.utils.counters


def run_stage(module, argv, monkeypatch, signal_at=None):
    """Run a stage script's main() in this process (its datasets wrapped to signal at a fetch)."""
    run_in_process(module, argv, monkeypatch, SignalAt(signal_at).wrap(dataset.training_data.build_dataset))


def final_state(run_dir, name, export):
    resume = str(run_dir / "ckpt" / f"{name}_resume")
    state = load_torch(checkpoint.checkpoint_file(resume, read_manifest(resume, "resume"), ".pt"))
    state["export"] = export(run_dir)
    with open(run_dir / "out" / f"{name}_metrics.jsonl") as f:
        state["logged"] = [{k: row[k] for k in ("step", "epoch", "loss", "lr", "grad_norm", "samples_seen")}
                           for row in map(json.loads, f)]
    return state


def sft_export(run_dir, name="sft_tiny"):
    stem = str(run_dir / "out" / name)
    return load_safetensors(checkpoint.checkpoint_file(stem, read_manifest(stem, "weights"), ".safetensors"))


def lora_export(run_dir, name="lora_demo_tiny"):
    return read_lora_file(str(run_dir / "out" / "lora" / f"{name}.safetensors"))[0]


# ----------------------------------------------------------------------------------------------------------------
# From test_sd3.py's tests and the others'


def dirs(tmp_path):
    return ["--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt"), "--cache_dir",
            str(tmp_path / "cache")]


def diffusers_image(pipeline, prompt, seed, steps, cfg, resolution=32, **extra):
    """What StableDiffusion3Pipeline draws with our sampler's settings: our step schedule (evenly spaced sigmas,
    shifted by the scheduler) and our unconditional input (zero text). -> [3, H, W] in [-1, 1]."""
    sigmas = list(np.linspace(1.0, 0.0, steps + 1)[:-1])
    out = pipeline(prompt, height=resolution, width=resolution, num_inference_steps=steps, guidance_scale=cfg,
                   sigmas=sigmas, generator=torch.Generator().manual_seed(seed), max_sequence_length=77,
                   negative_prompt_embeds=torch.zeros(1, 154, 4096), negative_pooled_prompt_embeds=torch.zeros(1, 2048),
                   output_type="pt", **extra)
    return out.images[0] * 2 - 1


# ----------------------------------------------------------------------------------------------------------------
# From test_dpo.py's tests and the others'


def shape_pairs(folder, count):
    """`count` preference pairs of built-in shape images saved in `folder` (chosen{i}.png, rejected{i}.png) -> their
    manifest lines (JSON, image paths relative to the folder)."""
    from dataset.shapes import ShapesDataset

    data, lines = ShapesDataset(num_samples=2 * count), []
    for i in range(count):
        for side, k in (("chosen", 2 * i), ("rejected", 2 * i + 1)):
            data.sample(k)[0].save(folder / f"{side}{i}.png")
        lines.append(json.dumps({"prompt": data.sample(2 * i)[1], "chosen": f"chosen{i}.png",
                                 "rejected": f"rejected{i}.png"}))
    return lines


# ----------------------------------------------------------------------------------------------------------------
# From test_model_sd3light.py's tests and the others'


def random_config(seed, **overrides):
    rng = random.Random(seed)
    heads, head_dim = rng.choice([1, 2, 3]), rng.choice([8, 16])
    num_layers = rng.choice([2, 3, 4])
    kw = dict(
        sample_size=rng.choice([8, 12, 16]), patch_size=rng.choice([1, 2]), in_channels=rng.choice([3, 4, 12]),
        num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=heads,
        joint_attention_dim=rng.choice([8, 20, 32]), caption_projection_dim=heads * head_dim,
        pooled_projection_dim=rng.choice([6, 16]), out_channels=rng.choice([3, 4, 5]),
        pos_embed_max_size=rng.choice([12, 16]),
    )
    kw.update(overrides)
    return SD3LightConfig(**kw)


CONFIGS = {
    "plain-a": random_config(0),
    "plain-b": random_config(1),
    "plain-c": random_config(2),
    "qk_norm": random_config(3, qk_norm="rms_norm"),
    "sd3.5-medium-like": random_config(4, qk_norm="rms_norm", num_layers=4, dual_attention_layers=(0, 2)),
    "dual-last-block": random_config(5, num_layers=3, dual_attention_layers=(2,)),
}


def inputs(config, grid, batch=2, text_len=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = config.patch_size
    h, w = grid if grid else (config.pos_embed_max_size, config.pos_embed_max_size)
    return (
        torch.randn(batch, config.in_channels, h * p, w * p, generator=g),
        torch.randn(batch, text_len, config.joint_attention_dim, generator=g),
        torch.randn(batch, config.pooled_projection_dim, generator=g),
        torch.rand(batch, generator=g) * 1000,
    )


def randomise(model, seed=0):
    """Random weights everywhere (our init zeroes adaLN and the output layer, which would make outputs trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


# ----------------------------------------------------------------------------------------------------------------
# From test_own_data.py's tests and the others'


CAT = ["cat, red, big, round, soft\ncat, small, blue", "cat, green, tall, thin, sharp\ncat, dark, wide"]


def save_array_png(path, array):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array).save(path)


def noise_image(seed, size=40):
    return np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# From test_checkpoint.py's tests and the others'


def launch(args, torchrun=0, log_path=None, extra=()):
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(command(args, torchrun, extra), cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def last_logged_step(metrics_path):
    if not os.path.exists(metrics_path):
        return 0
    with open(metrics_path) as f:
        lines = [line for line in f if line.endswith("\n")]
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for_step(proc, metrics_path, step, timeout=120):
    deadline = time.time() + timeout
    while last_logged_step(metrics_path) < step and proc.poll() is None:
        assert time.time() < deadline, "training made no progress"
        time.sleep(0.02)


def uncommitted(directory, stem_name):
    """Files a killed save left: temp files and step files (or shard folders) the manifest does not name. A run
    killed before it made its folder left nothing."""
    if not os.path.isdir(directory):
        return []
    manifest = os.path.join(directory, stem_name + ".json")
    named = {n.split("/")[0] for n in json.load(open(manifest))["files"]} if os.path.exists(manifest) else set()
    return [n for n in os.listdir(directory) if n.startswith(".tmp-") or
            (n.startswith(stem_name + ".step") and n not in named)]


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def family(pid):
    """pid and every process below it."""
    try:
        return [pid] + [p for child in children(pid) for p in family(child)]
    except FileNotFoundError:  # gone meanwhile
        return [pid]


def alive(pid):
    """Running: not gone, and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
