"""Block swap: the weights of a model's first blocks held in host memory and copied to the compute device around each
use, so that a small card holds a few blocks at a time instead of every one (the idea of kohya's ModelOffloader and
OneTrainer's LayerOffloadConductor; the code is ours).

    swap = BlockSwap(model.transformer_blocks, 10, device)                   # a frozen base: its first 10 blocks
    swap = BlockSwap(model.transformer_blocks, 10, device, fused.optimizer_of)  # a full fine-tune stepped in backward

Forward: before block i runs, the compute stream waits for its weights (copied on a side stream while block i-1
computed) and the copy of the next swapped block starts; after block i, its tensors point back to host memory and
its buffer is free once the device is done with it. A swapped block must be recomputed in backward (SD3Light
recomputes every swapped block, whatever its gradient checkpointing says), so what backward keeps of it is its
inputs, never a weight. Its backward brings the weights in again, the copy one block ahead, in reverse. In a full
fine-tune stepped in backward (trainer/mechanics/optimizers.py StepInBackward: `optimizers` maps each parameter to
its own optimizer), the optimizer state comes in with the weights for backward, each parameter is stepped while it
is on the device, and weights and state go back to host memory after the block's backward.

Host memory comes in arenas, one allocation for several blocks (torch's pinned-memory cache rounds each allocation
up to a power of two: arenas of a power of two's size waste little; host_arena_bytes says what they take). Device
buffers are reused: a pool per shape of block (SD3.5-Medium's blocks with a second attention, the plain ones, the last
block's context-only one), two buffers a shape at most while streaming. On a CPU the same code runs (host and device
are both the CPU, the copies synchronous, no streams): what the tests check, bit for bit.
"""
import contextlib
import functools

import torch
import torch.nn as nn

from model.errors import UserError

ALIGN = 256  # bytes: every piece of a buffer or arena starts at a multiple of this (what the GPU's kernels like)
ARENA_CAP = 2 ** 32  # bytes: the largest host arena (its copies are made before its blocks' originals go)


# ----------------------------------------------------------------------------------------------------------------
# A tensor as plain pieces (torchao's int8 weights and 8-bit optimizer state are tensor subclasses), laid out in memory


def pieces_of(tensor):
    """-> (plain tensors, how to rebuild the tensor from them): a plain tensor is its own piece (None), a traceable
    subclass its inner tensors."""
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return [tensor.detach()], None
    names, context = tensor.__tensor_flatten__()
    return [getattr(tensor, name) for name in names], (type(tensor), names, context, tensor.size(), tensor.stride())


def rebuilt(pieces, how):
    """The tensor of `pieces` (pieces_of's inverse)."""
    if how is None:
        return pieces[0]
    kind, names, context, size, stride = how
    return kind.__tensor_unflatten__(dict(zip(names, pieces)), context, size, stride)


