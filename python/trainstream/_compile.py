"""torch.compile of a wrapped model: one graph, as the model alone compiles to.

The wrapped model's forward hooks wait for the daemon's new weights and check its health: native calls,
which Dynamo cannot trace (each was a graph break: 31 for a two-layer Qwen2, 2026-12-07). So a compiled
forward takes every weight in before Dynamo runs, in an eager prologue, and the hooks do nothing while
Dynamo traces them. The prologue is put where compiling starts: on the module torch.compile(model)
returns, around the compiled call of model.compile() (torch.compile of its _call_impl), and, for a model
compiled before wrap(), around the compiled call it already has. Any other compiled code that calls the
model (a compiled training step, say) still sees its weights: the model's first hook then takes them in
outside the graph (StaleReadGuard._forward_starts), at the cost of one graph break there.

The prologue also makes the parameters plain nn.Parameters until the compiled call returns (_watched.py):
Dynamo guards on their type, and would compile the forward again for the watched class.

Invariant: a forward that runs compiled starts with no stale weight and the daemon healthy, and a
failed prologue leaves the model as it was.
"""

from __future__ import annotations

import functools

import torch

_torch_compile = torch.compile
_current_rank = None  # wrap's: a model's current Rank or None (relayouts and unwrap change it); install() sets it


def _prologue(model: torch.nn.Module):
    """The wrapped model's rank while a compiled forward of it runs (its weights all in place), else None."""
    rank = _current_rank(model)
    if rank is None:
        return None
    rank.take_all()
    rank.compiled_forward += 1
    rank.watch.plain_all()
    return rank


def _epilogue(rank) -> None:
    if rank is not None:
        rank.compiled_forward -= 1
        if not rank.compiled_forward:
            rank.watch.watch_all()


def _around(model: torch.nn.Module, call):
    """`call` (a compiled forward of `model`) with the prologue before it."""
    @functools.wraps(call)
    def compiled(*args, **kwargs):
        rank = _prologue(model)
        try:
            return call(*args, **kwargs)
        finally:
            _epilogue(rank)
    compiled._trainstream_prologue = True
    return compiled


def adopt(model: torch.nn.Module) -> None:
    """wrap() of a model compiled already (model.compile()): the prologue goes around its compiled call."""
    call = getattr(model, "_compiled_call_impl", None)
    if call is not None and not getattr(call, "_trainstream_prologue", False):
        model._compiled_call_impl = _around(model, call)


def compile(model=None, **kwargs):
    """torch.compile, with the prologue wherever it compiles a wrapped model or its _call_impl."""
    if model is None:  # @torch.compile(...) as a decorator factory
        return lambda fn: compile(fn, **kwargs)
    compiled = _torch_compile(model, **kwargs)
    owner = getattr(model, "__self__", None)
    if isinstance(model, torch.nn.Module) and isinstance(compiled, torch.nn.Module):
        ranks: dict = {}
        compiled.register_forward_pre_hook(lambda module, args: ranks.__setitem__("rank", _prologue(model)))
        compiled.register_forward_hook(lambda module, args, output: _epilogue(ranks.pop("rank", None)),
                                       always_call=True)
    elif isinstance(owner, torch.nn.Module) and getattr(model, "__func__", None) is torch.nn.Module._call_impl:
        compiled = _around(owner, compiled)  # model.compile(): torch.compile(self._call_impl)
    return compiled


def install(current_rank) -> None:
    """`current_rank(model)`: the Rank whose hooks the model has now, or None."""
    global _current_rank
    _current_rank = current_rank
    torch.compile = compile
