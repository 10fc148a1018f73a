"""How fast a training step runs, and why: the LoRA step and the full fine-tune's step of an SD3.5-Medium transformer
(built from the preset, random weights, no files), at batch 1 and larger, with every block recomputed in backward,
none, or what --gradient_checkpointing auto picks for a 24 GB card; token routing on and off; compiled blocks on
and off; the whole step as a CUDA graph (`_graph`, model/step_graphs.py as --cuda_graph 1 runs it; a GPU only); and
diffusers' SD3Transformer2DModel with a peft LoRA on the same step.

    python bench/bench_throughput.py                          # GPU: 1024 px; every configuration, one process each
    python bench/bench_throughput.py --only lora_b1_none lora_b1_all diffusers_b1_all
    python bench/bench_throughput.py --resolution 128         # CPU: the operations a step (the GPU's proxy)

A row: seconds a step (the median after the warm-up steps, synchronised), images a second, MFU (model FLOPs
without recompute / the card's dense bf16 peak, model/flops.py) and HFU (with it), peak memory allocated and
reserved (torch.cuda), the share of the step the GPU is busy (kernel time over wall time, torch.profiler), and
the aten operations one step dispatches (forward, loss, backward, clipping, the optimizer step; a
TorchDispatchMode counts them), and the optimizer's step alone: its seconds and its calls (one for fused AdamW,
one compiled call a parameter tensor for torchao's). Each operation costs the host microseconds; at batch 1 on a
large GPU the kernels finish sooner than the host launches them, so fewer operations is what makes the GPU the
bottleneck there, or a graph, which launches them all at once.

On a CPU the same configurations run at the preset's structure (its 24 blocks, 13 with dual attention, qk norms)
but a width of 64 (--cpu_width), so the counts are the GPU's at any resolution (routing aside) and the run takes
minutes; the times are this CPU's and say little about a GPU. A CPU without native bf16 products (no AVX512-BF16)
computes them many times slower than fp32 ones: there --cpu_width 8 leaves the host's share of a step. The step
is the stages' own (the flow-matching loss of model/rectified_flow.py through model/model_lora.py's adapters or
every weight, AdamW or 8-bit AdamW), written here from model/ because bench/ does not import trainer/.
"""
import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.bench_peers import TARGETS  # noqa: E402
from bench.bench_peers import step_inputs as peer_inputs  # noqa: E402
from model.flat_adamw import FlatAdamW  # noqa: E402
from model.flops import FlopCount, peak_flops  # noqa: E402
from model.memory import GIB, MemoryPlan, fitted_plan, kept_value_bytes  # noqa: E402
from model.model_lora import apply_lora, lora_parameters, resolve_targets  # noqa: E402
from model.model_sd3light import SD3Light, preset_config  # noqa: E402
from model.precision import import_torchao  # noqa: E402
from model.recompute import compile_block  # noqa: E402
from model.step_graphs import StepGraphs  # noqa: E402
from model.rectified_flow import add_noise, flow_loss, predict_velocity  # noqa: E402
from model.token_routing import TokenRouting  # noqa: E402

PRESET, RANK, TEXT_TOKENS, DOWNSCALE = "sd3.5-medium", 16, 333, 8  # 77 CLIP + 256 T5 tokens, SD3's VAE
CARD = 24 * GIB  # what "auto" plans for, and the card the largest batch must fit


@dataclass(frozen=True)
class Config:
    """One row: the stage's step ("lora", "sft" or "diffusers": peft's LoRA on diffusers' model), the batch, the
    blocks recomputed in backward ("all", "none" or "auto" for a 24 GB card), the routed share of image tokens,
    and compiled blocks."""
    step: str
    batch: int
    checkpointing: str
    route: float = 0.0
    compile: bool = False
    flat: bool = False  # the full fine-tune's 8-bit AdamW as model/flat_adamw.FlatAdamW (the stages' now)
    graph: bool = False  # the whole step captured as a CUDA graph and replayed (model/step_graphs.py, --cuda_graph 1)

    @property
    def name(self):
        return f"{self.step}_b{self.batch}_{self.checkpointing}" + (f"_route{self.route:g}" if self.route else "") + \
            ("_compile" if self.compile else "") + ("_flat" if self.flat else "") + ("_graph" if self.graph else "")


