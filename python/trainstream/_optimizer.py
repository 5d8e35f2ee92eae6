"""The optimizer `wrap` returns: a torch.optim.Optimizer whose state lives in trainstreamd.

It keeps the wrapped optimizer's param_groups (so LR schedulers and code that edits
group["lr"] work unchanged), and its state_dict() / load_state_dict() use torch.optim.AdamW's
format, so a state dict saved from either loads into the other.
"""

from __future__ import annotations

import torch

from trainstream._C import TrainstreamError
from trainstream._rank import Rank


class OffloadedOptimizer(torch.optim.Optimizer):
    def __init__(self, inner: torch.optim.Optimizer, rank: Rank):
        # Not Optimizer.__init__: the groups already exist and must stay the very same objects.
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = {}
        self._inner_type = type(inner)
        self._rank = rank
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#trainstream.zero_grad"

    def __repr__(self) -> str:
        return f"trainstream.OffloadedOptimizer({self._inner_type.__name__}, job={self._rank.job!r})"

    @property
    def resume_step(self) -> int:
        """The optimizer steps the job had completed when this process attached: 0 for a new job; for a
        restarted process, how many batches to skip (and LR scheduler steps to take) to go on where the
        job left off."""
        return self._rank.resume_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._rank.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients leave through the hooks; whatever is left (a parameter outside the model's
        # backward, say) is cleared like torch does.
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def add_param_group(self, param_group: dict) -> None:
        raise TrainstreamError("add_param_group is not supported after trainstream.wrap(): the layout is fixed; "
                               "add the group before wrapping")

    # ----- torch.optim.AdamW's state_dict format -----

    def state_dict(self) -> dict:
        rank = self._rank
        rank.synchronize()
        regions = rank.regions
        state = {}
        for i, p in enumerate(rank.params):
            steps = regions.param_step(i)
            if steps == 0:
                continue
            exp_avg, exp_avg_sq = regions.moment_views(i)
            state[i] = {
                "step": torch.tensor(float(steps), dtype=torch.float32),
                "exp_avg": exp_avg.to(dtype=p.dtype, device=p.device, copy=True),
                "exp_avg_sq": exp_avg_sq.to(dtype=p.dtype, device=p.device, copy=True),
            }
        groups, index = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        rank = self._rank
        groups = state_dict.get("param_groups")
        if groups is None or "state" not in state_dict:
            raise TrainstreamError("not an optimizer state dict (needs 'state' and 'param_groups')")
        if len(groups) != len(self.param_groups):
            raise TrainstreamError(f"state dict has {len(groups)} param groups, the optimizer {len(self.param_groups)}")
        for gi, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise TrainstreamError(f"param group {gi}: state dict has {len(saved['params'])} parameters, "
                                       f"the optimizer {len(group['params'])}")
        saved_ids = [pid for g in groups for pid in g["params"]]
        rank._require_idle("load an optimizer state dict")
        regions = rank.regions
        with torch.no_grad():
            for i, p in enumerate(rank.params):
                saved = state_dict["state"].get(saved_ids[i], {})
                exp_avg, exp_avg_sq = regions.moment_views(i)
                if saved:
                    for key, view in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                        if tuple(saved[key].shape) != tuple(p.shape):
                            raise TrainstreamError(f"state of parameter {i}: {key} has shape {tuple(saved[key].shape)},"
                                                   f" the parameter {tuple(p.shape)}")
                        view.copy_(saved[key])
                    regions.set_param_step(i, int(float(saved["step"])))
                else:
                    exp_avg.zero_()
                    exp_avg_sq.zero_()
                    regions.set_param_step(i, 0)
                regions.master_view(i).copy_(p.detach())
        for saved, group in zip(groups, self.param_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        rank._publish()