def aligned(nbytes):
    return -(-nbytes // ALIGN) * ALIGN


def pieces_bytes(pieces):
    """Bytes `pieces` take laid out one after the other, each aligned."""
    return sum(aligned(piece.numel() * piece.element_size()) for piece in pieces)


def views(memory, pieces, offset=0):
    """Typed views of the bytes `memory` (a uint8 tensor) from `offset`, one per piece, of its shape and dtype."""
    out = []
    for piece in pieces:
        size = piece.numel() * piece.element_size()
        out.append(memory[offset:offset + size].view(piece.dtype).view(piece.shape))
        offset += aligned(size)
    return out


def packed(sizes, cap=ARENA_CAP):
    """Byte sizes packed, in order, into arenas whose sizes are powers of two -> [(arena bytes, [indices])]: each the
    largest power of two up to `cap` that the sizes left reach (or the one the next size needs alone), filled while
    they fit. The waste is at most one size an arena."""
    arenas, k = [], 0
    while k < len(sizes):
        left = max(1, sum(sizes[k:]))
        size = max(min(cap, 1 << (left.bit_length() - 1)), 1 << max(0, sizes[k] - 1).bit_length())
        members, used = [], 0
        while k < len(sizes) and used + sizes[k] <= size:
            members.append(k)
            used, k = used + sizes[k], k + 1
        arenas.append((size, members))
    return arenas


def host_arena_bytes(sizes):
    """Host memory blocks of these byte sizes take in arenas (what a run's estimate names)."""
    return sum(size for size, _ in packed([aligned(int(s)) for s in sizes]))


class Slot:
    """One tensor of a swapped block, by where it lives: a module's parameter or buffer, or an optimizer state's
    entry (`owner` a dict). `trained`: a parameter stepped on the device, whose new values are copied home. `home`:
    its pieces in host memory (set by home_slots), `how` rebuilds the tensor from them."""

    def __init__(self, owner, name, trained=False):
        self.owner, self.name, self.trained = owner, name, trained
        self.how, self.home, self.current = pieces_of(self.get())[1], None, None

    def get(self):
        owner = self.owner
        if isinstance(owner, dict):
            return owner[self.name]
        return owner._parameters[self.name] if self.name in owner._parameters else owner._buffers[self.name]

    def put(self, tensor):
        """Make `tensor` what the owner holds under the name: a plain parameter stays the same object (what an
        optimizer and a compiled block know it by) with new data; a tensor subclass, whose data is its inner
        tensors, becomes a parameter of its own."""
        owner = self.owner
        if isinstance(owner, dict):
            owner[self.name] = tensor
        elif self.name in owner._parameters and self.how is None:
            owner._parameters[self.name].data = tensor
        elif self.name in owner._parameters:
            owner._parameters[self.name] = nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[self.name] = tensor

    def go_home(self):
        self.current = rebuilt(self.home, self.how)
        self.put(self.current)


def module_slots(block, trained):
    """The tensors of `block` that stream: every parameter and buffer, but the parameters that train and stay on the
    device (a LoRA's adapters: not `trained`, requiring grad)."""
    slots = []
    for module in block.modules():
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None and not (tensor.requires_grad and not trained):
                slots.append(Slot(module, name, tensor.requires_grad))
    return slots


def slots_bytes(slots):
    return pieces_bytes([piece for slot in slots for piece in slot.home])


# ----------------------------------------------------------------------------------------------------------------
# Device buffers, host arenas, and the copy stream


class Buffer:
    """Device memory for one block's pieces, and the event after which it may be written (None: at once). A new one
    waits for the compute stream: torch's allocator may hand it memory that work queued there still uses."""

    def __init__(self, nbytes, streams):
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=streams.device)
        self.free_after = streams.compute_event()


class Streams:
    """The side stream copies run on (CUDA), or nothing (a CPU: every copy is synchronous, every wait a no-op)."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.copy = torch.cuda.Stream(device) if self.cuda else None

    def compute_event(self):
        """An event at the end of the work queued so far on the compute stream (None on a CPU)."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def copying(self, after=None):
        """A context in which the copies queued run on the side stream, after `after` (an event) if given."""
        if not self.cuda:
            return contextlib.nullcontext()
        if after is not None:
            self.copy.wait_event(after)
        return torch.cuda.stream(self.copy)

    def copied(self):
        return self.copy.record_event() if self.cuda else None

    def compute_waits(self, event):
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def settle(self):
        """The host waits for every copy queued (before it reads host memory the copies write)."""
        if self.cuda:
            self.copy.synchronize()


class HostMemory:
    """Where the swapped tensors live on the host: arenas, pinned where `pin` (a GPU: only pinned memory copies
    asynchronously); where pinning is refused (a container's locked-memory limit), pageable memory and one warning
    through `log`."""

    def __init__(self, pin, log):
        self.pin, self.log, self.arenas = pin, log, []

    def arena(self, nbytes):
        if self.pin:
            try:
                self.arenas.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
                return self.arenas[-1]
            except RuntimeError as e:
                self.pin = False
                self.log(f"warning: pinned host memory is not available ({str(e).splitlines()[0][:120]}): the swapped "
                         "blocks are copied from pageable memory, more slowly; raise the locked-memory limit "
                         "(ulimit -l) to pin them")
        self.arenas.append(torch.empty(nbytes, dtype=torch.uint8))
        return self.arenas[-1]

    def home(self, groups):
        """Give each group of slots (a block's) its pieces' copies in host memory, arena by arena: a group's
        originals go (go_home) as soon as its copies are made."""
        sizes = [pieces_bytes([p for slot in slots for p in pieces_of(slot.get())[0]]) for slots in groups]
        for size, members in packed(sizes):
            memory, offset = self.arena(size), 0
            for k in members:
                for slot in groups[k]:
                    pieces = pieces_of(slot.get())[0]
                    slot.home = views(memory, pieces, offset)
                    for home, piece in zip(slot.home, pieces):
                        home.copy_(piece)
                    offset += pieces_bytes(pieces)
                    slot.go_home()


# ----------------------------------------------------------------------------------------------------------------
# Autograd's side: the block's weights in before its backward, home after it


