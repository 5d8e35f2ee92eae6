"""Watched parameters: a wrapped model's weights read, edited or asked for their gradient outside the
model's own forward behave as in torch, or the call is refused (docs/porting.md; issue 48).

After optimizer.step() a wrapped parameter still shows the previous step's weights until the next forward
takes the new ones in; `p.data` shares no version counter with `p`, so edits through it escape
WeightEdits (_edits.py); `p.grad` is empty after backward (the gradients left for the daemon). torch has no
read hook on a tensor, so while wrapped, each trained parameter that does not page is a `WatchedParameter`:
the same object (same id, optimizer-state key and autograd leaf, still an nn.Parameter) with its
`__class__` swapped, whose `__torch_function__`
- refreshes the stale buckets (WeightReads.refresh_read, _weight_reads.py) of the parameters a torch
  function gets, before it runs (an EMA right after step(), a logged norm, a head's weight used outside
  its module, another thread);
- returns `p.detach()` for `p.data` (which shares the version counter, so WeightEdits sees the edits a
  WGAN clamp or a pruning mask make through it), and copies `p.data = t` into `p` (another shape, dtype
  or device is refused);
- refuses `p.grad` where torch would hold a gradient tensor, naming what to do instead.
Metadata (shape, dtype, `_version`, ...) passes untouched. Swapping the class at a forward's start and end
costs 24 us a step for 153 parameters; a torch function on a watched parameter 1-2 us more (an EMA loop
over 75 parameters, 150 ops: 470 -> 740 us; 2-core dev box, 2026-12-07).

Invariants:
- a trained, not paged parameter is a WatchedParameter while its rank is attached, except inside the
  wrapped model's own forward, where it is a plain nn.Parameter once its bucket is not stale, and during
  a compiled forward (_compile.py), where it is plain throughout: Dynamo never sees the subclass and
  compiles the same graphs as without trainstream;
- trainstream's own code touching the parameters runs under `internal()` (torch's thread-local switch
  that turns subclasses' __torch_function__ off: one per hook, per thread), so it never pays for, nor
  trips over, the watching;
- between a forward's end and its backward, `p.data` is torch's own: an edit through the detached alias
  of a weight saved for backward would make autograd raise its version error where torch trains on
  (that window stays in porting.md's "Not caught yet");
- a parameter whose rank is gone (closed, collected) becomes a plain nn.Parameter at its first torch
  function, and unwrap makes them all plain at once.
"""

from __future__ import annotations

import weakref

import torch

from trainstream._C import TrainstreamError

internal = torch._C.DisableTorchFunctionSubclass  # trainstream's own reads and writes of the parameters

_Parameter = torch.nn.Parameter
_TensorBase = torch._C.TensorBase
_GRAD, _DATA = _TensorBase.grad, _TensorBase.data
_METHOD_WRAPPER = type(_GRAD.__get__)  # how a property's getter and setter reach __torch_function__
# Attributes and methods that show no values: no refresh for them (the optimizer's bookkeeping, shape checks).
_NO_VALUES = frozenset(getattr(_TensorBase, name) for name in (
    "shape", "dtype", "device", "requires_grad", "_version", "is_leaf", "grad_fn", "layout", "ndim", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "itemsize", "nbytes", "_base", "output_nr"))
_NO_VALUE_METHODS = frozenset(getattr(torch.Tensor, name) for name in (
    "size", "dim", "numel", "nelement", "stride", "is_contiguous", "data_ptr", "element_size", "storage_offset",
    "get_device", "is_floating_point", "is_complex", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "untyped_storage", "__len__"))

_owners: dict[int, weakref.ref] = {}  # id of a watched parameter -> its Rank (a weak reference)


class WatchedParameter(_Parameter):
    """A wrapped parameter outside the model's forward (never constructed: parameters become one by
    `__class__` assignment, and go back the same way)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with internal():
            if torch.compiler.is_compiling():  # a compiled caller's frame that runs the model (_compile.py)
                return func(*args, **kwargs)
            if type(func) is _METHOD_WRAPPER:
                owner = func.__self__
                if owner in _NO_VALUES:
                    return func(*args, **kwargs)
                if owner is _GRAD:
                    return _grad(func, args)
                if owner is _DATA:
                    return _data(func, args)
            elif func in _NO_VALUE_METHODS:
                return func(*args, **kwargs)
            _refresh_read(args, kwargs)
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A copy (an EMA model, the best model so far) holds the current weights and is not watched."""
        if id(self) in memo:
            return memo[id(self)]
        _refresh_read((self,), {})
        with internal():
            result = _Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto):
        """torch.save(model), pickle: the current weights, reloaded as an nn.Parameter."""
        _refresh_read((self,), {})
        with internal():
            return _Parameter.__reduce_ex__(self, proto)

    def __repr__(self) -> str:
        """As an nn.Parameter's ("Parameter containing:", which torch prints for that type only)."""
        _refresh_read((self,), {})
        with internal():
            return "Parameter containing:\n" + repr(self.detach().requires_grad_(self.requires_grad))


def _rank_of(p: torch.Tensor):
    """The attached Rank of watched parameter p; None (and p plain again) once that rank is gone."""
    ref = _owners.get(id(p))
    rank = ref() if ref is not None else None
    if rank is None:
        p.__class__ = _Parameter
        _owners.pop(id(p), None)
    return rank


