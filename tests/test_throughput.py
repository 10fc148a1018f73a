"""The operations a training step dispatches, bench/bench_throughput.py's count: on a GPU each costs the host
microseconds, and at batch 1 the host, not the GPU, set the pace. The LoRA step of the SD3.5-Medium structure
dispatched 28,192 of them with every block recomputed in backward and 17,971 without, before the hand-written
LoRA layers and --gradient_checkpointing auto (BENCHMARKS.md, "Fast on the GPU"); they must not grow back. And the
host's reads of tensor values, bench/bench_host_reads.py's counter (the proxy for a GPU's syncs)."""
import linecache
import os
import re
import subprocess

import pytest
import torch

from bench.bench_throughput import CONFIGS, measure
from tests.scripts import REPO


@pytest.mark.slow  # two steps of a 24-block model
def test_the_lora_step_dispatches_at_most_half_the_operations_it_did():
    plain = measure(CONFIGS["lora_b1_auto"], 64, 1, 64)
    assert plain["recomputed"] == 0  # auto: a 24 GB card holds batch 1 at 1024 px without recomputing
    assert plain["ops_per_step"] <= 11_500  # 28,192 before; 13,651 before the adapters were cast at once: 11,475
    everything = measure(CONFIGS["lora_b1_all"], 64, 1, 64)
    assert everything["recomputed"] == 24 and everything["ops_per_step"] <= 17_400  # 19,663, then 17,340


def test_the_host_reads_counter_counts_each_read_of_a_tensor_value_by_step_and_line():
    from bench.bench_host_reads import HostReads, wrap

    counter, originals = HostReads(), {name: getattr(torch.Tensor, name) for name in ("tolist", "backward")}
    try:
        wrap(counter, "tolist")
        wrap(counter, "backward", new_step=True)
        x = torch.ones(3, requires_grad=True)
        with counter:
            (x * 2).sum().backward()  # a step: no read
            loss = (x * 3).sum()
            loss.backward()
            float(loss), loss.item(), bool(loss > 0), loss.detach().tolist()  # four reads in this step
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    assert [len(step) for step in counter.steps] == [0, 0, 4]
    assert all(where.startswith("tests/test_throughput.py:") for where in counter.steps[2])
    assert sum(counter.lines.values()) == 4 and any("Tensor.tolist" in where for where in counter.lines)


def test_between_two_log_steps_the_lora_and_full_fine_tune_loops_read_nothing_to_the_host(pretrained, tmp_path):
    """The CPU proxy for a loop a GPU runs ahead of: bench/bench_host_reads.py counts the reads of tensor values in
    each step of the real stage scripts (--log_interval 4): none in the steps between two log steps (the loss,
    the gradient norm and the skip of a step that is not finite stay on the device), some at the log step. 16
    samples at batch 2: no epoch starts in these steps (an epoch's order is drawn and read on the CPU, on a GPU
    too)."""
    from bench.bench_host_reads import run

    common = ["--from_weight", pretrained, "--max_steps", "5", "--log_interval", "4", "--num_samples", "16",
              "--batch_size", "2", "--sample_steps", "1", "--val_interval", "1000", "--out_dir", str(tmp_path / "out")]
    for script, extra in (("trainer/train_lora.py", ["--prior_data", "none"]), ("trainer/train_full_sft.py", [])):
        summary = run(script, common + extra + ["--save_dir", str(tmp_path / os.path.basename(script))])
        assert summary["code"] == 0 and summary["steps"][:3] == [0, 0, 0], (script, summary["step_lines"])
        assert summary["steps"][3] >= 1  # the log step after step 4: the four steps' values, read at once


def test_between_two_log_steps_pretraining_dpo_and_distillation_read_nothing_from_the_device(pretrained, tmp_path):
    """The same proxy for the other stages' loops (--log_interval 4): pretraining from scratch; DPO through the
    stand-in verifier (tests/dpo_stand_in.py: the tiny start draws no shapes), its round of pairs drawn before the
    first backward; distillation with the generator stepped at steps 2 and 4 (--gen_update_ratio 2). There the
    teacher's guidance interval is checked on the score sigmas as drawn, a tensor on the host on a GPU too: a read
    this CPU run counts but that waits for no device, once in each generator step's forward (the counter files a
    forward with the backward before it), and nothing else."""
    from bench.bench_host_reads import run

    common = ["--max_steps", "5", "--log_interval", "4", "--batch_size", "2", "--sample_interval", "0",
              "--val_interval", "1000", "--out_dir", str(tmp_path / "out")]
    runs = {"pretrain": ("trainer/train_pretrain.py", ["--num_samples", "16", "--sample_steps", "1"]),
            "dpo": ("tests/dpo_stand_in.py", ["--from_weight", pretrained, "--pair_prompts", "6", "--pair_images", "3",
                                              "--pair_sample_steps", "2", "--sample_steps", "1"]),
            "distill": ("trainer/train_distill.py", ["--from_weight", pretrained, "--num_samples", "16",
                                                    "--gen_update_ratio", "2"])}
    metrics = os.path.join(REPO, "trainer", "mechanics", "metrics.py")
    log_line = next(n for n, text in enumerate(open(metrics, encoding="utf-8"), 1) if "torch.stack(tensors).tolist()"
                    in text)  # StepRows.read: the steps since the last log step, read at once
    for label, (script, extra) in runs.items():
        summary = run(script, common + extra + ["--save_dir", str(tmp_path / label)])
        reads = dict(summary["step_lines"])
        log_read = reads.pop(f"trainer/mechanics/metrics.py:{log_line} (Tensor.tolist)", 0)
        assert summary["code"] == 0 and log_read == 1, (label, summary)  # the log step: four steps read at once
        if label == "distill":
            guidance = [where for where in reads if where.startswith("trainer/distillation.py:")]
            assert summary["steps"] == [1, 0, 1, 1] and len(guidance) == 1 and reads.pop(guidance[0]) == 2, summary
            line = int(guidance[0].split()[0].split(":")[1])  # the line that read: the interval's check
            assert "inside.any()" in linecache.getline(os.path.join(REPO, "trainer", "distillation.py"), line)
        else:
            assert summary["steps"] == [0, 0, 0, 1], (label, summary)
        assert reads == {}, (label, reads)


def test_the_prepared_gpu_checks_parse_and_name_configurations_the_bench_has():
    # bench/gpu_checks.sh runs only on a GPU machine, where a slip in it would be found too late
    script = os.path.join(REPO, "bench", "gpu_checks.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    with open(script) as f:
        text = f.read()
    lists = re.findall(r"--only ((?:[\w.]+\s*\\?\s*)+);;", text)
    named = [name for words in lists for name in words.replace("\\", " ").split()]
    assert len(lists) == 2 and len(named) == len(set(named)) == 11
    assert set(named) <= set(CONFIGS), set(named) - set(CONFIGS)
    refused = subprocess.run(["bash", script, "graphs", "nothing"], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout.startswith("unknown part: nothing")
