"""chunked_cross_entropy against the full computation F.cross_entropy(F.linear(...).float(), ...) (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from trainstream import TrainstreamError
from trainstream._losses import chunked_cross_entropy

N, H, V = 24, 16, 37  # tokens (as 2 x 12), width, vocabulary


def make(dtype=torch.float32, bias=False, seed=0, ignored=(3, 17)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, N // 2, H, generator=g).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(V, generator=g)).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (2, N // 2), generator=g)
    targets.view(-1)[list(ignored)] = -100
    return hidden, weight, b, targets


def full(hidden, weight, targets, bias=None, ignore_index=-100, reduction="mean", logit_dtype=torch.float32):
    logits = F.linear(hidden, weight, bias).to(logit_dtype)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction=reduction)


def value_and_grads(fn, inputs):
    loss = fn()
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, wanted) if wanted else ()


def assert_same(inputs, chunked, reference, **tolerance):
    loss, grads = value_and_grads(chunked, inputs)
    loss_ref, grads_ref = value_and_grads(reference, inputs)
    assert loss.dtype == loss_ref.dtype
    torch.testing.assert_close(loss, loss_ref, **tolerance)
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape
        torch.testing.assert_close(g, g_ref, **tolerance)


FP32 = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("chunk_size", [1, 5, 12, N, N + 100])  # 5 does not divide 24; N + 100 > N
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_full(chunk_size, reduction, bias):
    hidden, weight, b, targets = make(bias=bias)
    assert_same((hidden, weight, b),
                lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, reduction=reduction,
                                              bias=b),
                lambda: full(hidden, weight, targets, b, reduction=reduction), **FP32)


def test_default_chunk_size_and_no_ignored_tokens():
    hidden, weight, _, targets = make(ignored=())
    assert_same((hidden, weight), lambda: chunked_cross_entropy(hidden, weight, targets),
                lambda: full(hidden, weight, targets), **FP32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignore_index_of_a_real_class(reduction):
    hidden, weight, _, targets = make(ignored=())
    targets.view(-1)[::3] = 5  # class 5 is a real class: ignoring it must drop exactly those tokens
    assert_same((hidden, weight),
                lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=7, ignore_index=5,
                                              reduction=reduction),
                lambda: full(hidden, weight, targets, ignore_index=5, reduction=reduction), **FP32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_tokens_ignored_as_torch(reduction):
    hidden, weight, b, targets = make(bias=True)
    targets.fill_(-100)
    loss, grads = value_and_grads(
        lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=5, reduction=reduction, bias=b),
        (hidden, weight, b))
    loss_ref, grads_ref = value_and_grads(lambda: full(hidden, weight, targets, b, reduction=reduction),
                                          (hidden, weight, b))
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(loss_ref)  # torch: 0 / 0
    else:
        assert loss.item() == 0.0 and loss_ref.item() == 0.0
    for g, g_ref in zip(grads, grads_ref):
        assert torch.count_nonzero(g_ref) == 0 and torch.count_nonzero(g) == 0  # zero, not nan


def test_no_tokens():
    hidden, weight = torch.randn(0, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    targets = torch.zeros(0, dtype=torch.long)
    assert torch.isnan(chunked_cross_entropy(hidden, weight, targets)) and torch.isnan(full(hidden, weight, targets))
    assert chunked_cross_entropy(hidden, weight, targets, reduction="sum").item() == 0.0


@pytest.mark.parametrize("frozen", ["hidden", "weight", "bias", "hidden+weight"])
def test_inputs_without_grad(frozen):
    hidden, weight, b, targets = make(bias=True)
    for name, x in (("hidden", hidden), ("weight", weight), ("bias", b)):
        if name in frozen:
            x.requires_grad_(False)
    assert_same((hidden, weight, b),
                lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=5, bias=b),
                lambda: full(hidden, weight, targets, b), **FP32)


def test_nothing_requires_grad():
    hidden, weight, _, targets = make()
    hidden.requires_grad_(False), weight.requires_grad_(False)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=5)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, full(hidden, weight, targets), **FP32)


def test_non_contiguous_hidden_and_targets():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(N // 2, 2, H, generator=g, requires_grad=True)
    hidden = base.transpose(0, 1)  # (2, 12, H), not contiguous: reshape must copy
    weight = torch.randn(2 * H, V, generator=g).t()[:, ::2].detach().requires_grad_()  # (V, H), strided
    targets = torch.randint(0, V, (N // 2, 2), generator=g).t()
    assert not hidden.is_contiguous() and not weight.is_contiguous() and not targets.is_contiguous()
    assert_same((base, weight), lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=5),
                lambda: full(hidden, weight, targets), **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [5, N])
def test_16bit_inputs_match_the_same_full_computation(dtype, chunk_size):
    hidden, weight, b, targets = make(dtype, bias=True)
    # The full computation rounds the gradient of the logits to 16 bits and each gradient once; the
    # chunked one rounds the weight's and bias's per chunk and sums the chunks in fp32.
    tolerance = {"rtol": 1e-2, "atol": 2e-3} if dtype == torch.bfloat16 else {"rtol": 1e-3, "atol": 3e-4}
    assert_same((hidden, weight, b),
                lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, bias=b),
                lambda: full(hidden, weight, targets, b), **tolerance)


def test_16bit_single_chunk_is_the_full_computation():
    hidden, weight, _, targets = make(torch.bfloat16)
    # One chunk: the same products of the same 16-bit values; only the loss's summation differs.
    loss, grads = value_and_grads(lambda: chunked_cross_entropy(hidden, weight, targets), (hidden, weight))
    loss_ref, grads_ref = value_and_grads(lambda: full(hidden, weight, targets), (hidden, weight))
    torch.testing.assert_close(loss, loss_ref, **FP32)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-2, atol=1e-4)  # bf16: within one rounding


@pytest.mark.parametrize("chunk_size", [5, N])
def test_autocast_bf16_with_fp32_weights(chunk_size):
    hidden, weight, b, targets = make(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = value_and_grads(
            lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, bias=b), (hidden, weight, b))
        loss_ref, grads_ref = value_and_grads(lambda: full(hidden, weight, targets, b), (hidden, weight, b))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.float32  # gradients in the parameters' dtype, as autograd gives them
        torch.testing.assert_close(g, g_ref, rtol=2e-2, atol=2e-3)
    # and the logits were computed in bf16: the result differs from fp32's by bf16 rounding, not fp32's
    exact = full(hidden, weight, targets, b).detach()
    assert 1e-5 < (loss - exact).abs().item() < 5e-2


def test_autocast_backward_outside_the_autocast_region():
    hidden, weight, _, targets = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=5)
        loss_ref = full(hidden, weight, targets)
    grads = torch.autograd.grad(loss, (hidden, weight))  # backward after the context ended, as usual
    grads_ref = torch.autograd.grad(loss_ref, (hidden, weight))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=2e-2, atol=2e-3)


def test_tied_embedding():
    g = torch.Generator().manual_seed(2)
    embedding = torch.nn.Embedding(V, H)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(V, H, generator=g))
    tokens = torch.randint(0, V, (2, N // 2), generator=g)
    targets = torch.randint(0, V, (2, N // 2), generator=g)

    def loss_of(fn):
        embedding.weight.grad = None
        hidden = torch.tanh(embedding(tokens))
        fn(hidden).backward()
        return embedding.weight.grad.clone()

    grad = loss_of(lambda x: chunked_cross_entropy(x, embedding.weight, targets, chunk_size=5))
    grad_ref = loss_of(lambda x: full(x, embedding.weight, targets))
    torch.testing.assert_close(grad, grad_ref, **FP32)
    # both paths contribute: the embedding rows of the tokens get more than the output projection's part
    only_projection = loss_of(lambda x: chunked_cross_entropy(x.detach(), embedding.weight, targets, chunk_size=5))
    assert not torch.allclose(grad, only_projection)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradcheck_float64(reduction):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.tensor([0, 4, -100, 2, 2, 1, 3])
    assert torch.autograd.gradcheck(
        lambda h, w, bb: chunked_cross_entropy(h, w, targets, chunk_size=3, reduction=reduction, bias=bb),
        (hidden, weight, b))


def test_float64_and_logit_dtype():
    hidden, weight, _, targets = make(torch.float64)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=5)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, full(hidden, weight, targets, logit_dtype=torch.float64), rtol=1e-12, atol=0)
    hidden, weight, _, targets = make()
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=5, logit_dtype=torch.float64)
    assert loss.dtype == torch.float64
    # The logits themselves come from a float32 matmul, whose rounding depends on how many rows it
    # gets at once (on an AVX2-only machine the 5-row chunks and the whole batch differ by 7e-9).
    torch.testing.assert_close(loss, full(hidden, weight, targets, logit_dtype=torch.float64), rtol=1e-6, atol=0)


def test_large_logits_are_stable():
    hidden, weight, _, targets = make()
    with torch.no_grad():
        hidden.mul_(300)  # logits in the thousands: a plain exp would overflow
    assert_same((hidden, weight), lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=5),
                lambda: full(hidden, weight, targets), rtol=1e-5, atol=1e-3)


def test_saves_no_tokens_by_vocabulary_tensor():
    n, v = 64, 500
    hidden = torch.randn(n, H, requires_grad=True)
    weight = torch.randn(v, H, requires_grad=True)
    targets = torch.randint(0, v, (n,))

    def saved_numels(fn):
        numels = []

        def pack(t):
            numels.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return numels

    chunked = saved_numels(lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=8))
    reference = saved_numels(lambda: full(hidden, weight, targets))
    assert max(reference) >= n * v  # the hook sees the full computation's logits
    assert max(chunked) < n * v
    assert sum(chunked) <= hidden.numel() + weight.numel() + 2 * n  # hidden, weight, targets, log-sum-exp


def peak_bytes(fn) -> int:
    """Peak of the CPU memory allocated while `fn` runs, from the profiler's allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]":
            live += event.nbytes()  # allocations positive, frees negative, in order
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_memory_is_about_one_chunk(dtype):
    n, v, chunk = 512, 1000, 64
    hidden = torch.randn(n, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, H, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    results = hidden.numel() * hidden.element_size() + weight.numel() * 4  # grad_hidden, fp32 grad_weight
    per_logit = 4 if dtype == torch.float32 else 4 + 2  # fp32 logits (+ their 16-bit copy)
    peak = peak_bytes(lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk).backward())
    peak_full = peak_bytes(lambda: full(hidden, weight, targets).backward())
    assert peak_full > n * v * 4  # the measurement sees the full logits
    assert peak <= chunk * v * per_logit * 1.25 + results + 64 * 1024