CONFIGS = {c.name: c for c in [
    Config("lora", 1, "all"), Config("lora", 1, "auto"), Config("lora", 1, "none"),
    Config("lora", 1, "none", route=0.5), Config("lora", 1, "none", compile=True),
    Config("lora", 1, "none", route=0.5, compile=True),
    Config("lora", 1, "all", compile=True),
    Config("lora", 4, "all"), Config("lora", 4, "auto"), Config("lora", 4, "auto", compile=True),
    Config("lora", 4, "auto", route=0.5, compile=True),
    Config("diffusers", 1, "all"), Config("diffusers", 1, "none"), Config("diffusers", 4, "all"),
    Config("sft", 1, "all"), Config("sft", 1, "auto"), Config("sft", 1, "auto", flat=True),
    Config("sft", 1, "auto", compile=True),
    Config("sft", 2, "auto", compile=True),
    Config("lora", 1, "none", graph=True), Config("lora", 4, "auto", graph=True),
    Config("lora", 4, "auto", compile=True, graph=True),
    Config("sft", 1, "auto", flat=True, graph=True),
]}
INPUT_NAMES = ("latents", "text", "pooled", "sigmas", "noise")  # a step's inputs (step_inputs), as a graph keeps them


class OperationCount(TorchDispatchMode):
    """Counts the aten operations dispatched while it is entered, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class PositionalCall(torch.nn.Module):
    """diffusers' model called as ours is: (latents, text, pooled, timestep) -> the prediction tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, text, pooled, timestep):
        return self.model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=timestep,
                          return_dict=False)[0]


def build_model(config, settings, device):
    """The transformer of `config` as the step trains it -> (model or diffusers' model, trained parameters)."""
    torch.manual_seed(0)
    if settings.step == "diffusers":
        from diffusers import SD3Transformer2DModel
        from peft import LoraConfig

        model = SD3Transformer2DModel.from_config(config.to_dict()).to(device, torch.bfloat16).requires_grad_(False)
        if settings.checkpointing != "none":
            model.enable_gradient_checkpointing()
        model.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian", target_modules=TARGETS))
        return PositionalCall(model.train()), [p for p in model.parameters() if p.requires_grad]
    with torch.device(device):
        model = SD3Light(config).to(torch.bfloat16)
    if settings.step == "lora":
        apply_lora(model, ["attention"], RANK)
        params = lora_parameters(model)
    else:
        params = list(model.parameters())
    if settings.compile:
        for block in model.transformer_blocks:
            compile_block(block)
    return model, params


def recomputed(settings, resolution):
    """The blocks the step recomputes in backward: all, none, or what --gradient_checkpointing auto picks for the
    published-size model at `resolution` on a 24 GB card (model/memory.py; on a CPU too, so its counts are the
    GPU's)."""
    if settings.checkpointing != "auto":
        return settings.checkpointing == "all"
    config = preset_config(PRESET)
    if settings.step == "sft":
        plan = MemoryPlan(("trained",), "adamw8bit", False, "auto", settings.batch, resolution, "auto", "bf16")
    else:
        with torch.device("meta"):
            model = SD3Light(config)
        apply_lora(model, ["attention"], RANK)
        plan = MemoryPlan((sum(p.numel() for p in lora_parameters(model)),), "adamw", False, "auto", settings.batch,
                          resolution, "auto")
    return fitted_plan(config, plan, CARD, ("bf16", 1, 0, "cuda"), (DOWNSCALE, TEXT_TOKENS),
                       kept_value_bytes("bf16", "cuda")).checkpointing


def optimizer_for(settings, params):
    """AdamW in one fused kernel for fp32 adapters; torchao's 8-bit AdamW with stochastic bf16 rounding for the
    full fine-tune's bf16 weights (the stages' choices: trainer/mechanics/optimizers.adamw)."""
    if settings.flat:  # the same update in a few calls a step
        return FlatAdamW(params, 1e-5, 1e-2, eight_bit=True, bf16_stochastic_round=True)
    if settings.step == "sft":
        return import_torchao("--optimizer adamw8bit").optim.AdamW8bit(params, lr=1e-5, bf16_stochastic_round=True)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def step_inputs(config, batch, resolution, device, count, seed=0):
    """`count` steps' inputs: (latents, text, pooled, sigmas, noise), bench_peers' draws (sigmas shifted by 3, SD3.5's
    own) on `device`."""
    return [[t.to(device) for t in step]
            for step in peer_inputs(config, batch, resolution, count, seed, text_tokens=TEXT_TOKENS, shift=3.0)]


