"""Where a trainstream step spends the trainer's thread in trainstream's own hooks (`--hook-times`).

Each hook is timed with perf_counter around its call (well under a microsecond a call), not with a
profiler's Python tracing, which inflated every call of the 124M GPT's hooks by an unknown factor
(benchmarks/results/train_gpt.md, 2026-12-05, night). The times are inclusive: the gradient hooks
include bucket_done, which includes the waits for staging slots; the module pre-hooks include the
waits for weights. The StaleReadGuard's mode is counted, not timed: its cost is Python's dispatch to
it, around each torch function while it is entered, and its refresh_read, which is timed.
"""

from __future__ import annotations

import collections
import time

from trainstream._guards import StaleReadGuard

# (label, the Rank's attribute holding the object, or None for the Rank itself; the method)
_TIMED = (
    ("gradient hooks", None, "_on_grad"),
    ("bucket_done (in the gradient hooks)", "transport", "bucket_done"),
    ("module pre-hooks", "reads", "before_module"),
    ("take_published (at the forward's start)", None, "take_published"),
    ("refresh_read (in the guard's mode)", "reads", "refresh_read"),
    ("optimizer.step()", None, "step"),
)
_GUARD_CALLS = "torch functions in the guard's mode"


class HookTimes:
    """Wraps the hooks of one Rank (per instance) and counts the guard's calls (the class's, until
    close())."""

    def __init__(self, rank):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        for label, owner_name, method in _TIMED:
            owner = rank if owner_name is None else getattr(rank, owner_name)
            setattr(owner, method, self._timed(label, getattr(owner, method)))
        self._guard_function = original = StaleReadGuard.__torch_function__

        def counted(mode, func, types, args=(), kwargs=None):
            self.calls[_GUARD_CALLS] += 1
            return original(mode, func, types, args, kwargs)

        StaleReadGuard.__torch_function__ = counted

    def close(self) -> None:
        """Gives the guard's class its own __torch_function__ back."""
        StaleReadGuard.__torch_function__ = self._guard_function

    def _timed(self, label: str, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        return timed

    def reset(self) -> None:
        """At the first timed step: the warm-up's calls do not count."""
        self.seconds.clear()
        self.calls.clear()

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """Per hook, the milliseconds and calls of an average timed step."""
        timed = {label: {"ms": 1000 * self.seconds[label] / steps, "calls": self.calls[label] / steps}
                 for label, _, _ in _TIMED}
        return timed | {_GUARD_CALLS: {"calls": self.calls[_GUARD_CALLS] / steps}}
