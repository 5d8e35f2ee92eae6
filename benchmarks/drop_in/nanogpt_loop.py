"""A GPT-2-small training loop written the nanoGPT way (torch.compile, bf16 autocast, micro-batches summed by
backward, clip_grad_norm_(1.0) in the loop, fused AdamW), three ways, each in a process of its own:

  stock     torch.optim.AdamW(fused=True) on the GPU
  explicit  trainstream.wrap(model, optimizer, accumulation_steps=K, max_grad_norm=1.0)
  oneline   trainstream.wrap(model, optimizer): the micro-batches counted, the loop's clipping taken over
  oneline-eager  the same, not compiled (a compiled wrapped model must be at least as fast as an eager one)
  counted   wrap(model, optimizer, max_grad_norm=1.0): the micro-batches counted, the clipping said (--modes)
  clipped   wrap(model, optimizer, accumulation_steps=K): the count said, the loop's clipping taken over (--modes)

It prints each mode's median step time (from one iteration's start to the next) over the steps after the
warm-up (compilation), its losses, and the ratios: oneline against explicit (the cost of the one line), and
both against stock. The modes run in turn --rounds times and each ratio is the median of the rounds'.
Data: a fixed Markov chain's tokens (benchmarks/train_gpt/markov_text.py), so the loss falls and the norm
moves.

    python3 benchmarks/drop_in/nanogpt_loop.py --json out.json

--daemon-trace runs each trainstream mode on a private daemon that keeps its step trace
(daemon/engine/step_trace.h) and adds, per micro-batch of the median step, when the trainer's backward ran
and waited for gradient regions, and when the daemon saw its GRAD_READYs, pulled and accumulated it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train_gpt"))

import daemon_trace  # noqa: E402

MODES = ("stock", "explicit", "oneline", "oneline-eager")


def run_mode(args) -> dict:
    import torch
    from markov_text import MarkovText

    import gpt

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = gpt.build(args.config, args.device, torch.float32)
    cuda = args.device == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=args.mode == "stock")
    private = trace_dir = None
    if args.mode != "stock":
        import trainstream
        extra = {"explicit": {"accumulation_steps": args.micro, "max_grad_norm": 1.0},
                 "counted": {"max_grad_norm": 1.0}, "clipped": {"accumulation_steps": args.micro}}.get(args.mode, {})
        if args.daemon_trace or args.daemon_threads:
            from trainstream._connect import PrivateDaemon
            trace_dir = tempfile.mkdtemp(prefix="trainstream-trace-") if args.daemon_trace else None
            private = PrivateDaemon(trace_dir=trace_dir, threads=args.daemon_threads)
            extra["client"] = trainstream.connect(f"unix:{private.socket_path}")
        model, optimizer = trainstream.wrap(model, optimizer, **extra)
    forward = torch.compile(model) if args.compile and args.mode != "oneline-eager" else model
    text = MarkovText(model.wte.weight.shape[0])
    batches = [text.batch(i, args.batch, args.seq).to(args.device) for i in range(args.micro * 4)]
    losses, norms, phases = [], [], []
    starts_ns, micro_marks = [], []  # per step: its start; per micro-batch (backward from, to, region wait ms)
    waits = None
    if args.mode != "stock":
        from train_gpt import daemon_waits
        waits = functools.partial(daemon_waits, model)
    daemon_pid = trainstream._wrap._rank_of(model).client.ping()["pid"] if args.mode != "stock" else None
    cpu_before = {}
    synchronize()
    for step in range(args.steps):
        if step == args.warmup:
            cpu_before = {"trainer": thread_cpu(os.getpid()), "daemon": thread_cpu(daemon_pid)}
        started = time.perf_counter()
        starts_ns.append(time.monotonic_ns())
        before = waits() if waits else {}
        marks = []
        for micro in range(args.micro):
            tokens = batches[(step * args.micro + micro) % len(batches)]
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = forward(tokens[:, :-1], tokens[:, 1:]) / args.micro
            waited, backward_from = waits() if waits else {}, time.monotonic_ns()
            loss.backward()
            marks.append(((backward_from - starts_ns[-1]) / 1e6, (time.monotonic_ns() - starts_ns[-1]) / 1e6,
                          1000 * (waits()["gradient regions"] - waited["gradient regions"]) if waits else 0.0))
        micro_marks.append(marks)
        backward = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stepped = time.perf_counter()
        losses.append(loss.item() * args.micro)  # nanoGPT logs the loss (its log_interval is 1); the norm it
        norms.append(norm)  # does not read, which would wait for the daemon's whole update
        after = waits() if waits else {}
        # where the CPU was: launching forward and backward, in clip/step/zero_grad, waiting for the GPU
        # (the loss); and the trainer's waits for the daemon (train_gpt's names), all in ms
        phases.append({"launch": 1000 * (backward - started), "clip+step": 1000 * (stepped - backward),
                       "gpu": 1000 * (time.perf_counter() - stepped),
                       **{name: 1000 * (after[name] - before[name]) for name in after}})
    # a step: from one iteration's start to the next, what the loop itself waits for included
    timed = [(end - start) / 1e9 for start, end in zip(starts_ns, [*starts_ns[1:], time.monotonic_ns()])]
    timed = timed[args.warmup:]
    cpu = {name: cpu_per_step(cpu_before[name], thread_cpu(pid), args.steps - args.warmup)
           for name, pid in (("trainer", os.getpid()), ("daemon", daemon_pid))}
    norms = [n.item() for n in norms]
    phase_ms = {name: statistics.median(p[name] for p in phases[args.warmup:]) for name in phases[-1]}
    traced = {}
    if private is not None:
        trainstream.unwrap(model)
        private.stop()  # its job writes the trace as the daemon stops
    if trace_dir is not None:
        trace = daemon_trace.load(trace_dir)
        steps = daemon_trace.by_step(trace["spans"])
        traced = {"micro_batches": trace_micro_batches(steps, starts_ns, micro_marks, args.warmup),
                  "pool": trace_pool(steps, starts_ns, args.warmup)}
        if args.json:  # the spans themselves, for questions the summary does not answer
            daemon_trace.keep(trace, starts_ns, args.json.removesuffix(".json") + f"_{args.mode}.trace.json.gz")
        shutil.rmtree(trace_dir, ignore_errors=True)
    return {"mode": args.mode, "step_ms": 1000 * statistics.median(timed), **traced, "cpu_ms_per_step": cpu,
            "step_ms_p10_p90": [1000 * sorted(timed)[len(timed) // 10], 1000 * sorted(timed)[-len(timed) // 10 - 1]],
            "losses": losses, "norms": norms, "phase_ms": phase_ms, "clipped_steps": sum(n > 1.0 for n in norms),
            "tokens_per_step": args.micro * args.batch * args.seq,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def thread_cpu(pid: int | None) -> dict[int, tuple[str, int]]:
    """Each thread of process `pid`: its name and the clock ticks it has run (user and system)."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task") if pid else []:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        threads[int(tid)] = (name, int(fields[11]) + int(fields[12]))
    return threads


