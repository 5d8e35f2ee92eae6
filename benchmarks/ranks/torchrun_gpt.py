"""Data-parallel GPT training with torchrun, one rank per GPU (or several ranks sharing GPUs, for the
check), all ranks served by one trainstreamd.

Two measurements, each a torchrun launch of this file:
  check — fp32 (no autocast, no TF32, deterministic kernels), every rank training on its shard of
          each global batch through one shared job; afterwards the ranks' parameters are compared bit
          for bit, and rank 0's against one process with torch.optim.AdamW(foreach=False) trained on
          the mean of the shards' gradients (the same arithmetic) and on the whole batch at once.
  bench — bf16 autocast, step time and memory, for
          trainstream: one daemon, one job, one copy of the optimizer state, one update per step;
          inprocess:   what users do today: DistributedDataParallel (NCCL) and every rank offloading its
                       own optimizer in-process (fp32 master weights, pinned gradients and fused
                       torch.optim.AdamW on the CPU, its share of the cores), N copies of the state.

    python3 benchmarks/ranks/torchrun_gpt.py --ranks 2 --config 1.86b --json out.json
    python3 benchmarks/ranks/torchrun_gpt.py --ranks 4 --measures check   # 4 ranks sharing one GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "train_gpt"))
from gpt import build  # noqa: E402
from train_gpt import rss_bytes  # noqa: E402

GIB = 1 << 30


def global_batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (and in the reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 50304, (args.batch * args.ranks, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def param_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class InProcessOffload:
    """A rank's own optimizer on the CPU: fp32 master copies, pinned gradient buffers, fused AdamW."""

    def __init__(self, params, lr: float):
        self.params = list(params)
        self.master = [p.detach().float().cpu().pin_memory() for p in self.params]
        self.grads = [torch.empty_like(m).pin_memory() for m in self.master]
        for m, g in zip(self.master, self.grads):
            m.grad = g
        self.opt = torch.optim.AdamW(self.master, lr=lr, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        for p, g in zip(self.params, self.grads):
            g.copy_(p.grad, non_blocking=True)
            p.grad = None
        torch.cuda.synchronize()
        self.opt.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m, non_blocking=True)

    def host_bytes(self) -> int:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in self.master + self.grads + state)


def deterministic() -> None:
    """check: the same kernels give the same bits here and in the reference (no TF32, no atomics)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)  # attention's fused backward kernels accumulate with atomics
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def worker(args) -> None:
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    check = args.measure == "check"
    if check:
        deterministic()
    torch.manual_seed(0)
    model = build(args.config, "cuda", torch.float32)
    if args.mode == "trainstream":
        import trainstream
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=args.lr))  # ranks from torchrun
        step_fn = opt.step
        host_bytes = lambda: trainstream.connect().stats()["host_bytes"]  # noqa: E731
    else:
        torch.distributed.init_process_group("nccl", device_id=device)
        torch.set_num_threads(max(1, os.cpu_count() // world))
        offload = InProcessOffload(model.parameters(), args.lr)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        step_fn, host_bytes = offload.step, offload.host_bytes
    torch.cuda.reset_peak_memory_stats()
    times, driver_peak = [], 0
    for step in range(args.steps if check else args.warmup + args.steps):
        tokens, targets = (shard(t, rank, world).to(device) for t in global_batch(step, args))
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not check):
            loss = model(tokens, targets)
        loss.backward()
        step_fn()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        driver_peak = max(driver_peak, total - free)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if args.mode == "trainstream":
        trainstream.synchronize()
    report = {"rank": rank, "step_ms": 1000 * statistics.median(times) if times else None,
              "digest": param_digest(model), "host_bytes": host_bytes(), "rss_bytes": rss_bytes(),
              "torch_peak_gib": torch.cuda.max_memory_allocated() / GIB, "driver_peak_gib": driver_peak / GIB}
    if check and rank == 0:
        torch.save([p.detach().cpu() for p in model.parameters()], args.save)
    if args.mode == "inprocess":
        torch.distributed.destroy_process_group()
    print(json.dumps(report), flush=True)


def reference(args, per_shard: bool) -> list[torch.Tensor]:
    """One process, torch's AdamW on the GPU, on the whole global batch at once, or (per_shard) on
    the mean of the ranks' shard gradients: the same arithmetic as the ranks, which separates
    trainstream's error from the rounding of a different batch split."""
    deterministic()
    torch.manual_seed(0)
    model = build(args.config, "cuda", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    for step in range(args.steps):
        tokens, targets = (t.cuda() for t in global_batch(step, args))
        if not per_shard:
            model(tokens, targets).backward()
        else:
            for rank in range(args.ranks):
                model(shard(tokens, rank, args.ranks), shard(targets, rank, args.ranks)).backward()
            for p in model.parameters():
                p.grad.mul_(1.0 / args.ranks)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().cpu() for p in model.parameters()]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def launch(args, measure: str, mode: str, extra_env: dict) -> list[dict]:
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", "--standalone",
            os.path.abspath(__file__), "--worker", "--measure", measure, "--mode", mode, *forwarded(args)]
    proc = subprocess.run(argv, env=dict(os.environ, **extra_env), capture_output=True, text=True, timeout=1800)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(reports) != args.ranks:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"torchrun {measure}/{mode} failed (exit {proc.returncode})")
    return sorted(reports, key=lambda r: r["rank"])