class BeforeBackward(torch.autograd.Function):
    """Identity on a block's first output; in backward, before the block's: its weights in (and the previous
    block's copy started)."""

    @staticmethod
    def forward(ctx, swap, index, output):
        ctx.swap, ctx.index = swap, index
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.swap.backward_starts(ctx.index)
        return None, None, grad


class AfterBackward(torch.autograd.Function):
    """Identity on a block's first input (and an anchor that requires grad, so that the node is in the graph even
    where the input needs no gradient: a frozen first block); in backward, after the block's: its weights home.
    Autograd runs a backward's nodes on a device newest first (and a parameter's gradient accumulation, with the
    hooks that step it, before anything else): this node, made before the block's, runs after all of them. That is
    torch's engine as it is (a ready queue per device ordered by sequence number), not a documented promise: a
    parameter stepped after its block went home fails loudly (check_held)."""

    @staticmethod
    def forward(ctx, swap, index, anchor, first):
        ctx.swap, ctx.index = swap, index
        return first.view_as(first)

    @staticmethod
    def backward(ctx, grad):
        if ctx.index is not None:
            ctx.swap.backward_ends(ctx.index)
        return None, None, None, grad


def wrapped(function, values, *leading):
    """`values` (a block's arguments or outputs: a tuple, or one tensor) with the first, the hidden states, passed
    through `function` (after `leading` arguments). Only the first: the others (SD3's conditioning vector, which
    every block reads) keep the order in which their gradients add up, so a run with blocks swapped computes bit for
    bit what one without does."""
    single = not isinstance(values, tuple)
    first = values if single else values[0]
    if not (isinstance(first, torch.Tensor) and first.is_floating_point()):
        raise TypeError(f"block swap streams blocks whose first argument and output are hidden states, got "
                        f"{type(first).__name__}")
    first = function.apply(*leading, first)
    return first if single else (first, *values[1:])


# ----------------------------------------------------------------------------------------------------------------
# The swap


