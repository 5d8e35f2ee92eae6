"""chunked_cross_entropy: a language model's output projection and cross-entropy loss without the full logits.

    loss = trainstream.chunked_cross_entropy(hidden, model.lm_head.weight, targets)
    # same value and gradients as F.cross_entropy((hidden @ weight.T).float().flatten(0, -2), targets.flatten())

The (tokens x vocabulary) logits of a language model are often the largest tensor of a training step
(8 x 2048 tokens x 50304 words in fp32: 3.1 GiB, plus as much again for their gradient). Here the
forward and the backward run over chunks of `chunk_size` tokens; each chunk's logits exist only while
that chunk is being worked on, and backward recomputes them instead of keeping them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from trainstream._C import TrainstreamError

_REDUCTIONS = ("mean", "sum")
_LOGIT_DTYPES = (torch.float32, torch.float64)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunk_size: int = 4096, ignore_index: int = -100, reduction: str = "mean",
                          bias: torch.Tensor | None = None, logit_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The cross-entropy loss of the logits `hidden @ weight.T (+ bias)`, computed `chunk_size` tokens at a time.

    hidden (..., H) holds one row per token, weight (V, H) is the output projection (it may be tied to
    the input embedding: its gradient then adds to the embedding's, as usual), targets (...) holds the
    class of each token (integers; `ignore_index` marks tokens that do not count) and bias, optional,
    is (V,). The result is the loss of

        F.cross_entropy(F.linear(hidden, weight, bias).to(logit_dtype).flatten(0, -2), targets.flatten(),
                        ignore_index=ignore_index, reduction=reduction)

    including torch's edge cases: with reduction "mean" the sum over the counted tokens is divided by
    their number (no token counted: nan, and zero gradients), with "sum" it is not (no token counted: 0).

    Precision: the logits are computed as F.linear would compute them under the ambient autocast
    state (under autocast, in its dtype: bf16 or fp16; else in the inputs' dtype, which must then be
    one dtype), then converted to `logit_dtype` (default float32, float64 for float64 inputs;
    float32 or float64 allowed) for the softmax, as Hugging Face models do with `logits.float()`. The
    gradient of the logits, softmax - onehot scaled by the reduction, is formed in `logit_dtype` and
    converted back to the logits' dtype before the two matrix products that give the gradients of
    hidden and weight, as autograd does for the full computation. The results equal the full
    computation's up to floating-point rounding: the same operations in the same dtypes, summed in a
    different order (the loss through a log-sum-exp per chunk; the gradient of weight and bias as a
    sum of per-chunk products accumulated in fp32, or fp64 for fp64 inputs, then converted, where the
    full computation sums all tokens in one product).

    Memory: the forward keeps what backward needs: hidden, weight, bias, targets and one log-sum-exp
    per token, nothing of size tokens x V. One chunk's logits live at a time, in `logit_dtype`
    (chunk_size x V x 4 bytes for fp32), with a 16-bit copy beside them for a moment when they are
    computed in a 16-bit dtype (2 bytes more per logit); the log-sum-exp and, in backward, the
    gradient of the logits are formed in place in them. Backward also allocates the gradients it
    returns, and an fp32 accumulator for the weight's (V x H) when the weight is 16-bit. Each chunk's
    matrix product runs again in backward (the logits are recomputed): about a third more arithmetic
    for this layer than the full computation.

    Out-of-range targets fail in torch's gather, as they fail in F.cross_entropy. The result supports
    one backward pass (no double backward).
    """
    compute_dtype = _check(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, logit_dtype)
    if logit_dtype is None:
        logit_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    rows = hidden.reshape(-1, hidden.shape[-1])
    classes = targets.reshape(-1).long()
    return _ChunkedCrossEntropy.apply(rows, weight, bias, classes, chunk_size, ignore_index, reduction,
                                      compute_dtype, logit_dtype)


def _fail(argument: str, allowed: str, got) -> None:
    raise TrainstreamError(f"chunked_cross_entropy: {argument} must be {allowed}, got {got}")


