#!/usr/bin/env python3
"""Peer all-reduce benchmark: trainstream's ring all-reduce between daemons' peer planes against
torch.distributed's gloo all_reduce, on loopback, same node count and sizes, in one run. Both run one
process per node (rank), as trainstreamd daemons do (--in-process: all our nodes in one process).
Prints bus bandwidth (2(M-1)/M x bytes / time) and the ratio; writes
benchmarks/results/allreduce_<tag>.json.

    python3 benchmarks/allreduce/run.py --bench build/benchmarks/allreduce/ts_bench_allreduce --nodes 2
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def gloo_worker(rank, nodes, floats, reps, port, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nodes)
    data = torch.arange(floats, dtype=torch.float32) % 7
    dist.all_reduce(data)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(data)
    seconds = (time.perf_counter() - start) / reps
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": seconds}, f)
    dist.destroy_process_group()


def run_nodes(args, floats, tmp):
    """Runs ts_bench_allreduce, one process per node; returns node 0's JSON. Kills every node when one
    fails or the run takes longer than --timeout, and exits with the nodes' stderr."""
    out = os.path.join(tmp, "ours.json")
    common = ["--nodes", str(args.nodes), "--floats", str(floats), "--reps", str(args.reps), "--json", out,
              "--connections", str(args.connections)]
    if args.in_process:
        commands = [[args.bench] + common]
    else:
        ports = tempfile.mkdtemp(prefix="ports-", dir=tmp)
        commands = [[args.bench, "--node", str(n), "--ports-dir", ports, "--wait-s", str(args.timeout)] + common
                    for n in range(args.nodes)]
    logs = [open(os.path.join(tmp, f"node-{n}.stderr"), "w+") for n in range(len(commands))]
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=log) for c, log in zip(commands, logs)]
    deadline, failed = time.monotonic() + args.timeout, None
    while failed is None:
        status = [p.poll() for p in procs]  # every one, each time
        if any(status):
            failed = "a node failed"
        elif None not in status:
            break
        elif time.monotonic() > deadline:
            failed = f"still running after {args.timeout} s"
        else:
            time.sleep(0.02)
    if failed:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        report = []
        for n, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            report.append(f"--- node {n}: exit status {p.returncode}\n{log.read().strip()}")
        sys.exit(f"ts_bench_allreduce, {args.nodes} nodes, {floats} floats: {failed}\n" + "\n".join(report))
    for log in logs:
        log.close()
    with open(out) as f:
        return json.load(f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", default=os.path.join(ROOT, "build/benchmarks/allreduce/ts_bench_allreduce"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--sizes", default="262144,4194304,33554432", help="floats per all-reduce")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--connections", type=int, default=4, help="ours: connections per peer (--peer-connections)")
    parser.add_argument("--tag", default=socket.gethostname())
    parser.add_argument("--in-process", action="store_true", help="all our nodes in one process (the old benchmark)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per size before the nodes are killed")
    parser.add_argument("--gloo-worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker:
        rank, nodes, floats, port = (int(v) for v in args.gloo_worker[:4])
        return gloo_worker(rank, nodes, floats, args.reps, port, args.gloo_worker[4])

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for floats in (int(s) for s in args.sizes.split(",")):
            ours = run_nodes(args, floats, tmp)["seconds"]
            gloo_json, port = os.path.join(tmp, "gloo.json"), free_port()
            procs = [subprocess.Popen([sys.executable, __file__, "--reps", str(args.reps), "--gloo-worker", str(r),
                                       str(args.nodes), str(floats), str(port), gloo_json]) for r in range(args.nodes)]
            if any(p.wait() for p in procs):
                sys.exit("gloo worker failed")
            gloo = json.load(open(gloo_json))["seconds"]
            factor = 2 * (args.nodes - 1) / args.nodes * floats * 4 / 1e9
            row = {"floats": floats, "ours_ms": ours * 1e3, "gloo_ms": gloo * 1e3, "ours_bus_gbs": factor / ours,
                   "gloo_bus_gbs": factor / gloo, "ratio": gloo / ours}
            rows.append(row)
            print(f"{floats * 4 / 2**20:9.1f} MiB  trainstream {row['ours_bus_gbs']:6.2f} GB/s  gloo "
                  f"{row['gloo_bus_gbs']:6.2f} GB/s  ratio {row['ratio']:.2f}x  (target >= 1.0x)", flush=True)
    out = os.path.join(ROOT, "benchmarks", "results", f"allreduce_{args.tag}.json")
    with open(out, "w") as f:
        json.dump({"nodes": args.nodes, "connections": args.connections, "host": socket.gethostname(), "rows": rows},
                  f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
