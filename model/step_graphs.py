"""The whole training step as a CUDA graph (--cuda_graph): captured once per shape of its inputs, then replayed.

At batch 1 a GPU finishes a step's kernels sooner than the host launches them (BENCHMARKS "Fast on the GPU,
measured": 11,654 operations at about 18 µs each). A graph launches the step's forward, loss, backward, clipping
and optimizer step as one (PyTorch's "whole-network capture"; ../shared/REFERENCE.md section 17). The stage's loop
keeps its step in view:

    if not graphs.captured(inputs):
        with graphs.recording(inputs) as static:   # eager; or, at a shape's third step, captured (not yet run)
            ... loss, backward, clipping, the optimizer's step, zero_grad ...
            graphs.outputs(loss, grad_norm, skipped)
    loss, grad_norm, skipped = graphs.run(inputs)  # the captured graph replayed on these inputs; eager: as computed

`inputs` (one dict a micro-batch: model/rectified_flow.flow_inputs, Flow-DPO's pair_inputs) are drawn on the host
as in an eager step and copied into the graph's own buffers, so a graphed step follows the same random streams.
What the graphs keep is made so that any graph may replay after any other: the inputs' and outputs' buffers are
allocated outside the graphs' shared memory pool, the gradients are set to None in the step (the pool then holds
only what a step makes and drops), and the optimizer's state, the learning rate and the adapters' casts exist
before the first capture (the warm-up steps make them). A shape's first WARMUP steps run eagerly on a side stream,
as capture requires.
"""
import contextlib
from collections import Counter

import torch

from model.errors import UserError

WARMUP = 2  # eager steps of a shape before its capture: lazy initialisation (optimizer state, casts, kernels' plans)
LIMIT = 8  # graphs at most; a shape past them runs eagerly (each graph's inputs are buffers of their own)
WAITING = "--cuda_graph auto waits for a GPU run that checks graphed steps against eager ones; 1 turns them on"


def graphs_refusal(device, world_size, blocks_swapped, step_in_backward, routing, dropout_recomputed,
                   compiled_recomputed):
    """-> why this run's step cannot be captured (a phrase), or None."""
    reasons = [(device.type != "cuda", "a CUDA GPU captures graphs, this run has none"),
               (world_size > 1, "several processes (their collectives are not captured here)"),
               (blocks_swapped, "block swap (its copies are timed by the host)"),
               (step_in_backward, "the step in backward (its hooks step each parameter from the host)"),
               (routing, "token routing (its tokens are drawn as an object, not a tensor)"),
               (dropout_recomputed, "LoRA dropout in recomputed blocks (the recompute replays the host's random "
                                    "state)"),
               # model/recompute.compile_block: the compiler keeps a random state for each attention it recomputes,
               # in generators of its own that the host sets at each call; no GPU run has captured that yet
               (compiled_recomputed, "compiled blocks recomputed in backward (the compiler's random states are set "
                                     "by the host; not yet checked under capture)")]
    return next((reason for refused, reason in reasons if refused), None)


def graphs_choice(choice, refusal, device):
    """--cuda_graph (auto, 0, 1) and graphs_refusal's answer -> (on, a line for the log or None). 1 where the step
    cannot be captured: a one-line UserError."""
    if choice == "1":
        if refusal is not None:
            raise UserError(f"--cuda_graph 1: this step cannot be captured: {refusal}; use --cuda_graph 0")
        return True, None
    if choice == "auto" and device.type == "cuda":
        return False, f"CUDA graphs: off ({refusal or WAITING})"
    return False, None


def shape_key(inputs):
    """The inputs' layout, which a graph is captured for: each micro-batch's names, shapes and dtypes."""
    return tuple(tuple((name, None if value is None else (tuple(value.shape), value.dtype))
                       for name, value in sorted(batch.items())) for batch in inputs)


def static_copy(inputs):
    """Buffers of the inputs' own (what the graph reads), filled with them."""
    return [{name: None if value is None else value.clone() for name, value in batch.items()} for batch in inputs]


