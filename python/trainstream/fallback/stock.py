"""The optimizer's state in torch instead of trainstreamd: a stock torch.optim.AdamW / Adam over the
wrapped optimizer's param groups, for the optimizer `wrap` returned once offload="auto" switched, with
offload=False, and after unwrap().

Invariants: the torch optimizer holds the very same group dicts (LR schedulers and code that edits
group["lr"] keep working); its state is in torch's format on each parameter's device (exp_avg and
exp_avg_sq in the parameter's dtype, step a float32 tensor, on the device when fused); hooks registered on
the wrapper run once per step (the torch optimizer's own step runs without its hook wrapper).
"""

from __future__ import annotations

import inspect

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


def constructor_defaults(kind: type, defaults: dict) -> dict:
    """The entries of `defaults` that `kind`'s constructor takes (AdamW takes no decoupled_weight_decay)."""
    accepted = inspect.signature(kind.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted and k != "params"}


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch has fused Adam kernels for all of `params` (floating point, on a supported device)."""
    devices = _get_fused_kernels_supported_devices()
    return all(p.is_floating_point() and p.device.type in devices for p in params)


class StockOptimizer:
    """A torch optimizer of class `kind` over `groups`, holding `state` (parameter -> torch-format state,
    on any device: moved to the parameter's). `fused`: True for the fused kernels (where torch has them for
    these parameters, else its default choice), None to keep the groups' own foreach/fused choices.
    `max_grad_norm` clips p.grad before each step (wrap's contract: the user does not clip), and
    `clear_grads` empties p.grad after it, as the offloaded optimizer leaves them."""

    def __init__(self, kind: type, groups: list[dict], defaults: dict, state: dict, *, fused: bool | None,
                 max_grad_norm: float | None = None, clear_grads: bool = False):
        self.params = [p for g in groups for p in g["params"]]
        if fused:
            fused = fused_supported(self.params)
            for group in groups:
                group["fused"], group["foreach"] = (True, False) if fused else (None, None)
        kwargs = constructor_defaults(kind, defaults)
        if fused is not None:
            kwargs.update(fused=bool(fused) or None, foreach=False if fused else None)
        self.optimizer = kind(groups, **kwargs)
        self.fused = any(g.get("fused") for g in self.optimizer.param_groups)
        self.max_grad_norm = max_grad_norm
        self.clear_grads = clear_grads
        self.install(state)

    def install(self, state: dict) -> None:
        """Replaces the torch optimizer's state with `state` (parameter -> {"step", "exp_avg", "exp_avg_sq"})."""
        fused_of = {id(p): bool(g.get("fused")) or bool(g.get("capturable")) for g in self.optimizer.param_groups
                    for p in g["params"]}
        self.optimizer.state.clear()
        with torch.no_grad():
            for p, saved in state.items():
                on_device = fused_of[id(p)]
                step = torch.as_tensor(saved["step"], dtype=torch.float32).reshape(())
                self.optimizer.state[p] = {
                    "step": step.to(p.device, copy=True) if on_device else step.to("cpu", copy=True),
                    "exp_avg": saved["exp_avg"].to(dtype=p.dtype, device=p.device, copy=True),
                    "exp_avg_sq": saved["exp_avg_sq"].to(dtype=p.dtype, device=p.device, copy=True),
                }

    @property
    def state(self):
        return self.optimizer.state

    def step(self) -> None:
        if self.max_grad_norm is not None:
            grads = [p for p in self.params if p.grad is not None]
            if grads:
                torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        _unhooked_step(self.optimizer)
        if self.clear_grads:
            for p in self.params:
                p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def _unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """optimizer.step() without torch's hook wrapper: the wrapper's step ran the hooks (global ones too)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)
