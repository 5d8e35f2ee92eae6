"""How much memory the automatic modes (offload="auto", param_offload="auto", activation_offload="auto")
plan for on a device.

GPU: what this process could have: the driver's free memory plus what the process holds already
(torch's reserved memory, and `held` bytes outside torch's allocator that the decision would free), and
no more than the process's cap (torch.cuda.get_per_process_memory_fraction x total) when one is set.
CPU: MemAvailable of /proc/meminfo plus `held`. $TRAINSTREAM_MEMORY_BUDGET_MB replaces either: tests
inject budgets with it, and it keeps room for other processes on a shared GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainstream._C import TrainstreamError

ENV = "TRAINSTREAM_MEMORY_BUDGET_MB"
GIB = 1 << 30


@dataclass
class Budget:
    bytes: int
    source: str  # where the figure comes from, for the log line of the decision


def available(device: torch.device, held: int = 0) -> Budget:
    override = os.environ.get(ENV)
    if override:
        try:
            mib = float(override)
        except ValueError:
            mib = -1.0
        if not mib >= 0:
            raise TrainstreamError(f"{ENV}={override!r}: a number of MiB >= 0")
        return Budget(int(mib * (1 << 20)), f"${ENV}")
    if device.type == "cuda":
        return _gpu(device, held)
    return Budget(_mem_available() + held, f"MemAvailable {_mem_available() / GIB:.1f} GiB (host)")


def _gpu(device: torch.device, held: int) -> Budget:
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device) + held
    figure = free + own
    source = f"{free / GIB:.2f} GiB free + {own / GIB:.2f} GiB held by this process"
    cap_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # an older torch cannot say
    fraction = cap_of(device) if cap_of is not None else 1.0
    if fraction < 1:
        cap = int(fraction * total)
        source += f", cap {cap / GIB:.2f} GiB (per-process memory fraction {fraction:.3f})"
        figure = min(figure, cap)
    return Budget(figure, source)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