def train_step(model, params, optimizer, inputs, route, count=None):
    """One step as the stages take it: the flow-matching loss under bf16 autocast, backward, clipping, the
    optimizer's step -> the loss (a tensor: nothing waits for the GPU here). `count` (OperationCount): counts the
    operations of all but the optimizer's step, which torchao compiles whole (a dispatch mode would stop it)."""
    loss = gradients(model, params, inputs, route, count)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def graphed_step(graphs, model, params, optimizer, inputs, route):
    """train_step through `graphs` (StepGraphs; the stages' loop as written): eager for a shape's first steps,
    then captured, and replayed after -> the loss. Graphs off: train_step itself."""
    if not graphs.on:
        return train_step(model, params, optimizer, inputs, route)
    batch = [dict(zip(INPUT_NAMES, inputs))]
    if not graphs.captured(batch):
        with graphs.recording(batch) as static:
            loss = gradients(model, params, [static[0][name] for name in INPUT_NAMES], route)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            graphs.outputs(loss)
    return graphs.run(batch)[0]


def gradients(model, params, inputs, route, count=None):
    """The step up to the optimizer's: the loss, backward, clipping -> the loss, detached."""
    latents, text, pooled, s, noise = inputs
    with count or contextlib.nullcontext():
        with torch.autocast(latents.device.type, dtype=torch.bfloat16):
            pred = predict_velocity(model, add_noise(latents, noise, s), text, pooled, s, "v", route)
        loss = flow_loss(pred, latents, noise, s)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    return loss.detach()


