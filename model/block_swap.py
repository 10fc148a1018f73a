"""Block swap: the weights of a model's first blocks held in host memory and copied to the compute device around each
use, so that a small card holds a few blocks at a time instead of every one (the idea of kohya's ModelOffloader and
OneTrainer's LayerOffloadConductor; the code is ours).

    swap = BlockSwap(model.transformer_blocks, 10, device)                   # a frozen base: its first 10 blocks
    swap = BlockSwap(model.transformer_blocks, 10, device, fused.optimizer_of)  # a full fine-tune stepped in backward

Forward: before block i runs, the compute stream waits for its weights (copied on a side stream while block i-1
computed) and the copy of the next swapped block starts; after block i, its tensors point back to host memory and
its buffer is free once the device is done with it. A swapped block must be recomputed in backward (the model's
gradient checkpointing covers it: model/memory.py's plan sees to it), so what backward keeps of it is its inputs,
never a weight. Its backward brings the weights in again, the copy one block ahead, in reverse. In a full fine-tune
stepped in backward (trainer/mechanics/optimizers.py StepInBackward: `optimizers` maps each parameter to its own
optimizer), the optimizer state comes in with the weights for backward, each parameter is stepped while it is on
the device, and weights and state go back to host memory after the block's backward.

Buffers are reused: one pool per shape of block (SD3.5-Medium's blocks with a second attention, the plain ones, the
last block's context-only one), two buffers a shape at most while streaming. On a CPU the same code runs (host and
device are both the CPU, the copies synchronous, no streams): what the tests check, bit for bit.
"""
import contextlib
import functools

import torch
import torch.nn as nn

from model.errors import UserError

ALIGN = 256  # bytes: every piece of a buffer starts at a multiple of this (what the GPU's kernels like)


# ----------------------------------------------------------------------------------------------------------------
# A tensor as plain pieces (torchao's int8 weights and 8-bit optimizer state are tensor subclasses)


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


