"""What only POSIX systems have (madvise through the C library, `resource`, `os.sysconf`, glibc's malloc tuning, fcntl's
locks) falls back where it is absent, as on native Windows: a run saves, resumes and logs its estimate without them."""
import ctypes
import json
import os
import sys

import torch.distributed.checkpoint  # noqa: F401  (imported first: on Windows torch's own modules take their own path)
import torch.distributed.checkpoint.state_dict  # noqa: F401

import trainer.train_lora as train_lora

from tests.conftest import dirs
from tests.scripts import run_in_process


def test_without_the_posix_only_calls_a_run_saves_resumes_and_estimates(tmp_path, pretrained, monkeypatch):
    def no_c_library(*args, **kwargs):
        raise OSError("no C library to load here")

    monkeypatch.setattr(ctypes, "CDLL", no_c_library)  # madvise, mallopt, malloc_trim
    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` fails, as on Windows
    monkeypatch.setitem(sys.modules, "fcntl", None)  # and `import fcntl`: the run's folders are not locked
    monkeypatch.delattr(os, "sysconf")
    argv = ["--from_weight", pretrained, "--num_samples", "4", "--prior_data", "none", "--batch_size", "2",
            "--save_interval", "1", "--sample_interval", "0", "--sample_steps", "1", *dirs(tmp_path)]
    _, messages = run_in_process(train_lora, argv + ["--max_steps", "2"], monkeypatch)
    _, resumed = run_in_process(train_lora, argv + ["--max_steps", "3", "--from_resume", "1"], monkeypatch)
    estimate = next(m for m in messages if m.startswith("memory estimate per process:"))
    assert estimate.endswith("of unknown size; blocks recomputed in backward: 0 of 6"), estimate
    assert any(m.startswith("peak memory after the run: not measured here") for m in messages)
    assert any(m.startswith("resumed ") and " at step 2 " in m for m in resumed)
    assert any(m.startswith("done:") for m in resumed)
    with open(tmp_path / "out" / "lora_demo_tiny_metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f if "loss" in line] == [1, 2, 3]