class BlockSwap:
    """The first `count` of `blocks` (an nn.ModuleList) held in host memory, each brought to `device` for its use
    (a block's forward, and its recomputed forward and backward); the rest of the model stays on the device. Their
    tensors must be in host memory when it is built (model/loading.py puts them there as it reads the file); what
    trains of them and does not stream (adapters) must be on the device. `optimizers` ({parameter: its optimizer},
    a full fine-tune stepped in backward): their parameters are stepped on the device, weights and state then
    copied home. `log`: where a warning goes (pinned memory refused)."""

    def __init__(self, blocks, count, device, optimizers=None, log=print):
        if not 0 <= count <= len(blocks):
            raise ValueError(f"cannot swap {count} of {len(blocks)} blocks")
        self.blocks, self.count, self.device = blocks, count, torch.device(device)
        self.optimizers, self.streams = optimizers, Streams(self.device)
        self.slots = [module_slots(blocks[i], optimizers is not None) for i in range(count)]
        self.host = HostMemory(self.device.type == "cuda", log)
        with torch.no_grad():
            self.host.home(self.slots)
        # blocks of the same shape share buffers: the shapes and dtypes of their weights, fixed once homed
        self.shapes = [tuple((tuple(p.shape), p.dtype) for slot in slots for p in slot.home) for slots in self.slots]
        self.state_home = {}  # (parameter, key) -> the slot of its optimizer state
        self.pools, self.buffers_made = {}, 0  # shape of a block -> free buffers
        self.loaded, self.held, self.kept = {}, set(), set()  # loaded: block -> (buffer, state slots, copied)
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        for i in range(count):
            blocks[i].register_forward_pre_hook(functools.partial(self.before_forward, i))
            blocks[i].register_forward_hook(functools.partial(self.after_forward, i))
            for param in self.trained_parameters(i):  # before the gradient accumulates and its step runs
                param.register_hook(functools.partial(self.check_held, i))
        if count < len(blocks):  # the first block on the device starts the copy of the last swapped one in backward
            blocks[count].register_forward_hook(functools.partial(self.after_forward, count))

    # -- what the blocks' hooks and autograd's nodes call

    def before_forward(self, index, module, inputs):
        if index in self.held:  # its recompute in backward: the weights are in; its input needs a gradient as it
            # did the first time (the recompute must save what that forward saved), the node does nothing
            return wrapped(AfterBackward, inputs, self, None, self.anchor)
        if index in self.kept:
            return None
        self.bring(index, state=False)
        self.prefetch(index + 1, state=False)
        return wrapped(AfterBackward, inputs, self, index, self.anchor) if torch.is_grad_enabled() else None

    def after_forward(self, index, module, inputs, output):
        if index < self.count:
            if index in self.held or index in self.kept:
                return None
            self.send_home(index, write_back=False)
        return wrapped(BeforeBackward, output, self, index) if torch.is_grad_enabled() else None

    def backward_starts(self, index):
        if index < self.count:
            self.held.add(index)
            if index not in self.kept:
                self.bring(index, state=self.optimizers is not None)
        self.prefetch(index - 1, state=self.optimizers is not None, down=True)

    def backward_ends(self, index):
        self.held.discard(index)
        if index not in self.kept:
            self.send_home(index, write_back=self.optimizers is not None)
        if index == 0 and self.optimizers is not None:
            self.streams.settle()  # the host reads the stepped weights next (the EMA, a save)

    def check_held(self, index, grad):
        if index not in self.held:
            raise RuntimeError(f"block swap: a gradient of block {index} came after its backward had sent it home "
                               "(autograd ran its nodes in an order this torch does not keep)")

    # -- moving a block

    def prefetch(self, index, state, down=False):
        """Start copying the next swapped block that is not in yet (forward: index up; backward: down)."""
        step = -1 if down else 1
        while 0 <= index < self.count and index in self.kept:
            index += step
        if 0 <= index < self.count and index not in self.loaded:
            self.fetch(index, state)

    def fetch(self, index, state, buffer=None):
        """Queue the copy of block `index`'s weights (and, with `state`, its parameters' optimizer state) into a
        buffer of its shape (or `buffer`) on the side stream; the block is `loaded`."""
        states = self.state_slots(index) if state else []
        pieces = [piece for slot in self.slots[index] + states for piece in slot.home]
        buffer = buffer or self.take(self.shape_of(index), pieces_bytes(pieces))
        with torch.no_grad(), self.streams.copying(after=buffer.free_after):
            for view, piece in zip(views(buffer.memory, pieces), pieces):
                view.copy_(piece, non_blocking=self.host.pin)
        buffer.free_after = None
        self.loaded[index] = (buffer, states, self.streams.copied())

    def bring(self, index, state):
        """Block `index` on the device (copied ahead, or now) and its modules (and optimizer state) pointing at it."""
        if index not in self.loaded:
            self.fetch(index, state)
        buffer, states, copied = self.loaded[index]
        self.streams.compute_waits(copied)
        slots = self.slots[index] + states
        in_buffer = iter(views(buffer.memory, [piece for slot in slots for piece in slot.home]))
        for slot in slots:
            slot.put(rebuilt([next(in_buffer) for _ in slot.home], slot.how))

    @torch.no_grad()
    def send_home(self, index, write_back):
        """Block `index`'s tensors pointing at host memory again; with `write_back` (after a fused step) the
        device's weights and optimizer state copied there first. Its buffer is free once the device is done."""
        buffer, states, _ = self.loaded.pop(index)
        after = self.streams.compute_event()
        if write_back:
            with self.streams.copying(after=after):
                for slot in [s for s in self.slots[index] if s.trained] + states:
                    for home, piece in zip(slot.home, pieces_of(slot.get())[0]):
                        home.copy_(piece, non_blocking=self.host.pin)
            after = self.streams.copied()
            self.write_new_state(index, states)
        for slot in self.slots[index] + states:
            slot.go_home()
        if buffer is not None:
            buffer.free_after = after
            self.pools.setdefault(self.shape_of(index), []).append(buffer)
        if torch.is_autocast_enabled(self.device.type):  # autocast's casts of trained fp32 weights: not kept on
            torch.clear_autocast_cache()                   # the device for the rest of the forward

    # -- a fused step's optimizer state

    def trained_parameters(self, index):
        return [slot.owner._parameters[slot.name] for slot in self.slots[index] if slot.trained]

    def streamed_state(self, param):
        """-> (its optimizer's state dict for `param`, the keys of the tensors that move with it): every tensor but
        a step count the optimizer keeps on the host (torch's own do unless fused or capturable; torchao's always)."""
        optimizer = self.optimizers[param]
        state = optimizer.state.get(param, {})
        on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
        return state, [key for key, value in state.items() if isinstance(value, torch.Tensor)
                       and (key != "step" or on_device)]

    def state_slots(self, index):
        """The optimizer state of block `index`'s parameters, as slots homed in host memory: made the first time,
        and again where the optimizer's state was replaced since (a resume loads new tensors)."""
        if self.optimizers is None:
            return []
        slots, new = [], []
        for param in self.trained_parameters(index):
            state, keys = self.streamed_state(param)
            for key in keys:
                slot = self.state_home.get((param, key))
                if slot is None or slot.owner is not state or slot.current is not state[key]:
                    slot = self.state_home[(param, key)] = Slot(state, key)
                    new.append(slot)
                slots.append(slot)
        if new:
            self.host.home([new])  # one arena for the block's state (synchronous: once a run, or a resume)
        return slots

    def write_new_state(self, index, known):
        """Optimizer state the first step made on the device (not among the slots `known`, which came in with the
        block): homed now, in one arena for the block (synchronously: once a run)."""
        known, new = {id(slot) for slot in known}, []
        for param in self.trained_parameters(index):
            state, keys = self.streamed_state(param)
            for key in keys:
                slot = self.state_home.get((param, key))
                if slot is None or id(slot) not in known:
                    new.append(Slot(state, key))
                    self.state_home[(param, key)] = new[-1]
        if new:
            self.host.home([new])

    # -- buffers

    def shape_of(self, index):
        """The pool of buffers block `index` takes from: its weights' shapes and dtypes."""
        return self.shapes[index]

    def take(self, shape, nbytes):
        """A free buffer of `shape`'s pool with room for `nbytes`, or a new one."""
        pool = self.pools.setdefault(shape, [])
        buffer = pool.pop() if pool else None
        if buffer is not None and buffer.memory.numel() < nbytes:  # the optimizer state came: a larger one
            if buffer.free_after is not None:
                buffer.free_after.synchronize()
            buffer = None
        if buffer is None:
            buffer = Buffer(nbytes, self.streams)
            self.buffers_made += 1
        return buffer

    def buffers_needed(self):
        """Device bytes the pools still need to stream every swapped block (two buffers a shape, less what they
        hold)."""
        shapes = {}
        for index in range(self.count):
            shapes.setdefault(self.shape_of(index), []).append(slots_bytes(self.slots[index]))
        return sum(max(0, sum(sizes[:2]) - sum(b.memory.numel() for b in self.pools.get(shape, [])))
                   for shape, sizes in shapes.items())

    # -- sampling with fewer blocks streamed

    @contextlib.contextmanager
    def streaming(self, count):
        """While the context lasts only the first `count` swapped blocks stream; the others are brought in once and
        kept (a no-grad sampler where the card has room for them), in memory of their own, freed after."""
        try:
            for index in range(max(0, count), self.count):
                self.fetch(index, False, Buffer(slots_bytes(self.slots[index]), self.streams))
                self.bring(index, state=False)
                self.kept.add(index)
            yield self
        finally:
            for index in sorted(self.kept):
                self.kept.discard(index)
                _, states, copied = self.loaded[index]
                self.loaded[index] = (None, states, copied)  # its own memory: freed, not pooled
                self.send_home(index, write_back=False)

    def block_bytes(self):
        """The largest swapped block's weights, in bytes: what keeping one on the device takes."""
        return max((slots_bytes(slots) for slots in self.slots), default=0)