def cpu_per_step(before: dict, after: dict, steps: int, top: int = 8) -> dict[str, float]:
    """The CPU milliseconds per step of the busiest threads ("name:tid") between two thread_cpu readings,
    and of all: which thread takes the cores the daemon's workers need."""
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    spent = {f"{name}:{tid}": (ticks - before.get(tid, (name, 0))[1]) * tick_ms / steps
             for tid, (name, ticks) in after.items()}
    busiest = sorted(spent.items(), key=lambda kv: -kv[1])[:top]
    return {**{k: round(v, 1) for k, v in busiest if v > 0}, "all": round(sum(spent.values()), 1)}


def medians(values: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(statistics.median(each), 2) for name, each in values.items()}


def trace_micro_batches(steps: dict, starts_ns: list[int], micro_marks: list[list[tuple]], warmup: int) -> list[dict]:
    """Per micro-batch, medians over the timed steps of its milestones in ms from the step's start: the
    trainer's backward (from, to) and its waits for gradient regions in it, and the daemon's
    (daemon_trace.micro_batches of `steps`, by_step's; the trainer's step i is the daemon's step i + 1)."""
    rows: dict[int, dict[str, list[float]]] = {}
    for i in range(warmup, len(starts_ns)):
        for row in daemon_trace.micro_batches(steps.get(i + 1, []), starts_ns[i]):
            k = row["micro"]
            backward_from, backward_to, region_wait = micro_marks[i][k] if k < len(micro_marks[i]) else (0, 0, 0)
            merged = {**row, "backward_from": backward_from, "backward_to": backward_to, "region_wait_ms": region_wait}
            for name, value in merged.items():
                rows.setdefault(k, {}).setdefault(name, []).append(value)
    return [medians(rows[k]) for k in sorted(rows)]