def _check(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, logit_dtype) -> torch.dtype:
    """Validates the arguments; returns the dtype the logits are computed in."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        _fail("hidden", "a floating-point tensor of shape (..., H)", _describe(hidden))
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        _fail("weight", "a floating-point tensor of shape (V, H)", _describe(weight))
    if weight.shape[1] != hidden.shape[-1]:
        _fail("weight", f"of shape (V, {hidden.shape[-1]}) for hidden of shape {tuple(hidden.shape)}",
              tuple(weight.shape))
    if (not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex()
            or targets.dtype == torch.bool):
        _fail("targets", "an integer tensor of class indices", _describe(targets))
    if targets.shape != hidden.shape[:-1]:
        _fail("targets", f"of shape {tuple(hidden.shape[:-1])} (hidden's without its last dimension)",
              tuple(targets.shape))
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.shape != weight.shape[:1]:
            _fail("bias", f"None or a floating-point tensor of shape ({weight.shape[0]},)", _describe(bias))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        _fail("chunk_size", "an integer >= 1", repr(chunk_size))
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        _fail("ignore_index", "an integer", repr(ignore_index))
    if reduction not in _REDUCTIONS:
        _fail("reduction", " or ".join(repr(r) for r in _REDUCTIONS), repr(reduction))
    if logit_dtype is not None and logit_dtype not in _LOGIT_DTYPES:
        _fail("logit_dtype", "None, torch.float32 or torch.float64", repr(logit_dtype))
    tensors = {"hidden": hidden, "weight": weight, "targets": targets}
    if bias is not None:
        tensors["bias"] = bias
    devices = {name: str(t.device) for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        _fail("hidden, weight, targets and bias", "on one device", devices)

    floats = {name: t.dtype for name, t in tensors.items() if name != "targets"}
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        # Autocast runs F.linear in its dtype, casting every floating-point input but float64 ones.
        if all(d != torch.float64 for d in floats.values()):
            return torch.get_autocast_dtype(device_type)
    if len(set(floats.values())) > 1:
        _fail("hidden, weight and bias", "of one dtype (outside autocast)", floats)
    return hidden.dtype


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _no_autocast(device_type: str):
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  compute_dtype: torch.dtype, logit_dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits in `logit_dtype` (weight and bias already in `compute_dtype`)."""
    rows = rows.to(compute_dtype)
    logits = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
    return logits.to(logit_dtype)  # no copy when it is already logit_dtype


def _logsumexp_(logits: torch.Tensor, out: torch.Tensor) -> None:
    """torch.logsumexp(logits, dim=1) into `out`, overwriting `logits` instead of allocating a temporary
    of its size (as torch.logsumexp does): max + log(sum(exp(logits - max)))."""
    top = logits.amax(dim=1)
    top.masked_fill_(top.isinf(), 0)  # rows of infinities: as torch.logsumexp does
    logits.sub_(top[:, None]).exp_()
    torch.sum(logits, dim=1, out=out)
    out.log_().add_(top)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index, reduction, compute_dtype,
                logit_dtype):
        n = hidden.shape[0]
        # The casts below follow autocast's policy for F.linear; autocast itself is off so that it
        # does not cast again.
        with _no_autocast(hidden.device.type):
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            counted = targets != ignore_index
            classes = targets.masked_fill(~counted, 0)
            lse = torch.empty(n, dtype=logit_dtype, device=hidden.device)
            total = torch.zeros((), dtype=logit_dtype, device=hidden.device)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                logits = _chunk_logits(hidden[start:end], w, b, compute_dtype, logit_dtype)
                picked = logits.gather(1, classes[start:end, None]).squeeze(1)
                _logsumexp_(logits, out=lse[start:end])
                del logits
                losses = (lse[start:end] - picked).masked_fill(~counted[start:end], 0)
                total += losses.sum()
            if reduction == "mean":
                total = total / counted.sum()  # no token counted: 0 / 0 = nan, as in torch
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.config = (chunk_size, ignore_index, reduction, compute_dtype, logit_dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk_size, ignore_index, reduction, compute_dtype, logit_dtype = ctx.config
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n, device = hidden.shape[0], hidden.device
        grad_hidden = grad_weight = grad_bias = None
        if not (need_hidden or need_weight or need_bias):
            return (None,) * 9
        with _no_autocast(device.type):
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            counted = targets != ignore_index
            classes = targets.masked_fill(~counted, 0)
            scale = grad_loss.to(logit_dtype)
            if reduction == "mean":
                scale = scale / counted.sum()  # inf with no token counted: those rows are zeroed below
            if need_hidden:
                grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device)
            if need_weight:
                grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, logit_dtype),
                                          device=device)
            if need_bias:
                grad_bias = torch.zeros(bias.shape, dtype=torch.promote_types(bias.dtype, logit_dtype), device=device)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                rows = hidden[start:end].to(compute_dtype)
                # softmax - onehot, scaled, in logit_dtype, in place in the recomputed logits
                grad = _chunk_logits(rows, w, b, compute_dtype, logit_dtype)
                grad.sub_(lse[start:end, None]).exp_()
                minus_one = torch.full((end - start, 1), -1.0, dtype=logit_dtype, device=device)
                grad.scatter_add_(1, classes[start:end, None], minus_one)
                grad.mul_(scale).masked_fill_(~counted[start:end, None], 0)
                grad = grad.to(compute_dtype)  # the logits' dtype, as autograd converts it back
                if need_hidden:
                    if hidden.dtype == compute_dtype:
                        torch.mm(grad, w, out=grad_hidden[start:end])
                    else:
                        grad_hidden[start:end] = torch.mm(grad, w)
                if need_weight:
                    if grad_weight.dtype == compute_dtype:
                        grad_weight.addmm_(grad.t(), rows)
                    else:
                        grad_weight += torch.mm(grad.t(), rows)
                if need_bias:
                    grad_bias += grad.sum(0, dtype=grad_bias.dtype)
                del grad, rows
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None
