"""Guards that keep the wrapped model consistent with the rank's view of it.

StaleReadGuard — a forward that reads a parameter outside its module's pre-hook (a parent using a
    child's weight directly) still sees the last step's weights: the parameter is refreshed when a
    torch function first gets it.
ApplyGuard — `module.to()`, `.cuda()`, `.half()`, ... after wrap: a conversion that gives the wrapped
    parameters another dtype, device or storage goes to the rank's `relayout` (wrap's: the job is
    attached again in the new layout, its fp32 master weights and moments unchanged), or is refused.

Both take the Rank (_rank.py) and use only its `model`, `params`, `take_published()`, `take_all()`,
`compiled_forward`, `synchronize()`, `relayout` and its WeightReads' `needs_read_guard()` and
`refresh_read()` (_weight_reads.py).
Invariants: a torch function of the model's forward never reads a stale wrapped parameter, nor a paged
one whose block is not in its slot; a conversion that cannot be done is refused before anything changes.
"""

from __future__ import annotations

import threading
import types
import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from trainstream._C import TrainstreamError
from trainstream._watched import internal


class StaleReadGuard(TorchFunctionMode):
    """While the wrapped model's forward runs with some bucket still stale, looks at the arguments of
    every torch function and refreshes the stale parameters among them first: a forward may read a
    parameter before any pre-hook of its module ran (`x @ self.proj.weight.t()` in a parent's forward,
    a weight read before its module is called), and must see the same weights as in plain torch. The
    mode costs each torch function about 1 us of Python while it is entered, 2 us while something is
    stale (2-core dev machine), so it is entered only while needed: at the forward's start the buckets
    published already are taken in (where the GPU waits for weights, every stale bucket), and the mode
    is not entered when nothing is left stale; the Rank's
    pre-hooks pause it while they refresh, and it stays left once nothing is stale. With weight paging
    it is always entered: a paged weight read outside its block's forward loads the block."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.reads = rank.reads
        self.depth = 0  # nested forwards of the model; entered at the outermost one
        self.entered = False
        # Closures, not bound methods: copy.deepcopy(model) copies bound methods with their object.
        # First of the pre-hooks (another one may raise) and called however the forward ends.
        self.handles = [rank.model.register_forward_pre_hook(lambda module, args: self._forward_starts(),
                                                             prepend=True),
                        rank.model.register_forward_hook(lambda module, args, output: self._forward_ends(),
                                                         always_call=True)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.reads.needs_read_guard():
            self.reads.refresh_read(args, kwargs)
        return func(*args, **kwargs)

    def _forward_starts(self) -> None:
        if torch.compiler.is_compiling():  # traced: a compiled forward (_compile.py)
            if not self.rank.compiled_forward:  # Dynamo guards on it: no prologue ran (a compiled caller)
                _take_all_outside_graph(self.rank)
            return
        self.depth += 1
        if self.depth == 1:
            self.rank.take_published()
            if self.reads.needs_read_guard():
                self.__enter__()
                self.entered = True

    def _forward_ends(self) -> None:
        if torch.compiler.is_compiling():
            return
        self.depth -= 1
        if self.depth == 0 and self.entered:
            self.entered = False
            self.__exit__(None, None, None)

    def pause(self) -> bool:
        """Before a module pre-hook's refresh, whose copies read no stale weight: leaves the mode (about
        2 us per torch function of the copies) where it is the innermost one (one entered inside the
        forward and still active stays above it, and leaving would pop that one instead). Returns
        whether it left."""
        if self.entered and torch.overrides._get_current_function_mode() is self:
            self.__exit__(None, None, None)
            return True
        return False

    def resume(self, paused: bool) -> None:
        """After that refresh: back into the mode while something is still stale; otherwise the forward
        runs on without it."""
        if paused:
            if self.reads.needs_read_guard():
                self.__enter__()
            else:
                self.entered = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.compiler.disable
def _take_all_outside_graph(rank) -> None:
    """Compiled code that calls the wrapped model without its prologue: the weights come in here, in one
    graph break at the forward's start."""
    rank.take_all()


class ApplyGuard:
    """`module.to()`, `.cuda()`, `.half()`, ... (all through `Module._apply`) after wrap: in-flight
    updates land first; a conversion that would give the wrapped parameters another dtype, device or
    storage is handed to `rank.relayout(convert, conversions)`, which re-attaches the job around
    `convert()` (the conversion itself), or is refused before anything changes when the rank has no
    relayout. Conversions that leave them as they are (`.cuda()` on the GPU they are on) go ahead. The
    guard is a method bound to the module, so a `copy.deepcopy` of the model (an EMA copy, say) gets one
    bound to itself, which finds no rank and converts freely."""

    def __init__(self, rank, module: torch.nn.Module):
        self.module = module
        _GUARDED[module] = rank
        module._apply = types.MethodType(_guarded_apply, module)

    def remove(self) -> None:
        _GUARDED.pop(self.module, None)
        self.module.__dict__.pop("_apply", None)


_GUARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the Rank that wrapped it
_applying = threading.local()  # .ranks: those whose guarded _apply runs; it checked their submodules too


def _guarded_apply(module: torch.nn.Module, fn, *args, **kwargs):
    rank = _GUARDED.get(module)
    active = _applying.__dict__.setdefault("ranks", set())
    if rank is None or rank in active:
        with internal():  # torch's own `param.data = fn(param)`, on watched parameters (_watched.py)
            return type(module)._apply(module, fn, *args, **kwargs)
    rank.synchronize()
    with internal():
        changes = conversions(module, fn, set(map(id, rank.params)))
    if changes:
        if rank.relayout is None:
            raise TrainstreamError(f"this would turn parameter {changes[0]}, but trainstream keeps its optimizer "
                                   "state in that layout: call trainstream.unwrap(model) first, convert, then wrap "
                                   "again")
        return rank.relayout(lambda: type(module)._apply(module, fn, *args, **kwargs), changes)
    active.add(rank)
    try:
        with internal():
            return type(module)._apply(module, fn, *args, **kwargs)
    finally:
        active.discard(rank)


@dataclass
class Conversion:
    """What a conversion would make of one wrapped parameter."""
    name: str
    param: torch.nn.Parameter
    dtype: torch.dtype
    device: torch.device

    def __str__(self) -> str:
        p = self.param
        return f"'{self.name}' from {p.dtype} on {p.device} into {self.dtype} on {self.device}"


def conversions(module: torch.nn.Module, fn, wrapped: set[int]) -> list[Conversion]:
    """The wrapped parameters of `module` that `fn` would give another dtype, device or storage (the
    converted copies are not kept)."""
    out = []
    with torch.no_grad():
        for name, before in module.named_parameters():
            if id(before) not in wrapped:
                continue
            after = fn(before)
            if after is before or (after.dtype == before.dtype and after.device == before.device
                                   and after.data_ptr() == before.data_ptr()):
                continue
            out.append(Conversion(name, before, after.dtype, after.device))
    return out