def trace_pool(steps: dict, starts_ns: list[int], warmup: int) -> dict[str, dict]:
    """Medians over the timed steps of what the daemon's workers ran in each (daemon_trace.pool_work of
    `steps`, by_step's), in ms from the step's start: for the step's own gradients ("this step") and the
    step before's, whose update may still run ("step before")."""
    rows: dict[str, dict[str, list[float]]] = {}
    for i in range(warmup, len(starts_ns)):
        for label, step in (("this step", i + 1), ("step before", i)):
            for name, work in daemon_trace.pool_work(steps.get(step, []), starts_ns[i]).items():
                for key, value in work.items():
                    rows.setdefault(f"{label} {name}", {}).setdefault(key, []).append(value)
    return {name: medians(values) for name, values in rows.items()}


def run_in_process(args, mode: str) -> dict:
    """One mode in a process of its own (a daemon and a compilation of its own), reported as it ends."""
    command = [sys.executable, __file__, "--mode", mode, "--config", args.config, "--device", args.device,
               "--batch", str(args.batch), "--seq", str(args.seq), "--micro", str(args.micro), "--steps",
               str(args.steps), "--warmup", str(args.warmup)] + ([] if args.compile else ["--no-compile"]) + (
               ["--daemon-trace"] if args.daemon_trace else []) + (["--json", args.json] if args.json else []) + (
               ["--daemon-threads", str(args.daemon_threads)] if args.daemon_threads else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    r = json.loads(lines[-1]) if done.returncode == 0 and lines else {
        "mode": mode, "error": (done.stderr or done.stdout)[-2000:]}
    print(mode, r.get("error") or f"{r['step_ms']:.1f} ms/step, clipped {r['clipped_steps']} of {args.steps}, "
          f"losses {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}; median ms "
          + ", ".join(f"{k} {v:.1f}" for k, v in r["phase_ms"].items()), flush=True)
    for row in r.get("micro_batches", []):
        print("  ", json.dumps(row), flush=True)
    for name, work in r.get("pool", {}).items():
        print("  ", name, json.dumps(work), flush=True)
    for name, threads in r.get("cpu_ms_per_step", {}).items():
        print(f"   {name} CPU ms per step:", json.dumps(threads), flush=True)
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="124m")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script on a small --config")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # one mode, in this process
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=3,
                        help="the modes run in turn this many times: the GPU machine's step drifts by 1.3x within "
                             "minutes (112-151 ms for the one line on one H100 machine), so modes run one after "
                             "the other only compare within a round")
    parser.add_argument("--daemon-threads", type=int, help="the trainstream modes on a private daemon with this many "
                        "optimizer workers (trainstreamd --threads)")
    parser.add_argument("--daemon-trace", action="store_true",
                        help="trainstream modes on a private daemon keeping its step trace: per micro-batch milestones")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return 0
    rounds = [{mode: run_in_process(args, mode) for mode in args.modes.split(",")} for _ in range(args.rounds)]
    results = {mode: {**rounds[0][mode], "round_step_ms": [r[mode].get("step_ms") for r in rounds]}
               for mode in rounds[0]}

    def ratio(a: str, b: str) -> float | None:
        """The median over the rounds of a's step over b's, each pair run minutes apart at most."""
        pairs = [r[a]["step_ms"] / r[b]["step_ms"] for r in rounds if "step_ms" in r[a] and "step_ms" in r[b]]
        return statistics.median(pairs) if pairs else None

    ratios = {f"{a}/{b}": ratio(a, b) for a, b in (("oneline", "explicit"), ("oneline", "oneline-eager"),
                                                   ("explicit", "stock"), ("oneline", "stock"))
              if a in results and b in results}
    if "step_ms" in results.get("oneline", {}) and "step_ms" in results.get("explicit", {}):
        ratios["max loss difference oneline-explicit"] = max(
            abs(a - b) for a, b in zip(results["oneline"]["losses"], results["explicit"]["losses"]))
    print(json.dumps(ratios, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