def _refresh_read(args: tuple, kwargs: dict) -> None:
    """The stale buckets of the watched parameters among a torch function's arguments (lists of them
    too, as torch.cat's and the _foreach functions') take their new weights in."""
    ranks = {}
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if type(t) is WatchedParameter:
                rank = _rank_of(t)
                if rank is not None:
                    ranks[id(rank)] = rank
    for rank in ranks.values():
        if rank.reads.stale:
            rank.reads.refresh_read(args, kwargs)


def _grad(func, args: tuple):
    """`p.grad` (None where torch holds none, else refused: the gradient left during backward) and
    `p.grad = ...` (as torch: optimizer.step() refuses a gradient set by hand)."""
    p = args[0]
    rank = _rank_of(p)
    if func.__name__ != "__get__" or rank is None:
        return func(*args)
    grad = func(p)
    if grad is not None:  # set by hand
        return grad
    i = rank.param_index[id(p)]
    if rank.grads.holds(i):
        raise TrainstreamError(
            f"p.grad of wrapped parameter {rank.param_name(i)} read after backward(): its gradient left for the daemon "
            "during backward and is not kept on this side. For the gradient norm use the value "
            "torch.nn.utils.clip_grad_norm_ returns (or optimizer.last_grad_norm); to read per-parameter gradients "
            "call trainstream.unwrap(model) (training with torch's optimizer)")
    return None


def _data(func, args: tuple):
    """`p.data`: the current weights as `p.detach()`, whose edits WeightEdits sees. `p.data = t`: t's values
    copied into p (an edit WeightEdits sees), where t has p's shape, dtype and device."""
    p = args[0]
    rank = _rank_of(p)
    if rank is None or rank.watch.awaiting_backward:
        return func(*args)
    rank.reads.refresh_read((p,), {})
    if func.__name__ == "__get__":
        return p.detach()
    value = args[1]
    if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (p.shape, p.dtype,
                                                                                            p.device):
        got = f"{value.dtype} {tuple(value.shape)} on {value.device}" if isinstance(value, torch.Tensor) else \
            type(value).__name__
        raise TrainstreamError(
            f"p.data = a tensor of {got} for wrapped parameter {rank.param_name(rank.param_index[id(p)])} ({p.dtype} "
            f"{tuple(p.shape)} on {p.device}): trainstream keeps the parameter's optimizer state in its layout and "
            "copies a p.data of the same shape, dtype and device into it; call trainstream.unwrap(model), convert, "
            "then wrap again")
    if value.data_ptr() != p.data_ptr() or value.stride() != p.stride():
        with torch.no_grad():
            p.copy_(value)
    return None


class Watch:
    """The watching of one Rank's parameters: which are watched when, and the forward's window before
    its backward. `params`: the rank's trained parameters that do not page, by their index in the rank
    (grouped by bucket through the rank's Regions.bucket_params)."""

    def __init__(self, rank, params: dict[int, torch.nn.Parameter]):
        self.params = list(params.values())
        self.by_bucket = [[params[i] for i in bucket if i in params] for bucket in rank.regions.bucket_params]
        self.depth = 0  # nested forwards of the model
        # A forward ended with autograd recording, and no backward nor optimizer.step() came since
        self.awaiting_backward = False
        ref = weakref.ref(rank)
        for p in self.params:
            _owners[id(p)] = ref
        self.watch_all()
        model = rank.model
        # Closures, not bound methods (copy.deepcopy(model) copies bound methods with their object). The
        # pre-hook is registered before the StaleReadGuard's, which prepends itself: its weights come first.
        self.handles = [
            model.register_forward_pre_hook(lambda module, args: self._forward_starts(rank), prepend=True),
            model.register_forward_hook(lambda module, args, output: self._forward_ends(), always_call=True)]

    def watch_all(self) -> None:
        for p in self.params:
            p.__class__ = WatchedParameter

    def plain_all(self) -> None:
        for p in self.params:
            p.__class__ = _Parameter

    def refreshed(self, b: int) -> None:
        """Bucket b's new weights are in: inside the forward its parameters run plain from now on."""
        if self.depth:
            for p in self.by_bucket[b]:
                p.__class__ = _Parameter

    def _forward_starts(self, rank) -> None:
        if torch.compiler.is_compiling():
            return
        self.depth += 1
        self.awaiting_backward = False
        if self.depth == 1:
            for b, params in enumerate(self.by_bucket):
                if b not in rank.reads.stale:
                    for p in params:
                        p.__class__ = _Parameter

    def _forward_ends(self) -> None:
        if torch.compiler.is_compiling() or not self.depth:  # not: the StaleReadGuard's pre-hook raised first
            return
        self.depth -= 1
        if self.depth == 0:
            self.watch_all()
            self.awaiting_backward = torch.is_grad_enabled()

    def close(self) -> None:
        """The rank detaches (unwrap, a relayout, offload='auto''s switch): every parameter plain again."""
        for handle in self.handles:
            handle.remove()
        self.plain_all()
        for p in self.params:
            _owners.pop(id(p), None)