class StepGraphs:
    """The captured steps of a run, by shape of their inputs, on `device` (--cuda_graph on), or nothing but the
    eager step (`on` False: a CPU, --cuda_graph 0 or auto). `log`: where each capture is said. A stage makes it
    with trainer_utils.run_graphs; bench/bench_throughput.py with its own step."""

    def __init__(self, on, device, log):
        self.on, self.device, self.log = on, device, log
        self.graphs, self.seen = {}, Counter()  # shape -> (graph, its static inputs); shape -> steps it ran
        self.pool = self.kept = self.side = None  # the shared pool; the outputs' buffers; the warm-up stream
        self.last, self.capturing, self.said = None, None, False

    def prepare(self, optimizers):
        """Optimizers a graph can step: their learning rates in tensors on the device, which the stage's set_lr
        fills (a rate held as a number would be fixed in the graph at its capture), and capturable. -> self"""
        if not self.on:
            return self
        for optimizer in optimizers:
            for group in optimizer.param_groups:  # (a resumed rate may be a tensor in host memory: moved too)
                group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32, device=self.device)
                if "capturable" in group:
                    group["capturable"] = True
        return self

    def captured(self, inputs):
        return self.on and shape_key(inputs) in self.graphs

    @contextlib.contextmanager
    def recording(self, inputs):
        """Yields the inputs the step computes from: `inputs` themselves where it runs eagerly, or a capture's
        own buffers (the step is then recorded into a graph, not run: run() replays it)."""
        key = shape_key(inputs) if self.on else None
        if key is not None:
            self.seen[key] += 1
        if key is None or self.seen[key] <= WARMUP or len(self.graphs) >= LIMIT:
            if key is not None and len(self.graphs) >= LIMIT and not self.said:
                self.said = True
                self.log(f"CUDA graphs: {LIMIT} captured, the most kept; steps of other shapes run eagerly")
            with self.warming() if key is not None else contextlib.nullcontext():
                yield inputs
            return
        static, graph = static_copy(inputs), torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        self.capturing = True
        try:
            # thread_local: the data loader's pinning thread may allocate while the step is captured
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                yield static
        finally:
            self.capturing = False
        self.pool = graph.pool()
        self.graphs[key] = (graph, static)
        self.log(f"CUDA graph {len(self.graphs)} of at most {LIMIT} captured: the step of {describe(key)}")

    @contextlib.contextmanager
    def warming(self):
        """A warm-up step on a side stream (capture needs the kernels' lazy set-up done away from its stream)."""
        self.side = self.side or torch.cuda.Stream(self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def outputs(self, *values):
        """The step's results (tensors on the device: scalars, or a few values such as DPO's): kept as they are in
        an eager step; copied into buffers of their own, made in a warm-up step outside the pool, where the step is
        captured."""
        if self.on and not self.capturing and self.kept is None:
            self.kept = [torch.empty_like(value) for value in values]
        if self.capturing:
            for buffer, value in zip(self.kept, values):
                buffer.copy_(value)
            values = self.kept
        self.last = values

    def run(self, inputs):
        """-> the step's outputs: a captured shape's graph replayed on `inputs` (copied into its buffers first),
        its outputs copied for the caller (the next replay overwrites them); else the eager step's, as kept."""
        entry = self.graphs.get(shape_key(inputs)) if self.on else None
        if entry is None:
            return tuple(self.last)
        graph, static = entry
        for batch, buffers in zip(inputs, static):
            for name, value in batch.items():
                if value is not None:
                    buffers[name].copy_(value, non_blocking=True)
        graph.replay()
        return tuple(buffer.clone() for buffer in self.kept)


def describe(key):
    """A shape key as the log says it: micro-batches x latents' shape."""
    latents = dict(key[0]).get("latents")
    return f"{len(key)} micro-batch{'es' if len(key) > 1 else ''} of latents {list(latents[0]) if latents else '?'}"
