"""Describing a torch optimizer's parameters to the daemon: dtypes, groups, names, and validation of
what trainstream supports (raised at wrap time, never mid-training)."""

from __future__ import annotations

import inspect

import torch

from trainstream._C import ParamSpec, TrainstreamError

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MOMENT_DTYPES = {"float32": 0, "bfloat16": 1}
ADAMW, ADAM = 0, 1
_REGION_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}


def torch_dtype(code: int) -> torch.dtype:
    return _REGION_DTYPES[code]


def optimizer_kind(optimizer: torch.optim.Optimizer) -> int:
    """ADAMW or ADAM; raises for anything trainstream cannot run exactly."""
    if isinstance(optimizer, torch.optim.AdamW):
        kind = ADAMW
    elif isinstance(optimizer, torch.optim.Adam):
        kind = ADAMW if optimizer.defaults.get("decoupled_weight_decay", False) else ADAM
    else:
        raise TrainstreamError(f"trainstream runs torch.optim.AdamW and Adam; got {type(optimizer).__name__}")
    overriding = _own_step(optimizer, torch.optim.AdamW if kind == ADAMW and isinstance(optimizer, torch.optim.AdamW)
                           else torch.optim.Adam)
    if overriding is not None:
        raise TrainstreamError(f"{type(optimizer).__name__} overrides step() (in {overriding.__name__}), which would "
                               "never run: the daemon runs torch's AdamW/Adam update itself; wrap a torch.optim.AdamW "
                               "or Adam, or a subclass that keeps their step()")
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag, False):
                raise TrainstreamError(f"param group {i}: {flag}=True is not supported by trainstream")
        if group.get("decoupled_weight_decay", kind == ADAMW) != (kind == ADAMW):
            raise TrainstreamError(f"param group {i}: decoupled_weight_decay differs between groups")
    return kind


def _own_step(optimizer: torch.optim.Optimizer, base: type) -> type | None:
    """The class between type(optimizer) and `base` that defines a step() of its own, if any. torch's
    Optimizer puts a profiling wrapper of the inherited step() into a subclass (functools.wraps), which
    does not count."""
    inherited = inspect.unwrap(base.step)
    for cls in type(optimizer).__mro__:
        if cls is base:
            return None
        step = vars(cls).get("step")
        if step is not None and inspect.unwrap(step) is not inherited:
            return cls
    return None


def parameters_of(optimizer: torch.optim.Optimizer, paged: set[int] = frozenset()) -> list[torch.nn.Parameter]:
    """The optimizer's parameters in state_dict order, checked for what trainstream can offload.
    `paged`: ids of parameters that weight paging keeps in host memory (they may be elsewhere now)."""
    params, seen, device = [], set(), None
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in seen:
                raise TrainstreamError(f"a parameter appears twice in the optimizer (group {gi})")
            seen.add(id(p))
            if not p.requires_grad:
                raise TrainstreamError(f"param group {gi} holds a parameter that does not require grad")
            if p.dtype not in DTYPE_CODES:
                raise TrainstreamError(f"parameter dtype {p.dtype} unsupported (float32, bfloat16, float16)")
            if p.is_sparse:
                raise TrainstreamError("sparse parameters are not supported")
            if id(p) not in paged:
                if device is not None and p.device != device:
                    raise TrainstreamError(f"parameters on {device} and {p.device}: all parameters of a wrapped "
                                           "optimizer must be on one device (pass device= to move them)")
                device = p.device
            params.append(p)
    if not params:
        raise TrainstreamError("the optimizer has no parameters")
    return params


def param_name(model: torch.nn.Module, params: list[torch.nn.Parameter], i: int) -> str:
    """How errors name parameter i of `params`: its name in `model` (else its index), quoted."""
    p = params[i]
    name = next((n for n, q in model.named_parameters() if q is p), f"{i}")
    return f"'{name}'"


def layout_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                   dtypes: list[torch.dtype], partition: dict[int, int] | None = None) -> list[ParamSpec]:
    """The job's ParamSpec of each parameter (name, shape, dtype code, group, partition); `dtypes` are
    the dtypes the job keeps them in (PagingPlan.job_dtype, paging/blocks.py), `partition` maps the ids of paged
    parameters to their block's partition (others: 0)."""
    names = {id(p): name for name, p in model.named_parameters()}
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    partition = partition or {}
    return [ParamSpec(names.get(id(p), f"param{i}"), list(p.shape), DTYPE_CODES[dtype], group_of[id(p)],
                      partition.get(id(p), 0)) for i, (p, dtype) in enumerate(zip(params, dtypes))]


def frozen_entries(frozen: list[tuple[str, torch.nn.Parameter]]) -> list[ParamSpec]:
    """The ParamSpec of each paged parameter outside the optimizer (group 0: unused)."""
    for name, p in frozen:
        if p.dtype not in DTYPE_CODES:
            raise TrainstreamError(f"frozen parameter '{name}' has dtype {p.dtype}: paging supports float32, "
                                   "bfloat16 and float16")
    return [ParamSpec(name, list(p.shape), DTYPE_CODES[p.dtype]) for name, p in frozen]