def optimizer_seconds(model, params, optimizer, inputs, route, sync):
    """The optimizer's step alone, timed after each input's gradients -> (median seconds, the calls it makes: one
    for fused AdamW, one compiled call a parameter tensor for torchao's)."""
    times = []
    for batch in inputs:
        gradients(model, params, batch, route)
        sync()
        started = time.perf_counter()
        optimizer.step()
        sync()
        times.append(time.perf_counter() - started)
        optimizer.zero_grad(set_to_none=True)
    fused = isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults.get("fused")
    if isinstance(optimizer, FlatAdamW):  # each chunk: two copies in, the compiled update, a copy back
        return statistics.median(times), sum(4 * -(-g.moments[0].shape[0] // g.chunk) for g in optimizer.groups)
    return statistics.median(times), 1 if fused else len(params)


def measure(settings, resolution, steps, cpu_width):
    """Build and time one configuration in this process -> its row."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = preset_config(PRESET) if device.type == "cuda" else preset_config(
        PRESET, num_attention_heads=cpu_width // 64 or 1, attention_head_dim=min(64, cpu_width),
        caption_projection_dim=(cpu_width // 64 or 1) * min(64, cpu_width))
    model, params = build_model(config, settings, device)
    blocks = recomputed(settings, resolution if device.type == "cuda" else 1024)
    if settings.step != "diffusers":
        model.gradient_checkpointing = blocks
    optimizer = optimizer_for(settings, params)
    graphs = StepGraphs(settings.graph, device, print)
    graphs.prepare([optimizer])
    routing = TokenRouting.for_model(config, settings.route, 2, -2) if settings.route else TokenRouting()
    generator = torch.Generator().manual_seed(1)
    inputs = step_inputs(config, settings.batch, resolution, device, steps + 5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for batch in inputs[:steps]:
        sync()
        started = time.perf_counter()
        graphed_step(graphs, model, params, optimizer, batch, routing.draw(batch[0], generator))
        sync()
        times.append(time.perf_counter() - started)
    counted = OperationCount()  # compiled blocks run eager under it: their count is the eager one's
    train_step(model, params, optimizer, inputs[steps], routing.draw(inputs[steps][0], generator), counted)
    busy, kernels = (None, None) if device.type != "cuda" else \
        gpu_busy(graphs, model, params, optimizer, inputs[steps + 1], routing.draw(inputs[steps + 1][0], generator))
    optimizer_s, optimizer_calls = optimizer_seconds(model, params, optimizer, inputs[steps + 2:],
                                                     routing.draw(inputs[steps + 2][0], generator), sync)
    warm = 3 if settings.graph else 2  # the warm-up (and a graph's capture, at the third step)
    seconds = statistics.median(times[warm:] if len(times) > warm + 1 else times[1:] or times)
    side = resolution // DOWNSCALE
    lora = (RANK, resolve_targets("attention")) if settings.step != "sft" else None
    flops = FlopCount(config, TEXT_TOKENS, routing, lora, blocks if settings.step != "diffusers" else
                      settings.checkpointing != "none").forward(settings.batch, side, side)
    peak = peak_flops(device, torch.bfloat16)[0]
    row = {"config": settings.name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "resolution": resolution, "width": config.inner_dim, "recomputed": blocks if blocks not in (True, False)
           else config.num_layers if blocks else 0, "s_per_step": seconds, "images_per_s": settings.batch / seconds,
           "mfu": flops.model / seconds / peak, "hfu": (flops.model + flops.recompute) / seconds / peak,
           "ops_per_step": None if settings.compile else sum(counted.counts.values()),
           "top_ops": counted.counts.most_common(8), "busy": busy, "kernels_per_step": kernels,
           "optimizer_s": optimizer_s, "optimizer_calls": optimizer_calls}
    if device.type == "cuda":
        row.update(allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                   reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    return row


def gpu_busy(graphs, model, params, optimizer, inputs, route):
    """The share of one step's wall time the GPU spends in kernels (torch.profiler; one stream, so they do not
    overlap), and the kernels it launched; a graphed step replayed (`graphs`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        graphed_step(graphs, model, params, optimizer, inputs, route)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(e.device_time for e in kernels) / 1e6 / wall, len(kernels)  # device_time: microseconds


def table(rows):
    head = (f"{'config':<30} {'s/step':>8} {'img/s':>7} {'MFU':>6} {'HFU':>6} {'recomp':>6} {'ops/step':>9} "
            f"{'kernels':>8} {'alloc':>6} {'resv':>6} {'busy':>5} {'optim s':>8} {'calls':>5}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<30} failed: {r['error']}")
            continue
        memory = f"{r['allocated_gib']:6.2f} {r['reserved_gib']:6.2f}" if "allocated_gib" in r else f"{'-':>6} {'-':>6}"
        gpu = r["busy"] is not None
        busy, kernels = (f"{r['busy']:5.0%}", f"{r['kernels_per_step']:>8,}") if gpu else (f"{'-':>5}", f"{'-':>8}")
        mfu = f"{r['mfu']:6.1%} {r['hfu']:6.1%}" if gpu else f"{'-':>6} {'-':>6}"  # a CPU's width-64 model: no
        ops = f"{r['ops_per_step']:>9,}" if r["ops_per_step"] is not None else f"{'-':>9}"
        lines.append(f"{r['config']:<30} {r['s_per_step']:8.3f} {r['images_per_s']:7.2f} {mfu} "
                     f"{r['recomputed']:>6} {ops} {kernels} {memory} {busy} {r['optimizer_s']:8.3f} "
                     f"{r['optimizer_calls']:>5}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, choices=list(CONFIGS), help="these configurations")
    parser.add_argument("--resolution", type=int, default=None, help="image side (default: 1024 on a GPU, 128 on "
                        "a CPU)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (the first two warm up, and compile)")
    parser.add_argument("--cpu_width", type=int, default=64, help="the transformer's width on a CPU")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a configuration may take")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: this configuration
    args = parser.parse_args(argv)
    resolution = args.resolution or (1024 if torch.cuda.is_available() else 128)
    if args.one:
        print("ROW " + json.dumps(measure(CONFIGS[args.one], resolution, args.steps, args.cpu_width)))
        return
    rows = []
    for name in args.only or list(CONFIGS):  # each in a process of its own: its own peak memory, its own compile
        if CONFIGS[name].graph and not torch.cuda.is_available():
            rows.append({"config": name, "error": "a CUDA GPU captures graphs"})
        else:
            rows.append(run_one(name, resolution, args.steps, args.cpu_width, args.timeout))
        print(table(rows[-1:]).splitlines()[-1] if len(rows) > 1 else table(rows), flush=True)
        if args.json:  # after each row: a run stopped by its time limit keeps the rows it measured
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
    print()
    print(table(rows))


def run_one(name, resolution, steps, cpu_width, timeout):
    """One configuration measured in a process of its own -> its row (or its error)."""
    command = [sys.executable, os.path.abspath(__file__), "--one", name, "--resolution", str(resolution),
               "--steps", str(steps), "--cpu_width", str(cpu_width)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"config": name, "error": f"over {timeout} s"}
    found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    return json.loads(found[0]) if found else \
        {"config": name, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:120]}


if __name__ == "__main__":
    main()
