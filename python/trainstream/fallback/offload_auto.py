"""offload="auto": whether the optimizer state needs the daemon at all.

The first MEASURED_STEPS optimizer steps run offloaded and are measured: their wall time (from wrap, then
from step to step) and the peak of torch's allocated-memory counter over them (reset at wrap). Then, if
stock AdamW fits — its state (exp_avg and exp_avg_sq in the parameters' fp32, a step tensor each), the
gradients, the measured peak, and the parameters that cuda-ipc keeps outside torch's allocator now (they
move back into it), times MARGIN plus RESERVE, within the memory budget (_budget.py; cuda-ipc's buffers
count as free, the switch frees them) — the optimizer switches to torch's fused AdamW / Adam (see
fallback/stock.py): the state moves into it, the daemon's job is dropped, the hooks go. On the CPU there is no
allocator counter: the peak counted is the parameters' bytes, and the budget the host's.

Decided once and logged once (logger "trainstream") with the figures it was decided from. It never switches
with weight paging (the paged weights live in the job), with several data-parallel ranks or nodes (the
daemon averages their gradients), or with 16-bit parameters (stock AdamW would update them in place,
without the fp32 master weights); the log says which.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from trainstream import _budget

MEASURED_STEPS = 2
MARGIN = 1.10
RESERVE = 256 << 20
STEP_TENSOR_BYTES = 512  # a step tensor of the fused optimizer: one block of torch's caching allocator
GIB = 1 << 30

log = logging.getLogger("trainstream")


@dataclass
class Fit:
    """What stock AdamW would need, against the budget."""
    state: int    # exp_avg + exp_avg_sq + step tensors
    grads: int
    peak: int     # measured with offloading
    outside: int  # parameters outside torch's allocator now
    budget: _budget.Budget

    @property
    def need(self) -> int:
        return int((self.state + self.grads + self.peak + self.outside) * MARGIN) + RESERVE

    @property
    def fits(self) -> bool:
        return self.need <= self.budget.bytes

    def describe(self) -> str:
        return (f"stock needs {self.need / GIB:.2f} GiB = (state {self.state / GIB:.2f} + gradients "
                f"{self.grads / GIB:.2f} + measured peak {self.peak / GIB:.2f} + parameters outside torch "
                f"{self.outside / GIB:.2f}) x {MARGIN} + {RESERVE >> 20} MiB; budget {self.budget.bytes / GIB:.2f} GiB "
                f"({self.budget.source})")


def stock_fit(params: list[torch.Tensor], peak: int, outside: int, budget: _budget.Budget) -> Fit:
    numel = sum(p.numel() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params)
    state = 8 * numel + STEP_TENSOR_BYTES * len(params)
    return Fit(state, grads, peak, outside, budget)


def refusal(rank, ranks: int) -> str | None:
    """Why the state must stay in the daemon, or None; `ranks`: the job's data-parallel ranks, all nodes'."""
    if rank.pager is not None:
        return "weight paging (param_offload) keeps the paged blocks' weights in the daemon's job"
    if ranks > 1:
        return f"the daemon averages the gradients of the job's {ranks} data-parallel ranks"
    narrow = sorted({str(p.dtype) for p in rank.params if p.dtype != torch.float32})
    if narrow:
        return (f"{'/'.join(narrow)} parameters: stock AdamW would update them without the fp32 master weights "
                "the daemon keeps")
    return None


class AutoOffload:
    """Measures the optimizer's first steps; `switch()` moves the state into stock AdamW (wrap's)."""

    def __init__(self, optimizer, switch: Callable[[], None], ranks: int):
        self.optimizer = optimizer
        self.switch = switch
        self.ranks = ranks
        self.times: list[float] = []
        device = optimizer.job_rank.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.last = time.perf_counter()

    def after_step(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        if len(self.times) < MEASURED_STEPS:
            return
        self.optimizer.after_step.remove(self.after_step)
        rank = self.optimizer.job_rank
        if rank is None:
            return  # left the daemon already
        steps = ", ".join(f"{1000 * t:.1f}" for t in self.times)
        why = refusal(rank, self.ranks)
        if why is not None:
            log.info("offload='auto': keeps offloading after %d measured steps (%s ms): %s", len(self.times), steps,
                     why)
            return
        fit, device = self._fit(rank), rank.device
        if not fit.fits:
            log.info("offload='auto': keeps offloading: %s; measured steps %s ms", fit.describe(), steps)
            return
        del rank  # the switch frees the rank's GPU buffers: no reference may outlive it
        log.info("offload='auto': switches to torch.optim.%s(fused=True) on %s after %d offloaded steps (%s ms): %s",
                 self.optimizer.inner_type.__name__, device, len(self.times), steps, fit.describe())
        self.switch()

    @staticmethod
    def _fit(rank) -> Fit:
        params, device = rank.params, rank.device
        held = getattr(rank.transport, "device_bytes", 0)  # cuda-ipc's buffers: freed by the switch
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            outside = param_bytes if held else 0
        else:
            peak, outside = param_bytes, 0
        return stock_fit(params, peak, outside, _budget.available(device, held))
