"""Gradient D2H and weight H2D through trainstream's data path against plain pinned cudaMemcpyAsync,
on every GPU of the node at once (one process per GPU, phases started together at a barrier).

Reference, per GPU: `pinned.copy_(gpu, non_blocking=True)` bucket by bucket into page-locked memory
from cudaHostAlloc (torch's pin_memory), then the reverse, timed to the last copy's completion.

trainstream, per GPU: the GPUs' processes are the ranks of one job on one trainstreamd. D2H is a
backward pass whose gradients are the same tensors (d(sum(p*g))/dp = g), timed until every bucket's
gradients are in the job's shared memory (cuda-client-copy: copied and announced by this process;
cuda-ipc: every staging slot copied out by the daemon); H2D is optimizer.step() and bringing the new
weights of every bucket into the parameters, once the daemon has updated them (the update itself is
not timed, but it runs during the D2H phase as in training, competing for host memory bandwidth;
--daemon-threads 1 all but removes that to show the transport alone). Both go through the real
hooks, transport, rings and daemon.

    python3 benchmarks/transfer/transfer.py --gpus 2 --total-gib 1 --bucket-mb 32 --transport cuda-ipc
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

GB = 1e9


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def worker(gpu: int, args, barrier, results) -> None:
    import trainstream

    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    numel = int(args.bucket_mb * 2**20) // 4
    count = max(1, int(args.total_gib * 2**30) // (numel * 4))
    params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
    grads = [torch.randn(numel, device=device) for _ in range(count)]
    pinned = [torch.empty(numel, pin_memory=True) for _ in range(count)]
    nbytes = count * numel * 4

    def reference_d2h():
        for g, h in zip(grads, pinned):
            h.copy_(g, non_blocking=True)

    def reference_h2d():
        with torch.no_grad():
            for p, h in zip(params, pinned):
                p.copy_(h, non_blocking=True)

    model = torch.nn.ParameterList(params)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-6), job=args.job, rank=gpu,
                                  world_size=args.gpus, bucket_mb=args.bucket_mb)
    rank = trainstream._wrap._rank_of(model)

    graph = []

    def forward():  # not timed: only the backward pass streams gradients out
        graph[:] = [sum((p * g).sum() for p, g in zip(params, grads))]

    def trainstream_d2h():
        graph.pop().backward()
        rank.transport.flush()  # every bucket copied out and announced to the daemon

    def wait_for_update():
        for b in range(len(rank.buckets)):
            while rank.session.applied_step(b) < rank.current_step:
                time.sleep(1e-4)

    def trainstream_h2d():
        opt.step()
        rank.synchronize()

    samples = {key: [] for key in ("reference_d2h", "reference_h2d", "trainstream_d2h", "trainstream_h2d")}
    for repeat in range(args.warmup + args.repeats):
        phases = [("reference_d2h", reference_d2h), ("reference_h2d", reference_h2d), (None, forward),
                  ("trainstream_d2h", trainstream_d2h), (None, wait_for_update), ("trainstream_h2d", trainstream_h2d)]
        for key, fn in phases:
            barrier.wait()
            seconds = timed(fn)
            if key and repeat >= args.warmup:
                samples[key].append(seconds)
    result = {"gpu": gpu, "name": torch.cuda.get_device_name(device), "bytes": nbytes, "buckets": len(rank.buckets),
              "transport": rank.transport.name}
    if hasattr(rank.transport, "slot_wait_s"):  # cuda-ipc: backward waiting for staging slots, per step
        result["slot_wait_ms_per_step"] = 1000 * rank.transport.slot_wait_s / (args.warmup + args.repeats)
    for key, seconds in samples.items():
        result[key + "_gbs"] = nbytes / statistics.median(seconds) / GB
    for direction in ("d2h", "h2d"):
        result[direction + "_ratio"] = result[f"trainstream_{direction}_gbs"] / result[f"reference_{direction}_gbs"]
    trainstream.unwrap(model)
    results.put(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--total-gib", type=float, default=1.0, help="gradient bytes per GPU per step")
    parser.add_argument("--bucket-mb", type=float, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--daemon-threads", type=int, help="the daemon's update threads (default: all CPUs); "
                        "1 keeps its update, which overlaps the D2H phase, from competing for host memory bandwidth")
    parser.add_argument("--transport", choices=["cuda-ipc", "cuda-client-copy"], default="cuda-ipc")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ["TRAINSTREAM_TRANSPORT"] = args.transport  # the spawned workers inherit it
    if not torch.cuda.is_available() or args.gpus < 1:
        sys.exit("benchmarks/transfer needs CUDA GPUs")

    from trainstream._connect import PrivateDaemon
    daemon = PrivateDaemon(threads=args.daemon_threads)
    os.environ["TRAINSTREAM_ADDRESS"] = daemon.socket_path
    args.job = f"transfer-{os.getpid()}"
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.gpus), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(gpu, args, barrier, results)) for gpu in range(args.gpus)]
    for p in procs:
        p.start()
    per_gpu = []
    while len(per_gpu) < len(procs):
        try:
            per_gpu.append(results.get(timeout=5))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:  # a worker died: its barrier partners would wait forever
                for p in procs:
                    p.kill()
                daemon.stop()
                sys.exit(f"a GPU worker failed (exit codes {failed}); see its traceback above")
    per_gpu.sort(key=lambda r: r["gpu"])
    for p in procs:
        p.join()
    daemon.stop()

    total = {key: sum(r[key] for r in per_gpu) for key in per_gpu[0] if key.endswith("_gbs")}
    for direction in ("d2h", "h2d"):
        total[direction + "_ratio"] = total[f"trainstream_{direction}_gbs"] / total[f"reference_{direction}_gbs"]
    for r in per_gpu:
        print(json.dumps(r))
    print(json.dumps({"gpus": args.gpus, "transport": args.transport, "daemon_threads": args.daemon_threads,
                      "total": total}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": args.gpus, "transport": args.transport, "bucket_mb": args.bucket_mb,
                       "total_gib": args.total_gib,
                       "daemon_threads": args.daemon_threads or os.cpu_count(),
                       "repeats": args.repeats, "per_gpu": per_gpu, "total": total}, f, indent=1)


if __name__ == "__main__":
    main()
