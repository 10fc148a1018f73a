"""What a GPU does differently, checked on this CPU where it can be: bf16 only where the GPU has it natively, TF32,
free and reserved memory in the estimate and the peak line, CUDA autocast's fp32 layer norms, the cache given back
after the text encoders go, data loader workers and pinned memory, the process group's timeout, DDP without buffer
broadcasts, rank 0 loading on the CPU under FSDP, compiled blocks that say when they recompile, --ema_device cpu
with FSDP refused, an EMA that resumes into its own tensors, and no host sync inside a step's micro-batch loop."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import trainer.train_pretrain as train_pretrain
from model import memory
from model.components import SD3Components
from model.precision import StagePrecision, resolve_dtype, resolve_frozen_dtype, run_precision, use_tf32
from model.token_routing import to_device
from trainer import networks, trainer_utils
from trainer.mechanics import distributed
from trainer.mechanics.distributed import DistInfo, any_process, data_parallel, init_distributed, mean_over_processes
from trainer.mechanics.ema import EMA
from trainer.mechanics.position import data_workers

from tests.scripts import run_in_process

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("capability, expected", [((7, 0), "fp32"), ((7, 5), "fp32"), ((8, 0), "bf16"),
                                                  ((9, 0), "bf16")])
def test_bf16_only_where_the_gpu_has_it_natively(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for asked in ("auto", "fast"):
        compute, why = resolve_dtype(asked, CUDA)
        assert compute == expected, (asked, why)
        assert ("no native bf16" in why) == (expected == "fp32")
    assert resolve_dtype("bf16", CUDA) == ("bf16", "as asked")  # asked for: taken, emulated or not
    assert resolve_frozen_dtype("auto", "auto", CUDA, True)[0] == "bf16"  # stored in bf16 on any GPU: the memory


def test_a_gpu_without_native_bf16_computes_in_fp32_unless_a_frozen_transformer_is_held_in_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    info = DistInfo(device=CUDA)
    pretrain = run_precision("auto", "auto", StagePrecision("pretrain"), info, True)
    assert (pretrain.compute, pretrain.frozen) == ("fp32", "bf16")  # the VAE and text encoders stored in bf16
    assert any("no native bf16" in line for line in pretrain.notes)
    assert not any("TF32" in line for line in pretrain.notes)  # no tensor cores for it either
    lora = run_precision("auto", "auto", StagePrecision("lora", frozen_transformer=True), info, True)
    assert (lora.compute, lora.frozen) == ("bf16", "bf16")  # a bf16 base computes in bf16: said, with the way out
    assert any("emulates bf16: --frozen_dtype fp32" in line for line in lora.notes)


def test_tf32_for_fp32_matrix_products_on_gpus_that_have_it(monkeypatch):
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert use_tf32(torch.device("cpu")) is None and not torch.backends.cuda.matmul.allow_tf32
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
        assert use_tf32(CUDA) is None and not torch.backends.cuda.matmul.allow_tf32  # a V100: none
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert "TF32" in use_tf32(CUDA)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_the_estimate_on_a_gpu_counts_free_and_reserved_memory_and_fp32_layer_norms(monkeypatch):
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    assert memory.device_memory(CUDA) == 13 * gib  # what is free plus what the run holds already, not 80
    assert memory.kept_value_bytes("bf16", "cpu") == 2 and memory.kept_value_bytes("fp32", "cuda") == 4
    assert 2 < memory.kept_value_bytes("bf16", "cuda") < 4  # the layer norms' outputs stay fp32 under CUDA autocast


def test_the_peak_line_on_a_gpu_shows_allocated_and_reserved(monkeypatch):
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1.5 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2.25 * gib)
    lines = []
    trainer_utils.log_peak(DistInfo(device=CUDA), "the run", lines.append)
    assert lines == ["peak memory after the run: 1.50 / 2.25 GiB (allocated / reserved) (by rank)"]


def test_the_text_encoders_memory_goes_back_to_the_gpu(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    class OnAGPU:
        device, prompt_memo, t5, trained_text = CUDA, {}, object(), ()

        def encode_text(self, prompts):
            return prompts

        def condition(self, features):
            return features

    components = OnAGPU()
    SD3Components.free_text_encoders(components, ["a red circle"])
    assert components.t5 is None and emptied == [True]


def test_data_loader_workers_by_device(monkeypatch):
    assert data_workers("auto", torch.device("cpu")) == 0 and data_workers(3, torch.device("cpu")) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert data_workers("auto", CUDA) == 3  # 4 cores a GPU: 3 workers beside the training process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert data_workers("auto", CUDA) == 4


@pytest.fixture
def group_of_one():
    """A gloo process group of this process alone (what a test can make of torchrun)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_process_group_waits_as_long_as_asked(group_of_one):
    info = init_distributed(fsdp=1, timeout_minutes=90)
    assert info.sharded
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert backend.options._timeout == datetime.timedelta(minutes=90)
    assert train_pretrain.parse_args([]).dist_timeout == 60  # the default: an hour, for rank 0's large saves


