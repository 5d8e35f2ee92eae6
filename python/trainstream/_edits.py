"""Which wrapped parameters the user changed in place since trainstream last wrote them.

torch trains whatever a parameter holds when the next forward reads it: `model.apply(init)` after wrap,
`p.copy_(pretrained)` or a clamp under torch.no_grad(). trainstream holds the master weights in the
daemon, whose next weights would overwrite such a change, so the Rank asks here at each forward's start
and at optimizer.step() (_rank.Rank.take_edits) and publishes the changed weights or refuses.

A change is seen by the parameter's version counter: every in-place op on it or on a detached view of
it bumps it, under torch.no_grad() too, and so do writes through `p.data` of a watched parameter (it is
`p.detach()` there, _watched.py). Not seen: writes through `p.data` between a forward and its backward
(torch's own `p.data`, which shares no version counter), and writes by code that is not torch (numpy
views, ctypes) (docs/porting.md, "Not caught yet").

The check runs at every forward's start: 11 us for 150 parameters on the 2-core dev box (a Python loop
over their `_version`), against the milliseconds of a step.

Invariant: after `note(i)`, `edited()` lists i only once an in-place op changed parameter i.
"""

from __future__ import annotations

from typing import Iterable

import torch


class WeightEdits:
    def __init__(self, params: list[torch.nn.Parameter], tracked: Iterable[int]):
        self.params = params
        self.tracked = sorted(tracked)  # paged parameters are not: their storage is the pager's slot
        self.versions = [0] * len(params)
        self.note(self.tracked)

    def note(self, indices: Iterable[int]) -> None:
        """Parameters `indices` now hold what trainstream wrote (or published)."""
        for i in indices:
            self.versions[i] = self.params[i]._version

    def note_all(self) -> None:
        self.note(self.tracked)

    def edited(self, indices: Iterable[int] | None = None) -> list[int]:
        """The parameters among `indices` (all tracked ones by default) changed since noted."""
        params, versions = self.params, self.versions
        return [i for i in (self.tracked if indices is None else indices) if params[i]._version != versions[i]]
