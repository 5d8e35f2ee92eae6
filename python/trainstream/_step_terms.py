"""What a step tells the daemon besides its gradients (docs/architecture.md, "Step protocol"): its param
groups' hyperparameters, the multiplier a GradScaler's unscale_ left on the gradients, the norm
clip_grad_norm_ (or the scaler's inf check) asked for and what to clip it to, and at optimizer.step() the
micro-batch count; and the tensors that will read the norms the daemon sends back.

The Rank owns one per job and calls it under its lock, with the step and micro-batch count it keeps.
Invariants: a step's hyperparameters are those of its first backward pass (the daemon may start the
update with them), so a change before optimizer.step() is refused there; a step's norm terms go out at
most once with a clipping (a second clip_grad_norm_ is refused), before its commit terms; a norm asked for
is read from the daemon before the client forgets it (it keeps the last few steps'), whether the step
commits or zero_grad() drops its gradients.
"""

from __future__ import annotations

import math
import weakref

import torch

from trainstream._C import TrainstreamError


class StepTerms:
    def __init__(self, session, max_grad_norm: float | None, groups: list[dict]):
        self.session = session
        self.groups = groups  # the optimizer's param_groups: LR schedulers change them between steps
        self._hparams: list[tuple] = []  # the groups' values at the step's first backward
        self.max_grad_norm = max_grad_norm  # wrap()'s: every step clipped to it
        self.grad_factor = 1.0  # what a GradScaler's unscale_ multiplied the step's gradients by
        self.discards = 0       # zero_grad() calls that dropped this step's gradients
        # The step whose norm was asked for, and the max norm the loop's clip_grad_norm_ asked (0: only a
        # GradScaler's inf check, which wrap(max_grad_norm=...) makes a clipping too)
        self.norm: tuple[int, float] | None = None
        # Norms asked for (step, discards before), and the tensors that will read them: the client keeps only
        # the last few steps' norms, so each step settles those of the steps before (settle).
        self._readers: dict[tuple[int, int], list[weakref.ref]] = {}
        self._settled: dict[tuple[int, int], tuple[float, bool]] = {}

    def write_hparams(self, steps: set[int]) -> None:
        """At a step's first backward pass: the param groups' current values, for the steps its buckets
        collect."""
        self._hparams = self._hparams_now()
        for step in steps:
            for g, values in enumerate(self._hparams):
                self.session.set_hparams(step, g, *values)

    def check_hparams_unchanged(self) -> None:
        """optimizer.step(): the update may have started with the values of the step's first backward (the
        daemon reads them then), so a change since cannot apply to this step as torch would apply it."""
        names = ("lr", "beta1", "beta2", "eps", "weight_decay")
        for g, (now, written) in enumerate(zip(self._hparams_now(), self._hparams)):
            for name, a, b in zip(names, written, now):
                if a != b:
                    raise TrainstreamError(
                        f"optimizer.step(): param group {g}'s {name} changed from {a} to {b} after this step's first "
                        "backward(), which the step's update already uses: change hyperparameters after "
                        "optimizer.step() (a scheduler's step()) or before the step's first backward()")

    def _hparams_now(self) -> list[tuple]:
        return [(float(g["lr"]), *map(float, g["betas"]), float(g["eps"]), float(g["weight_decay"]))
                for g in self.groups]

    def unscale(self, inv_scale: float) -> None:
        """A GradScaler's unscale_: the step's gradients are multiplied by `inv_scale` from now on."""
        if self.norm is not None and inv_scale != 1.0:
            raise TrainstreamError("a GradScaler's unscale_ after clip_grad_norm_ in the same step: unscale first")
        self.grad_factor *= inv_scale

    def request_norm(self, step: int, micro: int, max_norm: float) -> tuple[int, int]:
        """clip_grad_norm_ (or a GradScaler's inf check, max_norm 0) after `micro` backward passes of `step`:
        the daemon clips them to `max_norm` and sends their norm; returns what to wait on (wait)."""
        asked = self.norm[1] if self.norm is not None else 0.0
        if max_norm > 0 and asked > 0 and max_norm != asked:
            raise TrainstreamError(f"clip_grad_norm_ called twice in one step (max_norm {asked} and "
                                   f"{max_norm}): trainstream clips each step once")
        if max_norm == asked and 0 < max_norm < math.inf:
            raise TrainstreamError(
                f"clip_grad_norm_ called twice in one step (max_norm {max_norm} both times): torch's second call "
                "returns the norm of the gradients the first one clipped, which trainstream does not take; clip "
                "once a step (the first call returned the norm)")
        if self.max_grad_norm is not None and max_norm > 0 and max_norm != self.max_grad_norm:
            raise TrainstreamError(f"clip_grad_norm_ with max_norm={max_norm}, but wrap(max_grad_norm="
                                   f"{self.max_grad_norm}) clips every step already: drop one of the two")
        clips_to = self.max_grad_norm if max_norm == 0 and self.max_grad_norm is not None else max_norm
        if self.norm is None or clips_to > 0:
            self.session.send_norm_terms(step, micro, self.grad_factor, clips_to)
        self.norm = (step, max(max_norm, asked))
        return step, self.discards

    def commit(self, step: int, micro: int) -> None:
        """optimizer.step() after `micro` backward passes: the step's terms go out, the next step starts."""
        if self.max_grad_norm is not None and self.norm is None:
            self.session.send_norm_terms(step, micro, self.grad_factor, self.max_grad_norm)
        self.session.send_commit_terms(step, micro, self.grad_factor)
        self.settle(step, wait=False)
        self.discards = 0
        self._restart()

    def discard(self, step: int) -> None:
        """zero_grad() mid-step: the step's gradients so far are dropped (the next backward pass starts it
        again); the dropped gradients' norms stay what they were for their readers."""
        self.settle(step, wait=True)
        self.discards += 1
        self.session.discard(step, self.discards)
        self._restart()

    def _restart(self) -> None:
        self.grad_factor = 1.0
        self.norm = None

    def wait(self, asked: tuple[int, int]) -> tuple[float, bool]:
        """The norm request_norm asked for (times the GradScaler's factor), and whether some gradients are
        inf or NaN: waits for the daemon."""
        settled = self._settled.get(asked)
        return settled if settled is not None else self.session.wait_step_norm(asked[0])

    def read_later(self, asked: tuple[int, int], reader: torch.Tensor) -> None:
        """`reader` (a PendingScalar) will read the norm `asked` for, maybe steps later."""
        self._readers.setdefault(asked, []).append(weakref.ref(reader))

    def settle(self, step: int, wait: bool) -> None:
        """The norms asked for before `step`'s current attempt (`wait`: and this one's too) go to the
        tensors that will read them, before the client forgets them."""
        current = (step, self.discards)
        for asked in [a for a in self._readers if a != current or wait]:
            readers = self._readers.pop(asked)
            alive = [r for r in (ref() for ref in readers) if r is not None]
            if alive:
                self._settled[asked] = self.session.wait_step_norm(asked[0])
                for reader in alive:
                    reader.value()
                del self._settled[asked]