def test_ddp_does_not_broadcast_the_constant_buffers(group_of_one):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("table", torch.ones(4))
    wrapped = data_parallel(model, DistInfo(world_size=2))  # two processes as DDP sees them: it wraps
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    assert wrapped.broadcast_buffers is False


def test_under_fsdp_rank_0_loads_on_the_cpu_and_shards_from_there(tmp_path, pretrained):
    source = networks.start_weights_source(pretrained, "tiny", None, str(tmp_path))
    # a "GPU" no tensor may reach: under FSDP rank 0 loads on the CPU, the other ranks hold nothing
    sharded = DistInfo(device=torch.device("meta"), mesh=object())
    assert sharded.load_device == torch.device("cpu") and DistInfo(device=CUDA).load_device == CUDA
    for role in ("trained", "frozen"):
        model = networks.load_network(source, role, "fp32", sharded)
        assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
        other = networks.load_network(source, role, "fp32", DistInfo(rank=1, device=torch.device("meta"),
                                                                          mesh=object()))
        assert all(t.is_meta for t in other.state_dict().values())


def test_compiled_blocks_may_recompile_as_often_as_a_run_needs_and_say_so(monkeypatch):
    said = []
    monkeypatch.setattr(torch._logging, "set_logs", lambda **kinds: said.append(kinds))
    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    with torch._dynamo.config.patch(recompile_limit=8):  # Dynamo's default, restored after
        data_parallel(model, DistInfo(), compile_blocks=True)
        assert torch._dynamo.config.recompile_limit >= distributed.RECOMPILE_LIMIT and said == [{"recompiles": True}]


def test_ema_device_cpu_under_fsdp_is_one_line_before_any_work(capsys):
    with pytest.raises(SystemExit) as stop:
        train_pretrain.parse_args(["--fsdp", "1", "--ema_device", "cpu"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--ema_device cpu does not go with --fsdp 1" in err
    assert train_pretrain.parse_args(["--ema_device", "cpu"]).ema_device == "cpu"  # without FSDP: as before


def test_an_ema_resumes_into_its_own_tensors_strictly():
    source = torch.nn.Linear(3, 2)
    ema = EMA(source, 0.9)
    own = dict(ema.shadow)
    saved = {k: torch.full_like(v, 7.0) for k, v in own.items()}  # as a resume file holds them (memory-mapped)
    ema.load_state_dict(saved)
    for key, value in ema.state_dict().items():
        assert value is own[key] and value is not saved[key] and torch.equal(value, saved[key])
    with pytest.raises(ValueError, match="missing"):
        ema.load_state_dict({"weight": saved["weight"]})
    with pytest.raises(ValueError, match=r"\(2, 3\) here"):
        ema.load_state_dict({**saved, "weight": torch.zeros(3, 2)})


def test_random_draws_reach_the_gpu_without_making_the_host_wait(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *args, **kwargs: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kwargs: calls.append((args, kwargs)) or t)
    drawn = torch.ones(2)
    assert to_device(drawn, CUDA) is drawn and calls == ["pin", ((CUDA,), {"non_blocking": True})]
    calls.clear()
    assert to_device(drawn, torch.device("cpu")) is drawn and calls == []  # already there: no copy


def test_the_logged_losses_stay_on_the_device_and_one_process_stops_alone():
    total = torch.tensor(0.75, dtype=torch.float64) + torch.tensor(0.25, dtype=torch.float64)
    mean = mean_over_processes(total / 2, DistInfo())
    assert isinstance(mean, torch.Tensor) and mean.dtype == torch.float64 and mean.item() == 0.5
    assert any_process(True, DistInfo()) is True and any_process(False, DistInfo()) is False


class HostReads:
    """Counts the reads of a tensor's value to the host (each a sync on a GPU) while `active`."""

    READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.active, self.reads = False, []
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self.counted(name, getattr(torch.Tensor, name)))

    def counted(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.active:
                self.reads.append(name)
            return original(tensor, *args, **kwargs)
        return read

    def around(self, function):
        def watched(*args, **kwargs):
            self.active = True
            try:
                return function(*args, **kwargs)
            finally:
                self.active = False
        return watched


def test_a_steps_micro_batch_loop_reads_nothing_to_the_host(tmp_path, monkeypatch):
    """A GPU runs ahead of Python only if nothing in the loop asks for a value: the loss is summed on the device
    and read once, after the step's all-reduce."""
    reads = HostReads(monkeypatch)
    calls = []
    original = train_pretrain.accumulate

    def accumulate(*args):
        calls.append(True)
        return reads.around(original)(*args)

    monkeypatch.setattr(train_pretrain, "accumulate", accumulate)
    run_in_process(train_pretrain, ["--num_samples", "24", "--batch_size", "2", "--accumulation_steps", "3",
                                    "--max_steps", "2", "--sample_interval", "0", "--sample_steps", "1",
                                    "--out_dir", str(tmp_path / "out"), "--save_dir", str(tmp_path / "ckpt")],
                   monkeypatch)
    assert len(calls) == 2 and reads.reads == []
