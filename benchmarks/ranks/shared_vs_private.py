"""N data-parallel ranks (separate processes) on one node: one shared trainstreamd job against each
rank offloading its own optimizer to a daemon of its own (one copy of the state per rank, N updates
per step — what per-process offloaders do). Reports step time, host memory in the daemons' segments,
and whether the shared job's replicas are bit-identical.

    python3 benchmarks/ranks/shared_vs_private.py --ranks 4 --config 124m --steps 10 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "train_gpt"))


def worker(args) -> None:
    import trainstream
    from gpt import build

    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.device == "cuda":  # one GPU per rank where there are several
        args.device = f"cuda:{rank % torch.cuda.device_count()}"
    torch.manual_seed(rank)
    model = build(args.config, args.device, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shared = args.mode == "shared"
    model, opt = trainstream.wrap(model, opt, client=trainstream.connect(),
                                  job=f"bench-{os.getppid()}" if shared else None,
                                  rank=rank if shared else 0, world_size=world if shared else 1)
    g = torch.Generator(device=args.device).manual_seed(100 + rank)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 50304, (args.batch, args.seq + 1), device=args.device, generator=g)
        start = time.perf_counter()
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.device != "cpu"):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        trainstream.synchronize()
        if args.device != "cpu":
            torch.cuda.synchronize(args.device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    stats = trainstream.connect().stats()
    print(json.dumps({"rank": rank, "step_ms": 1000 * statistics.median(times), "checksum": checksum,
                      "host_bytes": stats["host_bytes"]}), flush=True)


def run_mode(args, mode: str) -> dict:
    env = dict(os.environ, LOCAL_WORLD_SIZE=str(args.ranks))
    daemon = None
    if mode == "shared":
        from trainstream._connect import PrivateDaemon
        daemon = PrivateDaemon()
        env["TRAINSTREAM_ADDRESS"] = daemon.socket_path
    else:
        env.pop("TRAINSTREAM_ADDRESS", None)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--config", args.config,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--seq", str(args.seq), "--device", args.device]
    procs = [subprocess.Popen(argv, env=dict(env, LOCAL_RANK=str(r)), stdout=subprocess.PIPE, text=True)
             for r in range(args.ranks)]
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"{mode} worker failed (exit {p.returncode})")
        reports.append(json.loads(lines[-1]))
    if daemon:
        daemon.stop()
    host_bytes = reports[0]["host_bytes"] if mode == "shared" else sum(r["host_bytes"] for r in reports)
    return {"mode": mode, "ranks": args.ranks, "step_ms": max(r["step_ms"] for r in reports),
            "host_gib": host_bytes / 2**30, "replicas_identical": len({r["checksum"] for r in reports}) == 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--config", default="124m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="shared", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = [run_mode(args, mode) for mode in ("shared", "private")]
    for r in results:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "device": args.device, "batch": args.batch, "seq": args.seq,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
