"""wrap()'s job options checked in its own words (the keywords and Python types the user wrote), before any
work: what reaches the daemon's attach is valid there too (shm/job_layout.cpp checks it again, in its codes).
"""

from __future__ import annotations

import os

from trainstream import _layout
from trainstream._C import MAX_ACCUMULATION_STEPS, MIN_BUCKET_BYTES, TrainstreamError

MIN_BUCKET_MB = MIN_BUCKET_BYTES / (1 << 20)  # the daemon's smallest bucket (shm/job_layout.h)
MAX_BUCKET_MB = 1 << 20  # 1 TiB: larger than any model's parameters, which would all share one bucket
_jobs_named = 0  # default_job_name's counter


def check_rank_options(*, rank: int, world_size: int, moment_dtype: str, bucket_mb: float) -> None:
    if moment_dtype not in _layout.MOMENT_DTYPES:
        raise TrainstreamError(f"moment_dtype must be one of {sorted(_layout.MOMENT_DTYPES)}, not {moment_dtype!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TrainstreamError(f"world_size must be an integer >= 1 (this node's ranks), not {world_size!r}")
    if not 0 <= rank < world_size:
        raise TrainstreamError(f"rank {rank} out of range for world_size {world_size}")
    if not isinstance(bucket_mb, (int, float)) or not MIN_BUCKET_MB <= bucket_mb <= MAX_BUCKET_MB:  # nan too
        raise TrainstreamError(f"bucket_mb must be a number of MiB in [{MIN_BUCKET_MB}, {MAX_BUCKET_MB}] (4 KiB to "
                               f"1 TiB), not {bucket_mb!r}")


def state_options(state_halves, speculative_clipping) -> tuple[int, int]:
    """wrap()'s state_halves ("auto", 1, 2) and speculative_clipping ("auto", True, False) as the attach
    codes: halves 0 (the daemon decides), 1, 2; speculation 0 off, 1 on, 2 the daemon decides."""
    halves = {"auto": 0, 1: 1, 2: 2}.get(state_halves) if not isinstance(state_halves, bool) else None
    if halves is None:
        raise TrainstreamError(f"state_halves must be 'auto', 1 or 2, not {state_halves!r}")
    speculation = {"auto": 2, True: 1, False: 0}.get(speculative_clipping) \
        if isinstance(speculative_clipping, (bool, str)) else None
    if speculation is None:
        raise TrainstreamError(f"speculative_clipping must be 'auto', True or False, not {speculative_clipping!r}")
    if speculation == 1 and halves == 1:  # shm/job_layout.cpp refuses it too, but in codes, not wrap()'s words
        raise TrainstreamError("speculative_clipping=True needs state_halves=2 (or 'auto'): a redo starts again "
                               "from the committed half")
    return halves, speculation


def check_accumulation_steps(value) -> int | None:
    """wrap()'s accumulation_steps: "auto" (None: counted) or a count in [1, 65536]."""
    if isinstance(value, str) and value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ACCUMULATION_STEPS:
        raise TrainstreamError(f"accumulation_steps must be 'auto' (the backward passes between two optimizer.step() "
                               f"are counted) or an integer in [1, {MAX_ACCUMULATION_STEPS}], not {value!r}")
    return value


def check_max_grad_norm(value) -> float | None:
    """wrap()'s max_grad_norm: None or a number > 0 (inf: the norm is taken, nothing clipped)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:  # nan too
        raise TrainstreamError(f"max_grad_norm must be None (no clipping, or the clip_grad_norm_ calls of the loop) "
                               f"or a number > 0, not {value!r}")
    return float(value)


def default_job_name() -> str:
    """A job name no other process of this node uses: wrap()'s when none is given."""
    global _jobs_named
    _jobs_named += 1
    return f"{os.uname().nodename}-{os.getpid()}-{_jobs_named}"
