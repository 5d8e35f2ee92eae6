"""The tied embedding's gradient in its two parts: what splitting its update would rest on (issue 18).

A GPT's tied embedding gets two gradients in backward: the output projection's (dense over the whole
vocabulary, complete early in backward) and the token lookup's (non-zero only on the rows of the
batch's tokens, complete at backward's very end). The daemon updates the embedding once both are in,
so its update and copies run between backward's end and the next forward's first kernel: 11.8 ms of
a 38.5 ms step of the 124M on an H100, its forward's waits queued module by module (2026-12-06,
benchmarks/results/train_gpt.md). Split, every row
could be updated with the projection's part while backward runs, and only the batch's rows redone
once the lookup's part is in. This measures, on one device, what that rests on:

- exactness: torch's gradient is the projection's part plus the lookup's, bit for bit (a small model
  with nothing nondeterministic in it); and the lookup's part computed on compact row ids (the
  batch's tokens sorted, one row per run of equal ids, no host synchronization) equals the full
  lookup gradient's rows, bit for bit, on the GPT's own output gradients;
- when the projection's part is complete in backward, on the device's clock, against backward's end;
- what the lookup's part costs: its rows, its bytes, the compaction's time, its copy to pinned memory.

  python3 benchmarks/train_gpt/tied_rows.py --device cuda --json out.json   # the 124M, 8x512
  python3 benchmarks/train_gpt/tied_rows.py --config tiny                   # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from markov_text import MarkovText  # noqa: E402

import gpt  # noqa: E402


def lookup_gradient(ids: torch.Tensor, out_grad: torch.Tensor, rows: int) -> torch.Tensor:
    """The lookup's part of the embedding's gradient, `rows` rows, as torch's embedding backward
    computes it."""
    return torch.ops.aten.embedding_dense_backward(out_grad, ids, rows, -1, False)


def compact(ids: torch.Tensor, out_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lookup's part on the batch's rows only, without the host waiting for the device: (row ids,
    their gradients, how many), both padded to one row per token (row id 0, zeros past the count).
    Each token gets the index of its run among the sorted ids; a stable sort keeps the tokens of a run
    in their order, which is the order torch's embedding backward sums them in."""
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    run_sorted = torch.cumsum(starts, 0) - 1
    run = torch.empty_like(run_sorted)
    run[order] = run_sorted
    row_ids = torch.zeros_like(flat).scatter_(0, run_sorted, sorted_ids)
    gradients = lookup_gradient(run, out_grad.reshape(flat.numel(), -1), flat.numel())
    return row_ids, gradients, starts.sum()


def split_backward(model: gpt.GPT, tokens: torch.Tensor, targets: torch.Tensor, autocast: bool, events=None):
    """Forward and backward with the token lookup outside autograd's view of the tied weight, so that
    the weight's .grad is the projection's part alone; returns the lookup's output gradient.
    `events`: (start, projection's part in, end), recorded on the current stream."""
    weight = model.wte.weight
    looked_up = []

    def lookup(ids):
        looked_up.append(gpt.lookup_without_gradient(model.wte, ids).requires_grad_())
        return looked_up[-1]

    def mark(i: int) -> None:
        if events:
            events[i].record()

    model.wte.forward = lookup
    hook = weight.register_post_accumulate_grad_hook(lambda _: mark(1))
    try:
        with torch.autocast(tokens.device.type, torch.bfloat16, enabled=autocast):
            loss = model(tokens, targets)
        mark(0)
        loss.backward()
        mark(2)
    finally:
        del model.wte.forward
        hook.remove()
    return looked_up[0].grad


