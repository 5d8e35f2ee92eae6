"""wrap(activation_offload=...): the model's forward runs inside trainstream.activation_paging(), which keeps
the tensors autograd saves for backward in pinned host memory.

  True        every saved activation is paged (activation_paging's own threshold: at least 1 MiB each);
  a fraction  that share of the saved bytes, the first ones (activation_paging's max_bytes), of the bytes
              the first step saved (it pages everything);
  "auto"      the first step pages everything and is measured: the bytes a forward paged, A, and the peak
              of torch's allocated memory, P. Kept on the GPU, K bytes of them would raise the peak to about
              P + K; the largest K with (P + K) x MARGIN + RESERVE within the memory budget (_budget.py)
              stays, the first A - K bytes page (none when everything fits, all when nothing does);
  False       nothing (the default).
Decided at the first optimizer.step() and logged once (logger "trainstream"). On the CPU nothing pages:
activation_paging pages CUDA tensors only (its context is entered all the same; "auto" enters none, and
says so).

Invariants: one paging context per outermost forward of the model (nested calls share it), entered before
and left after the weight pager's saved-tensor hooks (which hand it the tensors they do not take).
"""

from __future__ import annotations

import logging
import math

import torch

from trainstream import _budget
from trainstream._C import TrainstreamError
from trainstream.activations.paging import activation_paging

MARGIN = 1.10
RESERVE = 256 << 20
GIB = 1 << 30

log = logging.getLogger("trainstream")


def check(mode) -> None:
    if mode is True or mode is False or mode == "auto":
        return
    if isinstance(mode, (int, float)) and not isinstance(mode, bool) and 0 < mode <= 1:
        return
    raise TrainstreamError(f"activation_offload={mode!r}: use 'auto', True, False or a fraction in (0, 1] of the "
                           "saved activations")


def bytes_to_page(saved: int, peak: int, budget: int) -> int:
    """How many of the `saved` bytes a forward pages under "auto", from a step that paged them all and
    peaked at `peak` bytes."""
    keep = (budget - RESERVE) / MARGIN - peak
    return int(min(saved, max(0.0, saved - keep)))


class ActivationOffload:
    def __init__(self, model: torch.nn.Module, mode, device: torch.device):
        check(mode)
        self.mode = mode
        self.device = device
        self.max_bytes: int | None = None   # None: page everything
        self.measuring = mode == "auto" or not isinstance(mode, bool)
        self.saved = 0                      # the most a forward paged while measuring
        self.depth = 0
        self.context: activation_paging | None = None
        self.handles = []
        if mode is False:
            return
        if mode == "auto" and device.type != "cuda":
            log.info("activation_offload='auto' on %s: nothing pages (activation paging moves CUDA tensors)", device)
            self.measuring = False
            return
        if self.measuring and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.handles = [model.register_forward_pre_hook(lambda m, args: self._forward_starts(), prepend=True),
                        model.register_forward_hook(lambda m, args, out: self._forward_ends(), always_call=True)]

    def _forward_starts(self) -> None:
        self.depth += 1
        if self.depth == 1 and self.max_bytes != 0:
            self.context = activation_paging(max_bytes=self.max_bytes)
            self.context.__enter__()

    def _forward_ends(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.context is not None:
            self.context.__exit__(None, None, None)
            self.saved = max(self.saved, self.context.paged_bytes)
            self.context = None

    def after_step(self) -> None:
        """At the first optimizer.step(): the share to page from now on."""
        if not self.measuring:
            return
        self.measuring = False
        if self.mode == "auto":
            peak = torch.cuda.max_memory_allocated(self.device)
            budget = _budget.available(self.device)
            self.max_bytes = bytes_to_page(self.saved, peak, budget.bytes)
            log.info("activation_offload='auto': pages %.2f of %.2f GiB of saved activations per forward (%.0f%%): "
                     "measured peak %.2f GiB with all paged, budget %.2f GiB (%s), margin x%s + %d MiB",
                     self.max_bytes / GIB, self.saved / GIB, 100 * self.max_bytes / max(self.saved, 1), peak / GIB,
                     budget.bytes / GIB, budget.source, MARGIN, RESERVE >> 20)
        else:
            self.max_bytes = math.ceil(self.mode * self.saved)
            log.info("activation_offload=%s: pages %.2f of %.2f GiB of saved activations per forward", self.mode,
                     self.max_bytes / GIB, self.saved / GIB)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
