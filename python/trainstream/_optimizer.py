"""The optimizer `wrap` returns: a torch.optim.Optimizer whose state lives in trainstreamd, or, once it
left the daemon (offload="auto" switched, offload=False, unwrap()), in a stock torch optimizer.

It keeps the wrapped optimizer's param_groups (so LR schedulers and code that edits group["lr"] work
unchanged), and its state_dict() / load_state_dict() use torch.optim.AdamW's format, so a state dict
saved from either loads into the other. torch's optimizer hooks (register_step_pre_hook and
post, register_state_dict_pre_hook and post, register_load_state_dict_pre_hook and post, and the global
step hooks) run as on a torch optimizer, in both modes. The object stays the same across the switch:
schedulers and hooks made before it keep working. zero_grad() between backward() and step() drops the
step's gradients in the daemon, as torch drops p.grad; a GradScaler's unscale_ and inf check run in the
daemon (_amp.py), and `last_grad_norm` is the norm of the last step clip_grad_norm_ clipped.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable

import torch

from trainstream._C import TrainstreamError
from trainstream._watched import internal
from trainstream.fallback.stock import StockOptimizer

_BACKEND_FLAGS = ("fused", "foreach")  # kept from the stock optimizer's groups when a state dict loads


class OffloadedOptimizer(torch.optim.Optimizer):
    def __init__(self, inner: torch.optim.Optimizer, rank, dp=None):
        # Not Optimizer.__init__: the groups already exist and must stay the very same objects.
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = {}
        self.inner_type = type(inner)  # AdamW or Adam: the stock optimizer's class once the state leaves the daemon
        # An LR scheduler made before wrap() checks that this optimizer stepped: torch marks the one it patched.
        self._scheduled = weakref.ref(inner)
        self._rank = rank                            # the daemon's job while offloaded, else None
        self._resume_step = rank.resume_step if rank is not None else 0
        self._stock: StockOptimizer | None = None    # the torch optimizer once the state left the daemon
        # The torch.distributed group whose ranks train this job together (TrainStream 0.2's attribute), or
        # None: one process, or ranks placed without a group (torchrun's variables, explicit rank=).
        self._dp = dp
        self.after_step: list[Callable[[], None]] = []  # what wrap's automatic modes measure after a step
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # torch's step hooks wrap this class's step(), once
        self._warned_capturable_if_run_uncaptured = True

    def __repr__(self) -> str:
        where = f"job={self._rank.job!r}" if self._rank is not None else f"in torch: {type(self.stock).__name__}"
        return f"trainstream.OffloadedOptimizer({self.inner_type.__name__}, {where})"

    @property
    def offloaded(self) -> bool:
        """Whether the state is in trainstreamd (else in the stock torch optimizer, `stock`)."""
        return self._rank is not None

    @property
    def job_rank(self):
        """This process's Rank of the daemon's job (_rank.py) while the state is there, else None."""
        return self._rank

    @property
    def stock(self) -> torch.optim.Optimizer | None:
        """The torch optimizer holding the state once it left the daemon."""
        return self._stock.optimizer if self._stock is not None else None

    @property
    def resume_step(self) -> int:
        """The optimizer steps the job had completed when this process attached: 0 for a new job; for a
        restarted process, how many batches to skip (and LR scheduler steps to take) to go on where the
        job left off. It stays what it was when the state moves to torch (offload="auto"); 0 with
        offload=False."""
        return self._resume_step

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """In the daemon, a GradScaler unscales and checks this optimizer's gradients as torch.optim.AdamW's
        (_amp.py) and skips step() where they hold inf or NaN; a stock optimizer says for itself."""
        return self._stock is not None and getattr(self._stock.optimizer, "_step_supports_amp_scaling", False)

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm clip_grad_norm_ returned for the last step it clipped (None before)."""
        return self._rank.last_grad_norm if self._rank is not None else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._stock is not None:
            # A GradScaler hands a fused stock optimizer the scale and the found-inf flag as attributes.
            scaling = {key: getattr(self, key) for key in ("grad_scale", "found_inf") if hasattr(self, key)}
            for key, value in scaling.items():
                setattr(self._stock.optimizer, key, value)
            try:
                self._stock.step()
            finally:
                for key in scaling:
                    delattr(self._stock.optimizer, key)
        else:
            self._rank.step()
        scheduled = self._scheduled()
        if scheduled is not None and scheduled is not self:
            scheduled._opt_called = True  # what torch's LR scheduler looks for (no "step() before" warning)
        for measure in list(self.after_step):
            measure()
        return loss

    def synchronize(self) -> None:
        """Waits for the in-flight update: the parameters then show the latest weights."""
        if self._rank is not None:
            self._rank.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._stock is not None:
            self._stock.zero_grad(set_to_none)
            return
        # Gradients leave through the hooks: those of the step so far are dropped in the daemon, and
        # whatever is left here (a parameter outside the model's backward, say) is cleared like torch does.
        self._rank.zero_grad(set_to_none)
        with internal():
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

    def add_param_group(self, param_group: dict) -> None:
        if self._stock is not None:
            self._stock.optimizer.add_param_group(param_group)
            return
        raise TrainstreamError("add_param_group is not supported after trainstream.wrap(): the layout is fixed; "
                               "add the group before wrapping")

    # ----- leaving the daemon -----

    def daemon_state(self) -> dict[torch.nn.Parameter, dict]:
        """Each parameter that has stepped: {"step": steps, "exp_avg", "exp_avg_sq"}, the moments as views of
        the job's memory (they stay valid after the session closes), once in-flight updates landed."""
        rank = self._rank
        rank.synchronize()
        regions, state = rank.regions, {}
        for i, p in enumerate(rank.params):
            steps = regions.param_step(i)
            if steps:
                exp_avg, exp_avg_sq = regions.moment_views(i)
                state[p] = {"step": float(steps), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        return state

    def release_rank(self):
        """The rank, which this optimizer no longer refers to (the caller closes it; use_stock follows)."""
        rank, self._rank = self._rank, None
        return rank

    def use_stock(self, stock: StockOptimizer) -> None:
        """From now on the state is `stock`'s."""
        stock.optimizer.param_groups = self.param_groups  # the same list, of the same group dicts
        self._stock = stock
        self._rank = None
        self.state = stock.state

    def end_contract(self) -> None:
        """unwrap() with the state in torch: the stock optimizer no longer clips to wrap's max_grad_norm nor
        empties p.grad after a step (wrap's contract)."""
        self._stock.max_grad_norm = None
        self._stock.clear_grads = False

    def use_rank(self, rank) -> None:
        """A new job holds the state (the model was re-attached with another layout)."""
        self._rank = rank

    # ----- torch.optim.AdamW's state_dict format -----

    def state_dict(self) -> dict:
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = self.stock.state_dict() if self._stock is not None else self._daemon_state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _daemon_state_dict(self) -> dict:
        index = {id(p): i for i, p in enumerate(self._rank.params)}
        state = {}
        for p, saved in self.daemon_state().items():
            dtype = self._rank.model_dtype(p)
            state[index[id(p)]] = {
                "step": torch.tensor(saved["step"], dtype=torch.float32),
                "exp_avg": saved["exp_avg"].to(dtype=dtype, device=p.device, copy=True),
                "exp_avg_sq": saved["exp_avg_sq"].to(dtype=dtype, device=p.device, copy=True),
            }
        groups, first = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(first, first + len(group["params"])))
            first += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)  # shallow copy, as torch: hooks may replace entries
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved = self._saved_state_by_param(state_dict)
        if self._stock is not None:
            self._stock.install(saved)
        else:
            self._load_into_daemon(saved)
        skip = _BACKEND_FLAGS if self._stock is not None else ()
        for group_saved, group in zip(state_dict["param_groups"], self.param_groups):
            for key, value in group_saved.items():
                if key != "params" and key not in skip:
                    group[key] = value
        if self._rank is not None:
            self._rank.publish()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _saved_state_by_param(self, state_dict: dict) -> dict:
        """The state dict's entries by parameter, all checked against the optimizer's groups and shapes
        before any is applied (a refused state dict changes nothing): an AdamW/Adam state (step, exp_avg,
        exp_avg_sq) of the parameters' shapes."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise TrainstreamError("not an optimizer state dict (needs 'state' and 'param_groups')")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise TrainstreamError(f"state dict has {len(groups)} param groups, the optimizer {len(self.param_groups)}")
        for gi, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise TrainstreamError(f"param group {gi}: state dict has {len(saved['params'])} parameters, "
                                       f"the optimizer {len(group['params'])}")
        saved_ids = [pid for g in groups for pid in g["params"]]
        out = {}
        for i, (pid, p) in enumerate(zip(saved_ids, self._params())):
            entry = state_dict["state"].get(pid)
            if not entry:
                continue
            _check_entry(i, entry, p)
            out[p] = entry
        return out

    def _load_into_daemon(self, saved: dict) -> None:
        rank = self._rank
        rank.require_idle("load an optimizer state dict")
        regions = rank.regions
        paged = rank.paging.paged_ids if rank.paging else set()  # their master weights are the current ones
        with torch.no_grad():
            for i, p in enumerate(rank.params):
                exp_avg, exp_avg_sq = regions.moment_views(i)
                entry = saved.get(p)
                if entry:
                    exp_avg.copy_(entry["exp_avg"])
                    exp_avg_sq.copy_(entry["exp_avg_sq"])
                    regions.set_param_step(i, int(float(entry["step"])))
                else:
                    exp_avg.zero_()
                    exp_avg_sq.zero_()
                    regions.set_param_step(i, 0)
                if id(p) not in paged:  # a paged parameter outside its slot is a placeholder
                    regions.master_view(i).copy_(p.detach())


def _check_entry(i: int, entry: dict, p: torch.nn.Parameter) -> None:
    """Parameter `i`'s saved state is torch.optim.AdamW's or Adam's, for a parameter of p's shape."""
    missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in entry]
    if missing:
        raise TrainstreamError(f"state of parameter {i} has {sorted(entry)} but no {missing}: not the state of "
                               "torch.optim.AdamW or Adam (saved from another optimizer?)")
    for key in ("exp_avg", "exp_avg_sq"):
        if not isinstance(entry[key], torch.Tensor) or tuple(entry[key].shape) != tuple(p.shape):
            shape = tuple(entry[key].shape) if isinstance(entry[key], torch.Tensor) else type(entry[key])
            raise TrainstreamError(f"state of parameter {i}: {key} has shape {shape}, the parameter {tuple(p.shape)}")
    try:
        step = float(entry["step"])
    except (TypeError, ValueError, RuntimeError):
        step = float("nan")
    if not (0 <= step < 2**53 and step == int(step)):  # nan fails too
        raise TrainstreamError(f"state of parameter {i}: step is {entry['step']!r}, not a count >= 0")