def tied_backward(model: gpt.GPT, tokens: torch.Tensor, targets: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast(tokens.device.type, torch.bfloat16, enabled=autocast):
        model(tokens, targets).backward()
    return model.wte.weight.grad


def check_exact(model: gpt.GPT, tokens: torch.Tensor, targets: torch.Tensor, autocast: bool) -> dict:
    """Torch's tied gradient against the projection's part plus the lookup's (full and compact rows);
    `compact_rows` compares within one backward, the others across two, which agree only where the
    backward is repeatable (`repeatable`)."""
    vocab = model.wte.weight.shape[0]
    tied = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        tied.append(tied_backward(model, tokens, targets, autocast).clone())
    repeatable, tied = torch.equal(*tied), tied[0]
    model.zero_grad(set_to_none=True)
    out_grad = split_backward(model, tokens, targets, autocast)
    projection = model.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    full = lookup_gradient(tokens, out_grad, vocab)
    row_ids, rows, count = compact(tokens, out_grad)
    n = int(count)
    touched = torch.zeros(vocab, dtype=torch.bool, device=tokens.device)
    touched[row_ids[:n]] = True
    return {"repeatable": repeatable,  # two tied backward passes agree: the checks below can hold
            "sum": torch.equal(projection + full, tied),
            "compact_rows": torch.equal(rows[:n], full[row_ids[:n]]),
            "tied_rows": torch.equal(projection[row_ids[:n]] + rows[:n], tied[row_ids[:n]]),
            "untouched_rows": torch.equal(projection[~touched], tied[~touched]),
            "rows": n}


def small_model(device: str) -> gpt.GPT:
    """An embedding, a norm and the tied projection, no blocks: two backward passes over the same batch
    give the same gradients here, where the GPT's once did not on an H100."""
    torch.manual_seed(0)
    with torch.device(device):
        model = gpt.GPT(gpt.GPTConfig(layers=0, heads=1, width=256, vocab=4096, block=512))
    return model


def tokens_of(kind: str, vocab: int, batch: int, seq: int, device: str) -> torch.Tensor:
    """[batch, seq + 1] tokens: uniform (train_gpt's random tokens: few repeats) or a Markov chain's
    (markov_text.py's text with structure: many)."""
    if kind == "uniform":
        return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    return MarkovText(vocab).batch(0, batch, seq).to(device)


def time_parts(model: gpt.GPT, tokens: torch.Tensor, targets: torch.Tensor, autocast: bool, reps: int) -> dict:
    """Medians over `reps` steps on the device's clock: backward, when the projection's part was in,
    the compaction, and the copy of its rows and ids to pinned host memory."""
    n = tokens.numel()
    width = model.wte.weight.shape[1]
    host_rows = torch.empty(n, width, pin_memory=True)
    host_ids = torch.empty(n, dtype=torch.long, pin_memory=True)
    samples: dict[str, list[float]] = {"backward_ms": [], "projection_part_in_ms": [], "compact_ms": [],
                                       "copy_to_host_ms": []}
    for rep in range(reps + 2):  # two warm-up steps
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        model.zero_grad(set_to_none=True)
        out_grad = split_backward(model, tokens, targets, autocast, marks[:3])
        row_ids, rows, _ = compact(tokens, out_grad)
        marks[3].record()
        host_rows.copy_(rows, non_blocking=True)
        host_ids.copy_(row_ids, non_blocking=True)
        marks[4].record()
        torch.cuda.synchronize()
        if rep >= 2:
            samples["backward_ms"].append(marks[0].elapsed_time(marks[2]))
            samples["projection_part_in_ms"].append(marks[0].elapsed_time(marks[1]))
            samples["compact_ms"].append(marks[2].elapsed_time(marks[3]))
            samples["copy_to_host_ms"].append(marks[3].elapsed_time(marks[4]))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="124m", help="a benchmarks/train_gpt config, or 'tiny'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10, help="timed steps (a GPU only)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    autocast = args.device == "cuda"
    config = gpt.config_of(args.config)
    seq = min(args.seq, config.block)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = gpt.GPT(config)
    result = {"config": args.config, "device": torch.cuda.get_device_name() if autocast else "cpu",
              "batch": args.batch, "seq": seq, "vocab": config.vocab, "width": config.width, "autocast": autocast}
    small = small_model(args.device)
    for kind in ("uniform", "markov"):
        tokens = tokens_of(kind, config.vocab, args.batch, seq, args.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        part = {"small_model": check_exact(small, inputs % small.wte.weight.shape[0],
                                           targets % small.wte.weight.shape[0], autocast)}
        started = time.perf_counter()
        part["gpt"] = check_exact(model, inputs, targets, autocast)
        part["gpt"]["check_s"] = time.perf_counter() - started
        part["touched_fraction"] = part["gpt"]["rows"] / config.vocab
        part["lookup_part_bytes"] = part["gpt"]["rows"] * (config.width * 4 + 8)
        if autocast:
            part["times"] = time_parts(model, inputs, targets, autocast, args.reps)
        result[kind] = part
        print(kind, json.dumps(part))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
