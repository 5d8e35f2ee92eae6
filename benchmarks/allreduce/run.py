#!/usr/bin/env python3
"""Peer all-reduce benchmark: trainstream's ring all-reduce between daemons' peer planes against
torch.distributed's gloo all_reduce, on loopback, same node count and sizes, in one run. Prints bus
bandwidth (2(M-1)/M x bytes / time) and the ratio; writes benchmarks/results/allreduce_<tag>.json.

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
    parser.add_argument("--tag", default=socket.gethostname())
    parser.add_argument("--gloo-worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker:
        rank, nodes, floats, port = (int(v) for v in args.gloo_worker[:4])
        return gloo_worker(rank, nodes, floats, args.reps, port, args.gloo_worker[4])

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for floats in (int(s) for s in args.sizes.split(",")):
            ours_json = os.path.join(tmp, "ours.json")
            subprocess.run([args.bench, "--nodes", str(args.nodes), "--floats", str(floats), "--reps", str(args.reps),
                            "--json", ours_json], check=True, stdout=subprocess.DEVNULL)
            ours = json.load(open(ours_json))["seconds"]
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
        json.dump({"nodes": args.nodes, "host": socket.gethostname(), "rows": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
