"""torch.amp.GradScaler with a wrapped optimizer: the AMP loss-scaling protocol, run in the daemon.

A GradScaler unscales p.grad and checks it for inf/NaN (`GradScaler._unscale_grads_`), then skips
optimizer.step() where it found any. A wrapped model's gradients are in the daemon instead, so for its
optimizer that check is the daemon's: unscale_ multiplies the step's gradients by the inverse scale there
(the step's terms carry it), and the found-inf flag is the daemon's verdict on the step's gradients, a
tensor that waits for it when read (the scaler reads it before it steps, as it does torch's). A skipped
step never commits: the loop's zero_grad() drops its gradients in the daemon, as it drops p.grad in torch
(a loop that does not zero them sums them into the next step in both). The scaler's own scale, growth and
backoff run as in torch, on the same verdicts.

Invariant: every other optimizer's gradients go through torch's own `_unscale_grads_`.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import GradScaler

from trainstream._optimizer import OffloadedOptimizer
from trainstream._pending import PendingScalar

_torch_unscale_grads_ = GradScaler._unscale_grads_


def _unscale_grads_(self: GradScaler, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                    allow_fp16: bool) -> dict:
    if not isinstance(optimizer, OffloadedOptimizer) or not optimizer.offloaded:
        return _torch_unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16)
    rank = optimizer.job_rank
    rank.unscale(float(inv_scale))  # 1.0 from the scaler's own check before a step without unscale_
    asked = rank.request_norm(0.0)

    def resolve() -> torch.Tensor:
        _, nonfinite = rank.terms.wait(asked)
        return torch.tensor(1.0 if nonfinite else 0.0)

    found = PendingScalar(resolve, found_inf.dtype, found_inf.device)
    rank.terms.read_later(asked, found)
    return {found_inf.device: found}


def install() -> None:
    GradScaler._unscale_grads_ = _unscale_grads_
