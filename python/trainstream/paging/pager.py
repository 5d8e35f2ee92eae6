"""Weight paging at run time: the paged blocks' parameters live in host memory (the daemon's copy:
the upload region, the fp32 master weights in place, or the job's frozen region) and visit the GPU
one block at a time, in a bounded pool of slots (the design document, "Weight paging").

    forward:  block k's pre-hook loads k (if it is not in a slot), makes the compute stream wait for
              its copy, and prefetches k+1..k+depth on a copy stream; its post-hook drops autocast's
              cached casts, so they do not keep every block's weights alive
    backward: a saved tensor that is (a view of) a paged weight, or autocast's cast of one, was packed
              as a reference and is fetched again here: block k is loaded if it had to leave, and
              k-1..k-depth are prefetched

Invariants:
- a paged parameter's `.data` is a view of its block's slot while the block is loaded, else a
  placeholder of its shape (one element, expanded), both in its job dtype (`PagedTensor.dtype`: its own,
  or autocast's for a float32 Linear weight paged with page_dtype); everything that reads paged weights goes
  through `use()` first (block hooks, the read guard, saved-tensor unpacking, state_dict);
- a slot is overwritten only after the kernels queued so far that read it have run: eviction records
  an event on the compute stream, and the copy stream waits for it before the next load;
- a block's host copy is read only once the daemon has published its buckets' weights of the step the
  model must show (the rank's `wait` for them);
- autograd keeps no reference into a slot from one block to another: saved paged weights are packed
  as (block, offset, shape, stride) and re-fetched on unpack.
On the CPU (used by the tests) the same code runs with synchronous copies and no streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from trainstream._C import TrainstreamError

_ALIGN = 512  # bytes; every range starts aligned in its slot, so views of any dtype are aligned too


@dataclass
class HostRange:
    """Bytes of one block's host copy that are copied in one piece, and where they go in its slot.
    `source()` gives them at the time of the copy (uint8, contiguous: a view of the job's shared memory);
    `copies()` every place source() may give over training (both state halves of fp32 master weights),
    for page-locking."""
    source: Callable[[], torch.Tensor]
    nbytes: int
    slot_offset: int
    frozen: bool = False  # the job's frozen region (else a bucket's weights)
    all_copies: Callable[[], list[torch.Tensor]] | None = None

    def copies(self) -> list[torch.Tensor]:
        return self.all_copies() if self.all_copies is not None else [self.source()]


@dataclass
class PagedTensor:
    param: nn.Parameter
    slot_offset: int  # bytes into the block's slot
    dtype: torch.dtype  # in the slot: the job's (autocast's for a float32 weight paged in it)


@dataclass
class BlockCopy:
    """What loading one block means: its ranges, its parameters' places, the buckets whose published
    weights it must wait for (none for frozen weights)."""
    index: int
    name: str
    module: nn.Module
    ranges: list[HostRange]
    tensors: list[PagedTensor]
    buckets: tuple[int, ...]
    autocast_dtype: torch.dtype | None = None  # its forward must run under it: it holds weights paged in it

    @property
    def nbytes(self) -> int:
        return max((r.slot_offset + r.nbytes for r in self.ranges), default=0)


class WeightGate:
    """What the pager asks the rank before it reads a block's host copy (see Rank)."""

    def wait(self, buckets: tuple[int, ...]) -> None:
        """Blocks until the buckets' weights of the step the model must show are published."""

    def ready(self, buckets: tuple[int, ...]) -> bool:
        """Whether wait() would return at once."""
        return True

    def generation(self, buckets: tuple[int, ...]) -> int:
        """Changes whenever the buckets' weights do (optimizer.step(), a state load)."""
        return 0


def align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class BlockPager:
    def __init__(self, blocks: list[BlockCopy], device: torch.device, gate: WeightGate, prefetch: int = 2,
                 pool_bytes: int | None = None, pins=None):
        """`pins`: a HostPins (paging/host_pins.py) with one group per block, in `blocks`' order, that a block's
        first copy waits for."""
        if prefetch < 0:
            raise TrainstreamError(f"page_prefetch must be >= 0, not {prefetch}")
        self.blocks = {b.index: b for b in blocks}
        self.order = sorted(self.blocks)
        self.device = device
        self.gate = gate
        self.pins = pins
        self.prefetch = prefetch
        self.slot_bytes = align(max((b.nbytes for b in blocks), default=1))
        slots = prefetch + 1 if pool_bytes is None else pool_bytes // self.slot_bytes
        largest = max(blocks, key=lambda b: b.nbytes)
        if pool_bytes is not None and pool_bytes < self.slot_bytes:
            raise TrainstreamError(f"block {largest.index} ({largest.name}) needs {largest.nbytes / 2**20:.1f} MiB on "
                                   f"the GPU, but the paging pool holds {pool_bytes / 2**20:.1f} MiB (page_pool_mb)")
        if slots < 2:
            raise TrainstreamError(f"the paging pool holds {slots} block of {self.slot_bytes / 2**20:.1f} MiB: it "
                                   "needs room for two (the block computing and the next one loading); raise "
                                   + ("page_pool_mb" if pool_bytes is not None else "page_prefetch to 1 or more"))
        slots = min(slots, max(2, len(blocks)))  # a slot more than the blocks would never be used
        self._check_fits(slots, device, "page_prefetch" if pool_bytes is None else "page_pool_mb")
        self.pool = torch.empty(slots * self.slot_bytes, dtype=torch.uint8, device=device)
        self.slot_of: dict[int, int] = {}        # block -> slot it occupies
        self.in_slot: list[int | None] = [None] * slots
        self.loaded_generation: dict[int, int] = {}
        self.loaded_event: dict[int, object] = {}
        self.free_event: list[object] = [None] * slots
        self.entered: list[int] = []             # blocks whose forward runs (nested calls)
        self.last_used: int | None = None
        self.loads = 0                           # block copies issued (benchmarks and tests read it)
        self.loaded_bytes = 0
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._param_block = {id(t.param): b.index for b in blocks for t in b.tensors}
        self._typed_pool: dict[torch.dtype, torch.Tensor] = {}
        for b in blocks:
            for t in b.tensors:
                t.param.data = self._placeholder(t)

    def _check_fits(self, slots: int, device: torch.device, option: str) -> None:
        """Refuses a pool bigger than the device's free memory, naming the option that sized it, before
        allocating (a CUDA out-of-memory error would not say which option to change)."""
        if device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(device)
        if slots * self.slot_bytes > free:
            raise TrainstreamError(f"the paging pool of {slots} blocks of {self.slot_bytes / 2**20:.1f} MiB needs "
                                   f"{slots * self.slot_bytes / 2**30:.2f} GiB on {device}, which has "
                                   f"{free / 2**30:.2f} GiB free: lower {option}")

    # ----- what blocks hold -----

    def block_of(self, param: torch.Tensor) -> int | None:
        return self._param_block.get(id(param))

    def _placeholder(self, t: PagedTensor) -> torch.Tensor:
        one = self._placeholders.get(t.dtype)
        if one is None:
            one = self._placeholders[t.dtype] = torch.zeros(1, dtype=t.dtype, device=self.device)
        return one.expand(t.param.shape)

    def _slot_view(self, slot: int, offset: int, dtype: torch.dtype, size, stride) -> torch.Tensor:
        typed = self._typed_pool.get(dtype)
        if typed is None:
            typed = self._typed_pool[dtype] = self.pool.view(dtype)
        itemsize = typed.element_size()
        return typed.as_strided(size, stride, (slot * self.slot_bytes + offset) // itemsize)

    def _current(self, k: int) -> bool:
        return k in self.slot_of and self.loaded_generation.get(k) == self.gate.generation(self.blocks[k].buckets)

    # ----- loading -----

    def use(self, k: int) -> None:
        """Block k's weights are in its slot for the kernels queued from now on."""
        if not self._current(k):
            slot = self._slot_for(k)
            self._load(k, slot)
        self._wait_loaded(k)
        self.last_used = k

    def _slot_for(self, k: int) -> int:
        """Where block k loads: the slot it holds with outdated weights, else a victim's; a block whose
        forward runs is evicted only when nothing else can be (it loads again when read again)."""
        if k in self.slot_of:
            return self.slot_of[k]
        backward = _in_backward()
        slot = self._victim_slot({k, *self.entered}, backward=backward)
        return slot if slot is not None else self._victim_slot({k}, backward=backward)

    def prefetch_after(self, k: int, backward: bool) -> None:
        """Loads the next `prefetch` blocks in the direction of travel whose weights are published
        already (a wait for the others would hold back the kernels of block k)."""
        position = self.order.index(k)
        step = -1 if backward else 1
        protect = {k, *self.entered}
        for i in range(1, self.prefetch + 1):
            j = position + step * i
            if not 0 <= j < len(self.order):
                break
            block = self.order[j]
            protect.add(block)
            if self._current(block) or not self.gate.ready(self.blocks[block].buckets):
                continue
            slot = self.slot_of[block] if block in self.slot_of else self._victim_slot(protect, k, backward)
            if slot is None:
                break
            self._load(block, slot)

    def _victim_slot(self, protect: set[int], at: int | None = None, backward: bool = False) -> int | None:
        """A free slot, else the slot of the loaded block farthest behind the direction of travel (done
        with for this pass), else the one farthest ahead; None when every slot holds a protected block."""
        for s, block in enumerate(self.in_slot):
            if block is None:
                return s
        at = self.last_used if at is None else at
        candidates = [b for b in self.slot_of if b not in protect]
        if not candidates:
            return None
        if at is None:
            return self.slot_of[candidates[0]]
        position = {b: i for i, b in enumerate(self.order)}
        here = position[at]

        def behind(b: int) -> int:  # > 0: already passed in this direction
            return (position[b] - here) if backward else (here - position[b])
        victim = max(candidates, key=behind)
        return self.slot_of[victim]

    def _load(self, k: int, slot: int) -> None:
        block = self.blocks[k]
        self.gate.wait(block.buckets)
        self._evict_slot(slot)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(compute) if self.free_event[slot] is None else \
                self.copy_stream.wait_event(self.free_event[slot])
            with torch.cuda.stream(self.copy_stream):
                self._copy_ranges(block, slot)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            self.loaded_event[k] = event
        else:
            self._copy_ranges(block, slot)
        self.slot_of[k] = slot
        self.in_slot[slot] = k
        self.loaded_generation[k] = self.gate.generation(block.buckets)
        for t in block.tensors:
            p = t.param
            p.data = self._slot_view(slot, t.slot_offset, t.dtype, p.shape, _contiguous_strides(p.shape))
        self.loads += 1
        self.loaded_bytes += block.nbytes

    def _copy_ranges(self, block: BlockCopy, slot: int) -> None:
        if self.pins is not None:
            self.pins.wait(self.order.index(block.index))
        base = slot * self.slot_bytes
        for r in block.ranges:
            host = r.source()
            at = base + r.slot_offset
            # A copy may not span two page-locked registrations: cut where they meet.
            parts = self.pins.split(host.data_ptr(), r.nbytes) if self.pins is not None else [(0, r.nbytes)]
            for offset, nbytes in parts:
                self.pool[at + offset:at + offset + nbytes].copy_(host[offset:offset + nbytes], non_blocking=self.cuda)

    def _wait_loaded(self, k: int) -> None:
        event = self.loaded_event.get(k)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _evict_slot(self, slot: int) -> None:
        k = self.in_slot[slot]
        if k is None:
            return
        for t in self.blocks[k].tensors:
            t.param.data = self._placeholder(t)
        del self.slot_of[k]
        self.in_slot[slot] = None
        self.loaded_event.pop(k, None)
        if self.cuda:  # the kernels queued so far may still read the slot
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.free_event[slot] = event

    def refresh_loaded(self) -> None:
        """The blocks in slots show their current weights (after optimizer.step(), say): what can be
        read of the paged parameters outside a forward is never outdated, only absent."""
        for k in list(self.slot_of):
            if not self._current(k):
                self._load(k, self.slot_of[k])

    def evict_all(self) -> None:
        for slot in range(len(self.in_slot)):
            self._evict_slot(slot)

    def release_all(self) -> None:
        """Every paged parameter becomes its placeholder again (after it pointed elsewhere)."""
        self.evict_all()
        for block in self.blocks.values():
            for t in block.tensors:
                t.param.data = self._placeholder(t)

    # ----- block hooks -----

    def enter(self, k: int) -> None:
        self._check_autocast(self.blocks[k])
        self.use(k)
        self.entered.append(k)
        self.prefetch_after(k, backward=_in_backward())

    def _check_autocast(self, block: BlockCopy) -> None:
        """A float32 weight paged in autocast's dtype gives the results of the float32 one only where
        autocast casts it so: under any other mode its forward would compute something else."""
        wanted, kind = block.autocast_dtype, self.device.type
        if wanted is None or torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == wanted:
            return
        running = f"under torch.autocast({kind!r}, dtype={torch.get_autocast_dtype(kind)})" \
            if torch.is_autocast_enabled(kind) else "without autocast"
        dtype = str(wanted).removeprefix("torch.")
        raise TrainstreamError(f"block {block.index} ({block.name}) runs {running}, but page_dtype={dtype!r} pages "
                               f"its Linear weights in {dtype}: run its forward under torch.autocast({kind!r}, "
                               f"dtype=torch.{dtype}), or wrap without page_dtype")

    def leave(self, k: int) -> None:
        if self.entered and self.entered[-1] == k:
            self.entered.pop()
        if torch.is_autocast_enabled(self.device.type):
            # Autocast caches the cast of every weight until the autocast region ends; paged weights'
            # casts are re-made on unpack, so the cache need not keep them (every block's otherwise).
            torch.clear_autocast_cache()

    # ----- saved tensors -----

    def pack(self, t: torch.Tensor):
        """A reference for a saved tensor that is (a view of) a paged weight or autocast's cast of a
        whole paged weight; None for anything else."""
        if t.device != self.device or t.numel() == 0:
            return None
        if t.untyped_storage().data_ptr() == self.pool.untyped_storage().data_ptr():
            offset = t.data_ptr() - self.pool.data_ptr()
            slot = offset // self.slot_bytes
            block = self.in_slot[slot]
            if block is None:
                return None
            return _SlotRef(block, offset - slot * self.slot_bytes, t.dtype, tuple(t.shape), t.stride())
        base = t if t._base is None else t._base
        node = base.grad_fn
        if node is None or node.name() != "ToCopyBackward0" or not base.is_contiguous():
            return None
        source = getattr(node.next_functions[0][0], "variable", None) if node.next_functions else None
        k = self._param_block.get(id(source)) if source is not None else None
        if k is None or tuple(base.shape) != tuple(source.shape):
            return None
        return _CastRef(k, source, base.dtype, t.storage_offset() - base.storage_offset(), tuple(t.shape), t.stride())

    def unpack(self, ref) -> torch.Tensor:
        self.use(ref.block)
        self.prefetch_after(ref.block, backward=True)
        if isinstance(ref, _SlotRef):
            return self._slot_view(self.slot_of[ref.block], ref.offset, ref.dtype, ref.size, ref.stride)
        with torch.no_grad():
            cast = ref.param.detach().to(ref.dtype)
        return cast.as_strided(ref.size, ref.stride, cast.storage_offset() + ref.offset)

    def close(self) -> None:
        self.evict_all()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy reads the host copies any more
        if self.pins is not None:
            self.pins.close()


def block_copies(plan, regions) -> list[BlockCopy]:
    """What loading each paged block of `plan` (paging/blocks.py's PagingPlan) copies: its buckets' weights (each
    paged block's trainable parameters fill buckets of their own) and its frozen parameters, which lie
    one after another in the frozen region."""
    index = {id(p): i for i, p in enumerate(regions.params)}
    frozen_index = {id(p): j for j, (_, p) in enumerate(plan.frozen)}
    copies = []
    for block in plan.blocks:
        ranges, tensors, offset = [], [], 0
        buckets = tuple(sorted({regions.bucket_of[index[id(p)]] for p in block.trainable}))
        for b in buckets:
            nbytes = regions.bucket_weights(b).numel()
            ranges.append(HostRange(lambda b=b: regions.bucket_weights(b), nbytes, offset,
                                    all_copies=lambda b=b: regions.bucket_weight_copies(b)))
            for i in regions.bucket_params[b]:
                dtype = regions.dtypes[i]
                tensors.append(PagedTensor(regions.params[i], offset + regions.param_layout[i][1] * dtype.itemsize,
                                           dtype))
            offset = align(offset + nbytes)
        if block.frozen:
            first = frozen_index[id(block.frozen[0])]
            last = first + len(block.frozen)
            nbytes = regions.frozen_bytes(first, last).numel()
            ranges.append(HostRange(lambda f=first, t=last: regions.frozen_bytes(f, t), nbytes, offset, frozen=True))
            base = regions.frozen_offsets[first]
            for j in range(first, last):
                p = plan.frozen[j][1]
                tensors.append(PagedTensor(p, offset + regions.frozen_offsets[j] - base, p.dtype))
        autocast = plan.page_dtype if any(id(p) in plan.paged_as for p in block.trainable) else None
        copies.append(BlockCopy(block.index, block.name, block.module, ranges, tensors, buckets, autocast))
    return copies


class PagingHooks:
    """The pager installed on a model: each paged block's forward hooks, and saved-tensor hooks around
    the model's forward that pack paged weights as references (tensors they do not take go to the
    saved-tensor hooks in force outside, activation_paging() for instance)."""

    def __init__(self, pager: BlockPager, model: nn.Module):
        self.pager = pager
        self.depth = 0
        self.context = None
        self.outer = None
        self.handles = []
        for k, block in pager.blocks.items():
            self.handles.append(block.module.register_forward_pre_hook(lambda m, args, k=k: pager.enter(k)))
            self.handles.append(block.module.register_forward_hook(lambda m, args, out, k=k: pager.leave(k),
                                                                   always_call=True))
        self.handles.append(model.register_forward_pre_hook(lambda m, args: self._forward_starts(), prepend=True))
        self.handles.append(model.register_forward_hook(lambda m, args, out: self._forward_ends(), always_call=True))
        _ACTIVE.append(pager)

    def _forward_starts(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            self.context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.context.__enter__()

    def _forward_ends(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def _pack(self, t: torch.Tensor):
        ref = self.pager.pack(t)
        if ref is not None:
            return ref
        if self.outer is not None:
            return _Outer(self.outer[1], self.outer[0](t))
        return t

    def _unpack(self, packed):
        if isinstance(packed, (_SlotRef, _CastRef)):
            return self.pager.unpack(packed)
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        return packed

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.pager in _ACTIVE:
            _ACTIVE.remove(self.pager)


_ACTIVE: list[BlockPager] = []  # installed pagers, for other saved-tensor hooks (activation_paging)


def reference(t: torch.Tensor):
    """(pager, reference) when `t` is (a view or cast of) a weight some installed pager pages."""
    for pager in _ACTIVE:
        ref = pager.pack(t)
        if ref is not None:
            return pager, ref
    return None


class _Outer:
    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack, self.packed = unpack, packed


class _SlotRef:
    __slots__ = ("block", "offset", "dtype", "size", "stride")

    def __init__(self, block, offset, dtype, size, stride):
        self.block, self.offset, self.dtype, self.size, self.stride = block, offset, dtype, size, stride


class _CastRef:
    __slots__ = ("block", "param", "dtype", "offset", "size", "stride")

    def __init__(self, block, param, dtype, offset, size, stride):
        self.block, self.param, self.dtype, self.offset, self.size, self.stride = block, param, dtype, offset, size, \
            stride


def _in_backward() -> bool:
    """Whether autograd is running a backward node on this thread (a checkpointed block recomputed)."""
    return torch._C._current_autograd_node() is not None


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, running = [], 1
    for n in reversed(shape):
        strides.append(running)
        running *= max(n, 1)
    return tuple(reversed(strides))