def forwarded(args) -> list[str]:
    return ["--ranks", str(args.ranks), "--config", args.config, "--batch", str(args.batch), "--seq", str(args.seq),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr), "--save", args.save]


def summarize(mode: str, reports: list[dict]) -> dict:
    # trainstream: the daemon's segments, seen by every rank while attached; in-process: each rank's own
    host = max(r["host_bytes"] for r in reports) if mode == "trainstream" else sum(r["host_bytes"] for r in reports)
    return {"mode": mode, "step_ms": max(r["step_ms"] for r in reports), "host_state_gib": host / GIB,
            "trainer_rss_gib": sum(r["rss_bytes"] for r in reports) / GIB,
            "gpu_torch_peak_gib": max(r["torch_peak_gib"] for r in reports),
            "gpu_driver_peak_gib": max(r["driver_peak_gib"] for r in reports),
            "replicas_identical": len({r["digest"] for r in reports}) == 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count(),
                        help="processes; rank r runs on GPU r mod the GPU count (check only: NCCL needs one per GPU)")
    parser.add_argument("--config", default="1.86b", help="GPT of the bench measurement")
    parser.add_argument("--check-config", default="124m", help="GPT of the check measurement")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--measures", default="check,bench")
    parser.add_argument("--modes", default="trainstream,inprocess")
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--save", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from trainstream._connect import PrivateDaemon
    out = {"ranks": args.ranks, "gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0),
           "cpus": os.cpu_count(), "seq": args.seq, "batch_per_rank": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        args.save = os.path.join(tmp, "rank0.pt")
        if "check" in args.measures:
            bench_config, args.config = args.config, args.check_config
            daemon = PrivateDaemon()
            reports = launch(args, "check", "trainstream", {"TRAINSTREAM_ADDRESS": daemon.socket_path})
            daemon.stop()
            ours = torch.load(args.save)
            out["check"] = {"config": args.config, "steps": args.steps, "lr": args.lr,
                            "replicas_identical": len({r["digest"] for r in reports}) == 1,
                            "max_abs_diff_vs_whole_batch": max_abs_diff(ours, reference(args, per_shard=False)),
                            "max_abs_diff_vs_shard_mean": max_abs_diff(ours, reference(args, per_shard=True))}
            print(json.dumps(out["check"]), flush=True)
            args.config = bench_config
        if "bench" in args.measures:
            out["bench"] = {"config": args.config, "steps": args.steps, "runs": []}
            for mode in args.modes.split(","):
                env, daemon = {}, None
                if mode == "trainstream":
                    daemon = PrivateDaemon()
                    env["TRAINSTREAM_ADDRESS"] = daemon.socket_path
                reports = launch(args, "bench", mode, env)
                if daemon:
                    daemon.stop()
                run = summarize(mode, reports)
                out["bench"]["runs"].append(run)
                print(json.dumps(run), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
