"""Where the daemon's time goes in each step, from its step trace (trainstreamd --trace-dir;
daemon/engine/step_trace.h): every gradient piece's pull from the GPU, every block of every update on
a worker thread, every push of weights back, on the monotonic clock train_gpt marks its steps with.

Why: on the 124M's forced offload the daemon is the limit, and its step ran 3.6-4.7 ms longer than its
update alone plus the time the busy sampler saw it idle (benchmarks/results/train_gpt.md, 2026-12-06,
fourth session). Per-block times tell whether the update ran slower inside the step, or its threads
waited between pieces, and where in the step each bucket's gradients, update and push were.

A step's gradients are the daemon's step s = i + 1 of the trainer's iteration i (step 0 is the initial
load). Their update mostly runs in iteration i + 1, whose forward waits for it, so each cycle is timed
from iteration i's start and only cycles followed by a timed iteration are counted.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics

KINDS = ["pull", "update-block", "push", "weights-wanted", "commit", "grad-ready", "accumulate", "more-micro",
         "accumulate-block", "norm-block"]
(PULL, UPDATE, PUSH, WANTED, COMMIT, GRAD_READY, ACCUMULATE, MORE_MICRO, ACCUMULATE_BLOCK,
 NORM_BLOCK) = range(len(KINDS))  # SpanKind's order


def load(trace_dir: str) -> dict:
    """The one trace file a private daemon left in `trace_dir` (its job's, written when it stopped)."""
    paths = glob.glob(os.path.join(trace_dir, "trace-*.json"))
    if len(paths) != 1:
        raise RuntimeError(f"expected one trace file in {trace_dir}, found {len(paths)}")
    with open(paths[0]) as f:
        trace = json.load(f)
    if trace["kinds"] != KINDS:
        raise RuntimeError(f"unknown span kinds {trace['kinds']}")
    return trace


def keep(trace: dict, starts_ns: list[int], path: str) -> None:
    """The trace with the trainer's iteration starts beside it, gzipped into `path`."""
    with gzip.open(path, "wt") as f:
        json.dump({**trace, "iteration_starts_ns": starts_ns}, f)


def busy_by_width(blocks: list[tuple[int, int]], begin: int, end: int, threads: int) -> dict[str, float]:
    """Milliseconds of [begin, end) in which no update block ran, some did, or one on every thread."""
    edges = sorted([(max(b, begin), 1) for b, e in blocks if e > begin and b < end]
                   + [(min(e, end), -1) for b, e in blocks if e > begin and b < end])
    width, t, spent = 0, begin, {"none": 0, "some": 0, "all": 0}
    for at, change in edges:
        spent["none" if width == 0 else "all" if width >= threads else "some"] += at - t
        width, t = width + change, at
    spent["none"] += end - t
    return {k: v / 1e6 for k, v in spent.items()}


def cycle(spans: list[list[int]], step: int, t0: int, threads: int) -> dict[str, float]:
    """Daemon step `step`'s milestones in ms from t0 (the start of the iteration that made its gradients)."""
    mine = [s for s in spans if s[2] == step]

    def of(kind):
        return [(s[4], s[5]) for s in mine if s[0] == kind]

    pulls, blocks, pushes = of(PULL), of(UPDATE), of(PUSH)  # no pulls nor pushes: the host transport
    if not blocks:
        return {}
    nan = float("nan")
    ms = lambda t: (t - t0) / 1e6  # noqa: E731
    first, last = min(b for b, _ in blocks), max(e for _, e in blocks)
    width = busy_by_width(blocks, first, last, threads)
    return {
        "pulls_from": ms(min(b for b, _ in pulls)) if pulls else nan,
        "pulls_to": ms(max(e for _, e in pulls)) if pulls else nan,
        "update_from": ms(first), "update_to": ms(last),
        "update_thread_ms": sum(e - b for b, e in blocks) / threads / 1e6,
        "update_gaps_ms": width["none"], "update_some_threads_ms": width["some"],
        "update_all_threads_ms": width["all"],
        "pushes_from": ms(min(b for b, _ in pushes)) if pushes else nan,
        "pushes_to": ms(max(e for _, e in pushes)) if pushes else nan,
        "weights_wanted": next((ms(s[4]) for s in mine if s[0] == WANTED), nan),
    }


def buckets(spans: list[list[int]], step: int, t0: int, threads: int) -> list[dict]:
    """Per bucket of daemon step `step`, its pulls, update and pushes in ms from t0, and its update's
    thread-milliseconds over the pool."""
    rows = {}
    for kind, b, s, _, begin, end in spans:
        if s != step or kind not in (PULL, UPDATE, PUSH):
            continue
        row = rows.setdefault(b, {"bucket": b})
        name = {PULL: "pull", UPDATE: "update", PUSH: "push"}[kind]
        row[f"{name}_from"] = min(row.get(f"{name}_from", 1e18), (begin - t0) / 1e6)
        row[f"{name}_to"] = max(row.get(f"{name}_to", -1e18), (end - t0) / 1e6)
        if kind == UPDATE:
            row["update_thread_ms"] = row.get("update_thread_ms", 0.0) + (end - begin) / threads / 1e6
    return sorted(rows.values(), key=lambda r: r.get("pull_from", 0.0))


def by_step(spans: list[list[int]]) -> dict[int, list[list[int]]]:
    """The spans of each daemon step, in the order they began (one pass over a trace of many steps)."""
    steps: dict[int, list[list[int]]] = {}
    for span in sorted(spans, key=lambda s: s[4]):
        steps.setdefault(span[2], []).append(span)
    return steps


def micro_batches(mine: list[list[int]], t0: int) -> list[dict]:
    """One daemon step's micro-batches (`mine`: its spans, by_step's) in ms from t0: when their
    GRAD_READYs reached the engine, their pulls, their accumulate passes (to the SLOT_FREE that lets the
    next micro-batch's gradients in) and the MORE_MICRO that said another came. A micro-batch's pulls and
    GRAD_READYs are told apart by order: each bucket's k-th GRAD_READY of the step is micro-batch k's
    (pieces: one per GRAD_READY)."""
    rows: dict[int, dict] = {}

    def widen(micro: int, name: str, begin: int, end: int) -> None:
        row = rows.setdefault(micro, {"micro": micro})
        row[f"{name}_from"] = min(row.get(f"{name}_from", float("inf")), (begin - t0) / 1e6)
        row[f"{name}_to"] = max(row.get(f"{name}_to", float("-inf")), (end - t0) / 1e6)

    pulls_seen: dict[int, int] = {}
    ready_micro: dict[int, list[int]] = {}  # bucket -> the micro-batch of each GRAD_READY, in order
    for kind, b, _, detail, begin, end in mine:
        if kind == GRAD_READY:
            ready_micro.setdefault(b, []).append(detail)
            widen(detail, "grad_ready", begin, end)
        elif kind == ACCUMULATE:
            widen(detail, "accumulate", begin, end)
            rows[detail]["accumulate_ms"] = rows[detail].get("accumulate_ms", 0.0) + (end - begin) / 1e6
        elif kind == MORE_MICRO:
            widen(detail, "more_micro", begin, end)
    for kind, b, _, _, begin, end in mine:
        if kind == PULL:
            k = pulls_seen.get(b, 0)
            pulls_seen[b] = k + 1
            micros = ready_micro.get(b, [])
            if k < len(micros):
                widen(micros[k], "pull", begin, end)
    return [rows[k] for k in sorted(rows)]


def pool_work(mine: list[list[int]], t0: int) -> dict[str, dict[str, float]]:
    """What the worker pool ran for one daemon step (`mine`: its spans, by_step's), per kind of pass
    (update, accumulate, norm): its blocks (more update blocks than the model has: redone or taken back),
    their thread-milliseconds, and from when to when, in ms from t0."""
    work = {}
    for kind, name in ((UPDATE, "update"), (ACCUMULATE_BLOCK, "accumulate"), (NORM_BLOCK, "norm")):
        blocks = [(s[4], s[5]) for s in mine if s[0] == kind]
        if blocks:
            work[name] = {"blocks": len(blocks), "thread_ms": sum(e - b for b, e in blocks) / 1e6,
                          "from": (min(b for b, _ in blocks) - t0) / 1e6, "to": (max(e for _, e in blocks) - t0) / 1e6}
    return work


def analyse(trace: dict, starts_ns: list[int], step_ns: list[int], warmup: int,
            gpu_windows: list[list[tuple[str, int, int]]] | None = None) -> dict:
    """Medians over the timed iterations (`starts_ns` and `step_ns` are every iteration's start and wall
    time, warm-up included) of each cycle's milestones and of where each iteration's wall time went
    (the update's width: no thread, some, all), and the median cycle's buckets, with the GPU's phases of
    that iteration and the next (`gpu_windows`, the timed iterations' (phase, start, end), if marked)."""
    spans = trace["spans"]
    threads = len({s[3] for s in spans if s[0] == UPDATE}) or 1
    blocks = [(s[4], s[5]) for s in spans if s[0] == UPDATE]
    cycles, widths = [], []
    for i in range(warmup, len(starts_ns) - 1):
        c = cycle(spans, i + 1, starts_ns[i], threads)
        if c:
            c["step_ms"] = step_ns[i] / 1e6
            cycles.append((i, c))
        widths.append(busy_by_width(blocks, starts_ns[i], starts_ns[i] + step_ns[i], threads))
    if not cycles:
        return {"threads": threads, "dropped": trace["dropped"], "cycles": 0}
    medians = {k: statistics.median(c[k] for _, c in cycles) for k in cycles[0][1]}
    typical = min(cycles, key=lambda ic: abs(ic[1]["step_ms"] - medians["step_ms"]))[0]
    t0 = starts_ns[typical]
    phases = [(phase, (begin - t0) / 1e6, (end - t0) / 1e6)
              for windows in (gpu_windows or [])[typical - warmup:typical - warmup + 2]
              for phase, begin, end in windows]
    return {
        "threads": threads, "dropped": trace["dropped"], "cycles": len(cycles),
        "cycle_medians_ms": medians,
        "iteration_update_width_ms": {k: statistics.median(w[k] for w in widths) for k in widths[0]},
        "typical_iteration": typical,
        "typical_buckets": buckets(spans, typical + 1, t0, threads),
        "typical_gpu_phases_ms": phases,
    }


def summary(analysis: dict) -> str:
    """One line for the benchmark's log."""
    if not analysis.get("cycles"):
        return f"daemon trace: no complete cycle ({analysis.get('dropped', 0)} spans dropped)"
    m, w = analysis["cycle_medians_ms"], analysis["iteration_update_width_ms"]
    return (f"daemon trace ({analysis['threads']} workers, medians ms from the iteration's start): pulls "
            f"{m['pulls_from']:.1f}-{m['pulls_to']:.1f}, update {m['update_from']:.1f}-{m['update_to']:.1f} "
            f"({m['update_thread_ms']:.1f} per thread; all threads {m['update_all_threads_ms']:.1f}, some "
            f"{m['update_some_threads_ms']:.1f}, none {m['update_gaps_ms']:.1f}), pushes to {m['pushes_to']:.1f}; "
            f"per iteration no update {w['none']:.1f}, some threads {w['some']:.1f}, all {w['all']:.1f}")
