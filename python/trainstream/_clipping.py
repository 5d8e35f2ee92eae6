"""torch.nn.utils.clip_grad_norm_ on wrapped parameters: the daemon clips the step, exactly as torch would.

A wrapped model's gradients leave for the daemon during backward, so p.grad is empty when a training loop
clips. While trainstream is imported, torch.nn.utils.clip_grad_norm_ (and what frameworks call instead:
Lightning's gradient_clip_val goes through it; accelerate's Accelerator.clip_grad_norm_, which the Hugging
Face Trainer's max_grad_norm uses, reads p.grad itself and is taken over once accelerate is loaded) asks
the daemon to clip the step's summed gradients to max_norm and returns their total norm as a tensor that
waits for the daemon when first read (_pending.py). Calls it cannot honour raise at the call, naming what to
do instead: another norm than 2, part of a wrapped model's parameters, wrapped parameters beside others
with gradients, clip_grad_value_, clip_grads_with_norm_ with a norm it did not compute.

Invariants: parameters no wrapped job trains go to torch's own functions untouched; a call on wrapped
parameters either clips the step in the daemon or raises before anything changed.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.utils.clip_grad as _clip_grad

from trainstream._C import TrainstreamError
from trainstream._pending import PendingScalar
from trainstream._rank import Rank, rank_of

_torch_clip_grad_norm_ = _clip_grad.clip_grad_norm_
_torch_clip_grad_value_ = _clip_grad.clip_grad_value_
_torch_clip_grads_with_norm_ = torch.nn.utils.clip_grads_with_norm_


def _parameters(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _wrapped_rank(params: list[torch.Tensor], call: str) -> Rank | None:
    """The one Rank that trains every wrapped parameter among `params` and all of its own (None: no
    parameter is wrapped); raises for any mix trainstream cannot clip as torch would."""
    ranks = {}
    others = 0
    for p in params:
        rank = rank_of(p)
        if rank is None:
            others += p.grad is not None
        else:
            ranks[id(rank)] = rank
    if not ranks:
        return None
    if len(ranks) > 1:
        raise TrainstreamError(f"{call} over the parameters of {len(ranks)} wrapped models at once: trainstream clips "
                               "each model's step in its own job; clip each model's parameters in its own call")
    (rank,) = ranks.values()
    if others:
        raise TrainstreamError(f"{call} over a wrapped model's parameters and {others} other parameter(s) with "
                               "gradients: trainstream clips the wrapped ones in the daemon, which cannot see the "
                               "others; clip them in separate calls, or wrap the model that holds them all")
    given = {id(p) for p in params}
    missing = [p for p in rank.params if id(p) not in given and p.requires_grad]
    if missing:
        raise TrainstreamError(f"{call} over {len(rank.params) - len(missing)} of the wrapped model's "
                               f"{len(rank.params)} trained parameters: trainstream clips the norm of all of them "
                               "(pass model.parameters(), or the optimizer's parameters)")
    return rank


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    params = _parameters(parameters)
    rank = _wrapped_rank(params, "clip_grad_norm_")
    if rank is None:
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if float(norm_type) != 2.0:
        raise TrainstreamError(f"clip_grad_norm_ with norm_type={norm_type} on a wrapped model: trainstream clips by "
                               "the 2-norm (norm_type=2.0)")
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise TrainstreamError(f"clip_grad_norm_ with max_norm={max_norm} on a wrapped model: trainstream clips to "
                               "a max_norm > 0 (math.inf takes the norm without clipping)")
    norm = _pending_norm(rank, rank.request_norm(max_norm))
    rank.last_grad_norm = norm
    if error_if_nonfinite and not math.isfinite(norm.item()):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
                           "the non-finite norm anyway, set `error_if_nonfinite=False`")
    return norm


def _pending_norm(rank: Rank, asked: tuple[int, int]) -> PendingScalar:
    """The step's total gradient norm, as torch's clip_grad_norm_ returns it: a 0-dim tensor of the
    parameters' dtype on their device."""
    first = rank.params[0]

    def resolve() -> torch.Tensor:
        norm, _ = rank.terms.wait(asked)
        return torch.tensor(norm, dtype=torch.float64)

    norm = PendingScalar(resolve, rank.model_dtype(first), first.device)
    rank.terms.read_later(asked, norm)
    return norm


def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    params = _parameters(parameters)
    if any(rank_of(p) is not None for p in params):
        raise TrainstreamError("clip_grad_value_ on a wrapped model: its gradients are in the daemon, which clips by "
                               "norm only; use torch.nn.utils.clip_grad_norm_ (or wrap(max_grad_norm=...))")
    return _torch_clip_grad_value_(params, clip_value, foreach)


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    params = _parameters(parameters)
    if any(rank_of(p) is not None for p in params):
        raise TrainstreamError("clip_grads_with_norm_ on a wrapped model: its gradients are in the daemon, which takes "
                               "their norm itself; use torch.nn.utils.clip_grad_norm_, which clips and returns it")
    return _torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach)


def install() -> None:
    """Puts the takeovers where training code looks them up (torch.nn.utils and its clip_grad module;
    accelerate's Accelerator where it is loaded)."""
    for module in (torch.nn.utils, _clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
    install_accelerate()


def install_accelerate() -> None:
    """Accelerator.clip_grad_norm_ of wrapped parameters unscales (its GradScaler's unscale_, into the
    step's terms) and clips in the daemon; other parameters go through accelerate's own. Once accelerate
    is loaded: at import of trainstream, and again at each wrap()."""
    accelerator = sys.modules.get("accelerate.accelerator")
    if accelerator is None or getattr(accelerator.Accelerator.clip_grad_norm_, "_trainstream", False):
        return
    accelerate_clip = accelerator.Accelerator.clip_grad_norm_

    def accelerator_clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = _parameters(parameters)
        if _wrapped_rank(params, "Accelerator.clip_grad_norm_") is None:
            return accelerate_clip(self, params, max_norm, norm_type)
        self.unscale_gradients()
        return clip_grad_norm_(params, max_norm, norm_type)

    accelerator_clip_grad_norm_._trainstream = True
    accelerator.Accelerator.clip_grad_norm_ = accelerator_clip_grad_norm_