def piece_bytes(piece):
    return -(-piece.numel() * piece.element_size() // ALIGN) * ALIGN


def host_copy(piece, pin):
    """A piece in host memory of its own, pinned where `pin` (a CUDA run: only pinned memory copies asynchronously)."""
    host = piece.detach().to("cpu", copy=True)
    return host.pin_memory() if pin else host


class Slot:
    """One tensor of a swapped block, by where it lives: a module's parameter or buffer, or an optimizer state's
    entry (`owner` a dict). `trained`: a parameter that is stepped on the device (its object stays, its data moves).
    `home`: its pieces in host memory and how they rebuild it."""

    def __init__(self, owner, name, trained, pin):
        self.owner, self.name, self.trained = owner, name, trained
        pieces, self.how = pieces_of(self.get())
        self.home, self.current = [host_copy(piece, pin) for piece in pieces], None

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


def module_slots(block, trained, pin):
    """The tensors of `block` that stream: every parameter and buffer, but the parameters that train and stay on the
    device (a LoRA's adapters: not `trained`, requiring grad), which are moved to the device once instead."""
    slots = []
    for module in block.modules():
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None:
                continue
            if tensor.requires_grad and not trained:
                continue
            slots.append(Slot(module, name, tensor.requires_grad, pin))
    return slots


# ----------------------------------------------------------------------------------------------------------------
# Device buffers and the copy stream


class Buffer:
    """Device memory for one block's pieces, and the event after which it may be written again (None: at once)."""

    def __init__(self, nbytes, device):
        self.memory, self.free_after = torch.empty(nbytes, dtype=torch.uint8, device=device), None

    def views(self, pieces):
        """Typed views of the buffer, one per piece (same shape and dtype), laid out in order."""
        views, offset = [], 0
        for piece in pieces:
            size = piece.numel() * piece.element_size()
            views.append(self.memory[offset:offset + size].view(piece.dtype).view(piece.shape))
            offset += piece_bytes(piece)
        return views


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


# ----------------------------------------------------------------------------------------------------------------
# Autograd's side: the block's weights in before its backward, home after it


class BeforeBackward(torch.autograd.Function):
    """Identity on a block's outputs; in backward, before the block's: its weights in (and the previous block's
    copy started)."""

    @staticmethod
    def forward(ctx, swap, index, *outputs):
        ctx.swap, ctx.index = swap, index
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.swap.backward_starts(ctx.index)
        return (None, None, *grads)


class AfterBackward(torch.autograd.Function):
    """Identity on a block's inputs (and an anchor that requires grad, so that the node is in the graph even where
    the inputs need no gradient: a frozen first block); in backward, after the block's: its weights home."""

    @staticmethod
    def forward(ctx, swap, index, anchor, *inputs):
        ctx.swap, ctx.index = swap, index
        return tuple(i.view_as(i) for i in inputs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.index is not None:
            ctx.swap.backward_ends(ctx.index)
        return (None, None, None, *grads)


def wrapped(function, swap, index, values, *extra):
    """`values` (a block's arguments or outputs: a tuple, or one tensor) with the first, the hidden states, passed
    through `function`. Only the first: the others (SD3's conditioning vector, which every block reads) keep the
    order in which their gradients add up, so a run with blocks swapped computes bit for bit what one without does.
    Autograd runs a backward's nodes in the reverse order of their making, so the node on a block's first input
    runs after every node of that block, whatever else it reads."""
    single = not isinstance(values, tuple)
    first = values if single else values[0]
    if not (isinstance(first, torch.Tensor) and first.is_floating_point()):
        return None
    first, = function.apply(swap, index, *extra, first)
    return first if single else (first, *values[1:])


# ----------------------------------------------------------------------------------------------------------------
# The swap


class BlockSwap:
    """The first `count` of `blocks` (an nn.ModuleList) held in host memory, each brought to `device` for its use
    (a block's forward, and its recomputed forward and backward); the rest of the model stays on the device. Their
    weights must be in host memory when it is built (model/loading.py puts them there as it reads the file); what
    trains of them and does not stream (adapters) is moved to the device here. `optimizers` ({parameter: its
    optimizer}, a full fine-tune stepped in backward): their parameters are stepped on the device, weights and
    state then copied home. `pin`: host memory pinned (CUDA; None: when the device is a GPU); where pinning fails,
    pageable memory and one warning through `log`."""

    def __init__(self, blocks, count, device, optimizers=None, log=print):
        if not 0 <= count <= len(blocks):
            raise ValueError(f"cannot swap {count} of {len(blocks)} blocks")
        self.blocks, self.count, self.device = blocks, count, torch.device(device)
        self.optimizers, self.streams = optimizers, Streams(self.device)
        pin = self.device.type == "cuda" and pinnable(log)
        self.slots = [module_slots(blocks[i], optimizers is not None, pin) for i in range(count)]
        self.pin, self.state_home = pin, {}  # (parameter, key) -> the pieces of its optimizer state at home
        self.pools, self.buffers_made = {}, 0  # shape of a block -> free buffers
        self.loaded, self.held, self.kept = {}, set(), {}  # block -> (its buffer, the state slots it brought)
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        with torch.no_grad():
            for i in range(count):
                for p in blocks[i].parameters():
                    if p.requires_grad and optimizers is None:  # adapters: on the device for good
                        p.data = p.data.to(self.device)
                for slot in self.slots[i]:
                    slot.go_home()
        self.hooks = []
        for i in range(count):
            self.hooks.append(blocks[i].register_forward_pre_hook(functools.partial(self.before_forward, i)))
            self.hooks.append(blocks[i].register_forward_hook(functools.partial(self.after_forward, i)))
        if count < len(blocks):  # the first block on the device starts the copy of the last swapped one in backward
            self.hooks.append(blocks[count].register_forward_hook(functools.partial(self.after_forward, count)))

    # -- what the blocks' hooks and autograd's nodes call

    def before_forward(self, index, module, args):
        if index in self.held:  # its recompute in backward: the weights are in; its inputs need a gradient as they
            # did the first time (the recompute must save what that forward saved), the node does nothing
            return wrapped(AfterBackward, self, None, args, self.anchor)
        if index in self.kept:
            return None
        self.bring(index, state=False)
        self.prefetch(index + 1, state=False)
        if torch.is_grad_enabled():
            return wrapped(AfterBackward, self, index, args, self.anchor)
        return None

    def after_forward(self, index, module, args, output):
        if index < self.count:
            if index in self.held or index in self.kept:
                return None
            self.send_home(index, write_back=False)
        if torch.is_grad_enabled():
            return wrapped(BeforeBackward, self, index, output)
        return None

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
        buffer of its shape (or `buffer`) on the side stream -> (the buffer, the state slots)."""
        states = self.state_slots(index) if state else []
        slots = self.slots[index] + states
        pieces = [piece for slot in slots for piece in slot.home]
        nbytes = sum(piece_bytes(piece) for piece in pieces)
        buffer = buffer or self.take(self.shape_of(index), nbytes)
        with torch.no_grad(), self.streams.copying(after=buffer.free_after):
            for view, piece in zip(buffer.views(pieces), pieces):
                view.copy_(piece, non_blocking=self.pin)
        buffer.free_after = None
        self.loaded[index] = (buffer, states, self.streams.copied())
        return self.loaded[index]

    def bring(self, index, state):
        """Block `index` on the device (copied ahead, or now) and its modules (and optimizer state) pointing at it."""
        if index not in self.loaded:
            self.fetch(index, state)
        buffer, states, copied = self.loaded[index]
        self.streams.compute_waits(copied)
        slots = self.slots[index] + states
        views = iter(buffer.views([piece for slot in slots for piece in slot.home]))
        for slot in slots:
            slot.put(rebuilt([next(views) for _ in slot.home], slot.how))

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
                        home.copy_(piece, non_blocking=self.pin)
            after = self.streams.copied()
            self.write_new_state(index, states)
        for slot in self.slots[index] + states:
            slot.go_home()
        if buffer is not None:
            buffer.free_after = after
            self.pools.setdefault(self.shape_of(index), []).append(buffer)

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
        """The optimizer state of block `index`'s parameters, as slots: made the first time, and again where the
        optimizer's state was replaced since (a resume loads new tensors)."""
        if self.optimizers is None:
            return []
        slots = []
        for param in self.trained_parameters(index):
            state, keys = self.streamed_state(param)
            for key in keys:
                slot = self.state_home.get((param, key))
                if slot is None or slot.owner is not state or slot.current is not state[key]:
                    slot = self.state_home[(param, key)] = Slot(state, key, False, self.pin)
                slots.append(slot)
        return slots

    def write_new_state(self, index, known):
        """Optimizer state the first step made on the device (not among the slots `known`): copied home, a slot of
        its own from now on (synchronously: once a run)."""
        known = {id(slot) for slot in known}
        for param in self.trained_parameters(index):
            state, keys = self.streamed_state(param)
            for key in keys:
                slot = self.state_home.get((param, key))
                if slot is None or id(slot) not in known:
                    slot = self.state_home[(param, key)] = Slot(state, key, False, self.pin)
                    slot.go_home()

    def shape_of(self, index):
        """Blocks of the same shape share buffers: the shapes and dtypes of their weights."""
        return tuple((tuple(p.shape), p.dtype) for slot in self.slots[index] for p in slot.home)

    def take(self, shape, nbytes):
        """A free buffer of `shape`'s pool with room for `nbytes`, or a new one."""
        pool = self.pools.setdefault(shape, [])
        buffer = pool.pop() if pool else None
        if buffer is not None and buffer.memory.numel() < nbytes:  # the optimizer state came: a larger one
            if buffer.free_after is not None:
                buffer.free_after.synchronize()
            buffer = None
        if buffer is None:
            buffer = Buffer(nbytes, self.device)
            self.buffers_made += 1
        return buffer

    # -- sampling with fewer blocks streamed, and what it all takes

    @contextlib.contextmanager
    def streaming(self, count):
        """While the context lasts only the first `count` swapped blocks stream; the others are brought in once and
        kept (a no-grad sampler where the card has room for them)."""
        kept = range(max(0, count), self.count)
        try:
            for index in kept:
                nbytes = sum(piece_bytes(p) for slot in self.slots[index] for p in slot.home)
                self.kept[index] = self.fetch(index, False, Buffer(nbytes, self.device))
                self.bring(index, state=False)
            yield self
        finally:
            for index in list(self.kept):
                self.kept.pop(index)
                buffer, states, copied = self.loaded[index]
                self.loaded[index] = (None, states, copied)  # its own memory: freed, not pooled
                self.send_home(index, write_back=False)

    def block_bytes(self):
        """The largest swapped block's weights, in bytes: what keeping one on the device takes."""
        return max((sum(piece_bytes(p) for slot in slots for p in slot.home) for slots in self.slots), default=0)

    def host_bytes(self):
        """Host memory the swapped blocks hold (their weights, and the optimizer state written home)."""
        slots = [slot for slots in self.slots for slot in slots] + list(self.state_home.values())
        return sum(p.numel() * p.element_size() for slot in slots for p in slot.home)

    def buffer_bytes(self):
        return sum(b.memory.numel() for pool in self.pools.values() for b in pool)


def pinnable(log):
    """Whether pinned host memory can be had (a container's locked-memory limit can refuse it): else one warning,
    and the copies go from pageable memory (synchronous, slower)."""
    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        return True
    except RuntimeError as e:
        log(f"warning: pinned host memory is not available ({str(e).splitlines()[0][:120]}): the swapped blocks are "
            "copied from pageable memory, more slowly; raise the locked-memory limit (ulimit -l) to pin them")
        return False


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
