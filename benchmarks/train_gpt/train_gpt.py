"""Trains a nanoGPT-shaped model with stock fused GPU AdamW, with trainstream (mode trainstream: the
state always offloaded; mode auto: offload="auto", which switches to stock fused AdamW after 2 measured
steps when that fits) and (mode torchao, when installed) with torchao's CPUOffloadOptimizer, and reports
step time, tokens/s, peak GPU memory (torch's counter and the driver's) and host memory.

Each mode runs in a process of its own, so no mode sees another's memory. References measured in the
same run: the GPU-only step (forward + backward, no optimizer) and the host update time: the bytes the
host update must move per parameter for this configuration (gradient, master read+write, both
moments read+write, and for 16-bit weights the upload copy) over the host memory bandwidth (the
STREAM triad of benchmarks/adamw measured in this run when --adamw-json names its result, else a
torch triad). The targets are
  trainstream step <= 1.15 x max(GPU-only step, host update time);
  auto step and GPU memory (torch's peak) <= 1.05 x stock's, where stock fits (auto_vs_stock).

  python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --batch 8 --seq 512 --vram-cap-gib 24
  python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes stock,trainstream,auto
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainstream  # noqa: E402
from gpt import build  # noqa: E402

GIB = 1 << 30


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_triad_gbs(threads: int, gib: float = 1.0) -> float:
    torch.set_num_threads(threads)
    n = int(gib * GIB / 4)
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = max(best, 3 * n * 4 / (time.perf_counter() - start) / 1e9)
    return best


class Memory:
    """Peak GPU memory from torch's allocator and from the driver (cudaMemGetInfo), from its creation on."""

    def __init__(self):
        torch.cuda.reset_peak_memory_stats()
        self.driver_peak = 0

    def sample(self):
        free, total = torch.cuda.mem_get_info()
        self.driver_peak = max(self.driver_peak, total - free)

    def report(self) -> dict:
        return {"torch_peak_gib": torch.cuda.max_memory_allocated() / GIB, "driver_peak_gib": self.driver_peak / GIB}


def batches(args, device):
    g = torch.Generator(device=device).manual_seed(0)
    while True:
        tokens = torch.randint(0, 50304, (args.batch, args.seq + 1), device=device, generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def timed_steps(args, step_fn, memory: Memory) -> list[float]:
    data = batches(args, "cuda")
    times = []
    for i in range(args.warmup + args.steps):
        tokens, targets = next(data)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step_fn(tokens, targets)
        torch.cuda.synchronize()
        memory.sample()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def forward_backward(model, tokens, targets, autocast: bool, paging: bool = False, paging_gib: float = 0):
    max_bytes = int(paging_gib * GIB) if paging_gib else None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), \
            trainstream.activation_paging(max_bytes=max_bytes) if paging else contextlib.nullcontext():
        loss = model(tokens, targets)
    loss.backward()
    return loss


def run(args, mode: str) -> dict:
    torch.cuda.empty_cache()
    weight_dtype = torch.bfloat16 if args.bf16_weights else torch.float32
    autocast = not args.bf16_weights
    result = {"mode": mode}
    try:
        torch.manual_seed(0)
        model = build(args.config, "cuda", weight_dtype)
        params = sum(p.numel() for p in model.parameters())
        result["params"] = params
        if mode == "gpu-only":
            def step(tokens, targets):
                forward_backward(model, tokens, targets, autocast)
                for p in model.parameters():
                    p.grad = None
        elif mode == "stock":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step(tokens, targets):
                forward_backward(model, tokens, targets, autocast)
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif mode == "torchao":  # torchao's CPUOffloadOptimizer, gradients offloaded, fused CPU AdamW
            from torchao.optim import CPUOffloadOptimizer
            opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, fused=True,
                                      lr=1e-4)

            def step(tokens, targets):
                forward_backward(model, tokens, targets, autocast)
                opt.step()
                opt.zero_grad()
        else:
            decisions = _Decisions()  # offload="auto" logs what it decided, from which figures
            start = time.perf_counter()
            client = trainstream.connect()
            model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                          client=client, moment_dtype=args.moment_dtype, bucket_mb=args.bucket_mb,
                                          offload="auto" if mode == "auto" else True)
            result["wrap_seconds"] = time.perf_counter() - start
            transport = trainstream._wrap._rank_of(model).transport
            result["transport"] = transport.name
            # cuda-ipc keeps the parameters and gradient staging slots outside torch's allocator: they
            # count against the cap too, so torch gets what is left.
            result["gpu_buffers_gib"] = getattr(transport, "device_bytes", 0) / GIB
            if args.vram_cap_gib:
                total = torch.cuda.get_device_properties(0).total_memory
                left = args.vram_cap_gib * GIB - getattr(transport, "device_bytes", 0)
                torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, left / total)))
                torch.cuda.empty_cache()  # the parameters' old blocks: torch's cache would count them
            del transport  # auto's switch frees the transport's GPU buffers: no reference may keep them

            def step(tokens, targets):
                forward_backward(model, tokens, targets, autocast, args.activation_paging, args.paging_gib)
                opt.step()
        memory = Memory()  # the peaks of the training steps, not of building the model
        times = timed_steps(args, step, memory)
        result["step_ms"] = 1000 * statistics.median(times)
        result["tokens_per_s"] = args.batch * args.seq / statistics.median(times)
        if mode == "auto":
            # After the switch (during the warm-up steps) the parameters are back in torch's memory and the
            # transport's GPU buffers are gone.
            result["switched_to_stock"] = not opt.offloaded
            result["auto_decision"] = decisions.messages
            if not opt.offloaded:
                result["gpu_buffers_gib"] = 0.0
        result.update(memory.report())
        result["torch_peak_plus_buffers_gib"] = result["torch_peak_gib"] + result.get("gpu_buffers_gib", 0)
        result["host_rss_gib"] = rss_bytes() / GIB
        if mode in ("trainstream", "auto"):
            stats = client.stats()
            result["daemon_rss_gib"] = stats["rss_bytes"] / GIB
            result["daemon_segments_gib"] = stats["host_bytes"] / GIB
            result["kernel"] = stats["kernel"]
            torch.cuda.set_per_process_memory_fraction(1.0)  # cuda-ipc: the parameters move back into torch
            trainstream.unwrap(model)
    except torch.OutOfMemoryError as e:
        result["oom"] = True
        result["error"] = str(e).splitlines()[0]
    return result