@pytest.mark.parametrize("call, message", [
    (lambda h, w, t: chunked_cross_entropy(h, w[:, :-1], t), r"weight must be of shape \(V, 16\)"),
    (lambda h, w, t: chunked_cross_entropy(h, w[0], t), "weight must be a floating-point tensor of shape"),
    (lambda h, w, t: chunked_cross_entropy(h, w.long(), t), "weight must be a floating-point tensor"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t[:, :-1]), r"targets must be of shape \(2, 12\)"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t.float()), "targets must be an integer tensor"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t == 1), "targets must be an integer tensor"),
    (lambda h, w, t: chunked_cross_entropy(h.long(), w, t), "hidden must be a floating-point tensor"),
    (lambda h, w, t: chunked_cross_entropy(h.detach().numpy(), w, t), "hidden must be a floating-point tensor"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_size=2.0), "chunk_size must be an integer >= 1"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_size=True), "chunk_size must be an integer >= 1"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, reduction="none"), "reduction must be 'mean' or 'sum'"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, ignore_index=None), "ignore_index must be an integer"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, bias=torch.zeros(V + 1)), r"bias must be None or .*\(37,\)"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, logit_dtype=torch.bfloat16), "logit_dtype must be None, "),
    (lambda h, w, t: chunked_cross_entropy(h, w.double(), t), "hidden, weight and bias must be of one dtype"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t.to("meta")), "hidden, weight, targets and bias must be on one "
                                                                 "device, got .*meta"),
])
def test_bad_arguments(call, message):
    hidden, weight, _, targets = make()
    with pytest.raises(TrainstreamError, match=f"chunked_cross_entropy: {message}"):
        call(hidden, weight, targets)
