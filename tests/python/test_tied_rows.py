"""benchmarks/train_gpt/tied_rows.py: a tied embedding's gradient is its projection's part plus its
lookup's, bit for bit, and the lookup's part on compact rows is the full one's rows; on the CPU, where
every backward here is repeatable."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_gpt"))
from tied_rows import check_exact, compact, split_backward, tokens_of  # noqa: E402

import gpt  # noqa: E402


@pytest.mark.parametrize("kind", ["uniform", "markov"])
def test_the_split_gradient_equals_torchs_tied_gradient_bit_for_bit(kind):
    torch.manual_seed(0)
    model = gpt.GPT(gpt.TINY)
    tokens = tokens_of(kind, gpt.TINY.vocab, 4, 64, "cpu")
    checks = check_exact(model, tokens[:, :-1], tokens[:, 1:], autocast=False)
    rows = checks.pop("rows")
    assert checks == dict.fromkeys(checks, True)
    assert rows == tokens[:, :-1].unique().numel()


def test_compact_rows_are_the_sorted_distinct_tokens_and_their_summed_gradients():
    ids = torch.tensor([[5, 2, 5], [9, 2, 5]])
    out_grad = torch.arange(6 * 2, dtype=torch.float32).view(2, 3, 2)
    row_ids, rows, count = compact(ids, out_grad)
    assert int(count) == 3 and row_ids[:3].tolist() == [2, 5, 9]
    assert rows[:3].tolist() == [[2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11], [6, 7]]
    assert not rows[3:].any() and not row_ids[3:].any()  # padding: one row a token


def test_the_detached_lookup_probe_leaves_the_tied_weight_the_projections_gradient_alone():
    """train_gpt --probe-detached-lookup: the step without the lookup's gradient, not training."""
    torch.manual_seed(0)
    model = gpt.GPT(gpt.TINY)
    torch.manual_seed(0)
    probe = gpt.GPT(gpt.TINY, detached_lookup=True)
    tokens = tokens_of("markov", gpt.TINY.vocab, 4, 64, "cpu")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    split_backward(model, inputs, targets, autocast=False)
    projection = model.wte.weight.grad.clone()
    probe(inputs, targets).backward()
    assert torch.equal(probe.wte.weight.grad, projection)
    model.zero_grad(set_to_none=True)
    model(inputs, targets).backward()
    assert not torch.equal(model.wte.weight.grad, projection)  # the lookup's part is what the probe drops