def swap_sizes(blocks, count):
    """-> (the size of the first `count` of `blocks` ((size, shape) pairs: parameters or bytes), the size of the
    device buffers they stream through: of each shape among them one block, two where two or more of it stream)."""
    moved, shapes = blocks[:count], {}
    for size, shape in moved:
        shapes.setdefault(shape, []).append(size)
    return sum(size for size, _ in moved), sum(sum(sizes[:2]) for sizes in shapes.values())


def swap_request(asked, sharded, streamable, blocks):
    """--blocks_to_swap as a run of a model of `blocks` blocks can take it -> a count, or "auto"; one line, before any
    work, for what it does not go with. `streamable`: None where the run's weights can stream (a frozen base; a full
    fine-tune stepped in backward), else what to do instead. auto where they cannot (under FSDP, say) is 0."""
    if asked == "auto":
        return "auto" if not sharded and streamable is None else 0
    if asked > blocks:
        raise UserError(f"--blocks_to_swap {asked}: this model has {blocks} blocks; pass at most {blocks}, or auto "
                        "(the fewest for the run to fit the card)")
    if asked and sharded:
        raise UserError("--blocks_to_swap with --fsdp 1 is not supported: FSDP divides the weights over the GPUs "
                        "instead; drop one of the two")
    if asked and streamable is not None:
        raise UserError(f"--blocks_to_swap {asked}: {streamable}")
    return asked
