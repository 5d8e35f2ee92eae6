"""A 0-dim tensor whose value the daemon sends later: the gradient norm `clip_grad_norm_` returns, a
GradScaler's inf check. Reading it (`.item()`, `float()`, printing, any torch op on it) waits for the value,
once; until then the training loop goes on, as it does with torch's own tensors on a GPU that has not
computed them yet.

Invariant: it behaves as the plain tensor `resolve()` returns, of the dtype and device given; every op on
it is an op on that tensor (its results are plain tensors).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._pytree import tree_map


class PendingScalar(torch.Tensor):
    @staticmethod
    def __new__(cls, resolve: Callable[[], torch.Tensor], dtype: torch.dtype, device: torch.device):
        tensor = torch.Tensor._make_wrapper_subclass(cls, (), dtype=dtype, device=device)
        tensor._resolve = resolve
        tensor._value = None
        return tensor

    def __init__(self, resolve, dtype, device):
        super().__init__()

    def value(self) -> torch.Tensor:
        """The plain tensor, once known (waits for it the first time)."""
        if self._value is None:
            self._value = self._resolve().to(dtype=self.dtype, device=self.device).reshape(())
            self._resolve = None
        return self._value

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            return a.value() if isinstance(a, PendingScalar) else a
        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))

    def __repr__(self, **kwargs) -> str:
        return repr(self.value())

    def __format__(self, spec: str) -> str:
        return self.value().__format__(spec)

    def tolist(self):
        return self.value().tolist()

    def numpy(self, *args, **kwargs):
        return self.value().numpy(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return self.value().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.value().clone()