class _Decisions(logging.Handler):
    """Keeps the messages of the "trainstream" logger (the automatic modes' decisions)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        log = logging.getLogger("trainstream")
        log.setLevel(logging.INFO)
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def host_update_bytes_per_param(args) -> int:
    weights = 2 if args.bf16_weights else 4
    moments = 2 if args.moment_dtype == "bfloat16" else 4
    upload = 2 if args.bf16_weights else 0  # fp32 weights are read from the master weights in place
    return weights + 8 + 4 * moments + upload  # gradient, master r/w, two moments r/w, upload


def run_in_subprocess(mode: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--single-mode", mode]
    proc = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"mode": mode, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="124m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--vram-cap-gib", type=float, default=0)
    parser.add_argument("--bf16-weights", action="store_true", help="bf16 parameters on the GPU (else fp32 + autocast)")
    parser.add_argument("--moment-dtype", default="float32")
    parser.add_argument("--bucket-mb", type=float, default=32)
    parser.add_argument("--activation-paging", action="store_true",
                        help="trainstream mode: saved activations in pinned host memory (activation_paging)")
    parser.add_argument("--paging-gib", type=float, default=0,
                        help="with --activation-paging: page only the first this many GiB (max_bytes)")
    parser.add_argument("--modes", default="gpu-only,stock,trainstream,auto",
                        help="any of gpu-only, stock, trainstream, auto, torchao")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--adamw-json", help="benchmarks/adamw result of this machine, for the triad bandwidth")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--single-mode", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.vram_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap_gib * GIB / total))
    if args.single_mode:
        print(json.dumps(run(args, args.single_mode)), flush=True)
        return

    if args.adamw_json and os.path.exists(args.adamw_json):
        with open(args.adamw_json) as f:
            triad, triad_source = json.load(f)["triad"]["gb_per_s"], "benchmarks/adamw triad"
    else:
        triad, triad_source = host_triad_gbs(args.threads), "torch triad"
    results = {"config": args.config, "batch": args.batch, "seq": args.seq, "vram_cap_gib": args.vram_cap_gib,
               "activation_paging": args.activation_paging, "paging_gib": args.paging_gib,
               "bf16_weights": args.bf16_weights, "moment_dtype": args.moment_dtype,
               "gpu": torch.cuda.get_device_name(0), "host": platform.node(), "threads": args.threads,
               "host_bandwidth_gbs": triad, "host_bandwidth_source": triad_source, "runs": []}
    for mode in args.modes.split(","):
        r = run_in_subprocess(mode)
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
    by_mode = {r["mode"]: r for r in results["runs"]}
    params = next((r["params"] for r in results["runs"] if "params" in r), 0)
    results["host_update_bytes_per_param"] = host_update_bytes_per_param(args)
    results["host_update_ms"] = 1000 * params * results["host_update_bytes_per_param"] / (triad * 1e9)
    if "step_ms" in by_mode.get("trainstream", {}) and "step_ms" in by_mode.get("gpu-only", {}):
        bound = max(by_mode["gpu-only"]["step_ms"], results["host_update_ms"])
        results["trainstream_vs_bound"] = by_mode["trainstream"]["step_ms"] / bound
    if "step_ms" in by_mode.get("auto", {}) and "step_ms" in by_mode.get("stock", {}):
        auto, stock = by_mode["auto"], by_mode["stock"]
        results["auto_vs_stock"] = {"step": auto["step_ms"] / stock["step_ms"],
                                    "torch_peak": auto["torch_peak_plus_buffers_gib"] / stock["torch_peak_gib"],
                                    "driver_peak": auto["driver_peak_gib"] / stock["driver_peak_gib"]}
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
