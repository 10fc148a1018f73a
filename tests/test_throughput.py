"""The operations a training step dispatches, bench/bench_throughput.py's count: on a GPU each costs the host
microseconds, and at batch 1 the host, not the GPU, set the pace. The LoRA step of the SD3.5-Medium structure
dispatched 28,192 of them with every block recomputed in backward and 17,971 without, before the hand-written
LoRA layers and --gradient_checkpointing auto (BENCHMARKS.md, "Fast on the GPU"); they must not grow back."""
import pytest

from bench.bench_throughput import CONFIGS, measure


@pytest.mark.slow  # two steps of a 24-block model
def test_the_lora_step_dispatches_at_most_half_the_operations_it_did():
    plain = measure(CONFIGS["lora_b1_auto"], 64, 1, 64)
    assert plain["recomputed"] == 0  # auto: a 24 GB card holds batch 1 at 1024 px without recomputing
    assert plain["ops_per_step"] <= 28_192 // 2
    everything = measure(CONFIGS["lora_b1_all"], 64, 1, 64)
    assert everything["recomputed"] == 24 and everything["ops_per_step"] <= 20_000  # 19,663 at this change
