"""Trains a nanoGPT-shaped model with stock fused GPU AdamW, with trainstream (mode trainstream: the
state always offloaded; mode auto: offload="auto", which switches to stock fused AdamW after 2 measured
steps when that fits) and (modes torchao,
deepspeed-zero2, deepspeed-zero3, when installed) with torchao's CPUOffloadOptimizer and DeepSpeed's
ZeRO-Offload (benchmarks/train_gpt/deepspeed_modes.py), and reports step time, tokens/s, peak GPU
memory (torch's counter, the driver's for the device and, through NVML, per process: the trainer's
and the daemon's CUDA context apart) and host memory.

Weight paging (--param-offload): trainstream builds the model on the CPU and pages its blocks; the
references then include the paging bound, 2 x the paged weight bytes over the pinned host-to-device
bandwidth measured in this run.

Each mode runs in a process of its own, so no mode sees another's memory. References measured in the
same run: the GPU-only step (forward + backward, no optimizer) and the host update time: the bytes the
host update must move per parameter for this configuration (gradient, master read+write, both
moments read+write, and for 16-bit weights the upload copy) over the host memory bandwidth (the
STREAM triad of benchmarks/adamw measured in this run when --adamw-json names its result, else a
torch triad). The targets are
  trainstream step <= 1.15 x max(GPU-only step, host update time);
  auto step and GPU memory (torch's peak) <= 1.05 x stock's, where stock fits (auto_vs_stock).
Where the trainer's thread goes: the phases of each step (forward, backward, step()), the waits for
the daemon, and with --hook-times the time in each of trainstream's hooks (hook_times.py).

  python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --batch 8 --seq 512 --vram-cap-gib 24
  python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes stock,trainstream,auto
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import daemon_trace  # noqa: E402
from busy_sampler import busy_cores, idle_ns, sampling  # noqa: E402
from hook_times import HookTimes  # noqa: E402
from neighbor import neighbor  # noqa: E402

import trainstream  # noqa: E402
from gpt import build  # noqa: E402
from trainstream._connect import PrivateDaemon  # noqa: E402

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


@functools.cache
def _nvml_device():
    """NVML's handle of this process's GPU, initialized once (each step samples it), None without NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:
        return None


def process_gpu_bytes() -> dict[int, int]:
    """GPU memory per process (pid -> bytes) from NVML, {} where NVML is unavailable."""
    device = _nvml_device()
    if device is None:
        return {}
    pynvml, handle = device
    try:
        return {p.pid: p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except pynvml.NVMLError:
        return {}


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_cpu_seconds(pid: int | None) -> float | None:
    """The daemon's CPU time so far; None without one, or once it exited (auto's switch stops its private
    daemon: `--modes auto` failed reading /proc/<pid>/stat, H100 2026-12-07)."""
    try:
        return cpu_seconds(pid) if pid else None
    except FileNotFoundError:
        return None


FIRST_STAGED = "backward to its first staged gradients"
TO_THE_PROJECTION = "forward to the output projection"  # with --gpu-phases, "forward" is then the projection and loss


def mark_first_staged(transport) -> None:
    """--gpu-phases with cuda-ipc: a GPU mark once backward's first bucket is copied into a staging slot,
    where the daemon may start pulling it. It splits backward's GPU time at the first gradients the
    daemon can take: the daemon sat idle 4-6 ms into backward, the tied embedding's gradient complete
    2.7 ms into it or not (2026-12-06)."""
    stage = transport.bucket_done

    def bucket_done(b: int, send) -> None:
        stage(b, send)
        if PHASES.gpu_steps and all(phase != FIRST_STAGED for phase, _ in PHASES.gpu_steps[-1]):
            PHASES.mark_gpu(FIRST_STAGED)

    transport.bucket_done = bucket_done


class Phases:
    """Where a step's wall time goes, as the trainer's thread sees it: the forward up to the loss (with
    trainstream: waiting for weights), backward (sending gradients, waiting for slots), the optimizer's
    step(), then waiting for the GPU and sampling memory. Medians per phase over the timed steps.

    With `gpu` on (--gpu-phases), the same marks on the GPU's clock too: a timing event on the current
    stream at each mark and after the token embedding's kernel (mark_gpu), so that a phase's GPU time
    runs from the previous event's completion to its own. Why: with trainstream's GPU waits the forward's
    kernels wait on the GPU for the tied embedding's update, which the trainer's clock does not see; its
    threads sat idle 8-12 ms of the 124M's step where no timer of ours looked (2026-12-06)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.start_ns: list[int] = []  # each step's start on the monotonic clock
        self._last = 0.0
        self.gpu = False
        self.gpu_steps: list[list[tuple[str, torch.cuda.Event]]] = []

    def start(self) -> None:
        self.steps.append({})
        self.start_ns.append(time.monotonic_ns())
        self._last = time.perf_counter()
        if self.gpu:
            self.gpu_steps.append([])
            self.mark_gpu("start")

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        if self.steps:
            self.steps[-1][phase] = self.steps[-1].get(phase, 0.0) + now - self._last
        self._last = now
        self.mark_gpu(phase)

    def mark_gpu(self, phase: str) -> None:
        if self.gpu and self.gpu_steps:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.gpu_steps[-1].append((phase, event))

    def medians_ms(self, skip: int) -> dict[str, float]:
        return {phase: 1000 * seconds for phase, seconds in medians(self.steps[skip:]).items()}

    def gpu_windows_ns(self, skip: int) -> list[list[tuple[str, int, int]]]:
        """Each timed step's GPU phases as (phase, start, end) on the monotonic clock, once their events
        have completed. A step's first event ran as it was recorded: the step before ended with a
        synchronize, so the GPU was idle."""
        steps = []
        for start_ns, events in zip(self.start_ns[skip:], self.gpu_steps[skip:]):
            windows, t = [], start_ns
            for (_, before), (phase, after) in zip(events, events[1:]):
                end = t + round(before.elapsed_time(after) * 1e6)
                windows.append((phase, t, end))
                t = end
            steps.append(windows)
        return steps

    def gpu_medians_ms(self, skip: int) -> dict[str, float]:
        """Each GPU phase's median over the timed steps (a phase marked twice in a step: its sum)."""
        steps = []
        for windows in self.gpu_windows_ns(skip):
            step: dict[str, float] = {}
            for phase, start, end in windows:
                step[phase] = step.get(phase, 0.0) + (end - start) / 1e6
            steps.append(step)
        return medians(steps)


def medians(steps) -> dict[str, float]:
    """Per key, the median over `steps` (dicts; a key missing from a step counts as 0), in the first's order."""
    steps = list(steps)
    keys = steps[0] if steps else {}
    return {key: statistics.median(s.get(key, 0.0) for s in steps) for key in keys}


def daemon_busy(samples: dict, steps: list[list[tuple[str, int, int]]]) -> dict:
    """Where in a step the daemon works (busy_sampler's samples against the steps' GPU phases): per
    phase its workers running on average and the milliseconds none ran, medians over the steps, the
    whole step's idle milliseconds, and the last three steps' phases and samples."""
    cores, idle = [], []
    for windows in steps:
        busy: dict[str, float] = {}
        lengths: dict[str, float] = {}
        idle_ms: dict[str, float] = {"step": idle_ns(samples, windows[0][1], windows[-1][2]) / 1e6}
        for phase, start, end in windows:
            busy[phase] = busy.get(phase, 0.0) + busy_cores(samples, start, end) * (end - start)
            lengths[phase] = lengths.get(phase, 0.0) + end - start
            idle_ms[phase] = idle_ms.get(phase, 0.0) + idle_ns(samples, start, end) / 1e6
        cores.append({phase: busy[phase] / max(1.0, lengths[phase]) for phase in busy})
        idle.append(idle_ms)
    traced = steps[-3:]  # the last steps' samples as they are, to see where in a phase the daemon waits
    start, end = (traced[0][0][1], traced[-1][-1][2]) if traced else (0, 0)
    kept = [i for i, t in enumerate(samples["t_ns"]) if start <= t <= end]
    return {"cores_by_gpu_phase": medians(cores), "idle_ms_by_gpu_phase": medians(idle),
            "idle_ms_per_step": [s["step"] for s in idle],
            "last_steps": {"gpu_phases_ns": traced, "t_ns": [samples["t_ns"][i] for i in kept],
                           "busy": [samples["busy"][i] for i in kept]}}


PHASES = Phases()


class Memory:
    """Peak GPU memory from torch's allocator, from the driver (cudaMemGetInfo: the whole device) and
    per process from NVML (this trainer; `daemon_pid`'s, the daemon's CUDA context and buffers), from
    its creation on."""

    def __init__(self, daemon_pid: int | None = None):
        torch.cuda.reset_peak_memory_stats()
        self.driver_peak = self.driver_last = 0
        self.trainer_peak = 0
        self.daemon_peak = 0
        self.daemon_pid = daemon_pid
        self.first_step_s = 0.0
        self.first_step_waits_s: dict[str, float] = {}

    def sample(self):
        free, total = torch.cuda.mem_get_info()
        self.driver_peak = max(self.driver_peak, total - free)
        self.driver_last = total - free  # after the last step: auto's steady state, its daemon stopped
        per_process = process_gpu_bytes()
        self.trainer_peak = max(self.trainer_peak, per_process.get(os.getpid(), 0))
        if self.daemon_pid:
            self.daemon_peak = max(self.daemon_peak, per_process.get(self.daemon_pid, 0))

    def report(self) -> dict:
        report = {"torch_peak_gib": torch.cuda.max_memory_allocated() / GIB, "driver_peak_gib": self.driver_peak / GIB,
                  "driver_last_gib": self.driver_last / GIB}
        if self.trainer_peak:
            report["trainer_process_peak_gib"] = self.trainer_peak / GIB
        if self.daemon_peak:
            report["daemon_process_gib"] = self.daemon_peak / GIB
        return report


def batches(args, device):
    g = torch.Generator(device=device).manual_seed(0)
    while True:
        tokens = torch.randint(0, 50304, (args.batch, args.seq + 1), device=device, generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


# The blocking waits on the daemon a trainstream model counts: name -> (the attribute, on the rank, its
# WeightReads or its transport, the key of train_gpt's JSON).
WAITS = {"weights": ("weights_wait_s", "weights_wait_ms"),  # forward: the host update behind
         "slots": ("slot_wait_s", "slot_wait_ms"),  # backward: a free staging slot, the gradient copies behind
         "gradient regions": ("region_wait_s", "region_wait_ms"),  # backward: a bucket's previous gradients consumed
         "weights wanted": ("wanted_wait_s", "wanted_wait_ms")}  # step(): the daemon passed an event's last use


def daemon_workers(args) -> int:
    """The daemon's worker threads: --daemon-threads, else one per CPU this process may run on."""
    return args.daemon_threads or len(os.sched_getaffinity(0))


def daemon_waits(model) -> dict[str, float]:
    """Seconds a trainstream model has waited for the daemon so far, per kind of WAITS; zeros once
    offload="auto" switched to stock AdamW."""
    try:
        rank = trainstream._wrap._rank_of(model)
    except trainstream.TrainstreamError:
        return dict.fromkeys(WAITS, 0.0)
    # A package from before WeightReads (gpt-before-after's "before") has no rank.reads.
    holders = (rank, getattr(rank, "reads", None), rank.transport)
    return {name: next((getattr(h, attribute) for h in holders if hasattr(h, attribute)), 0.0)
            for name, (attribute, _) in WAITS.items()}


def timed_steps(args, step_fn, memory: Memory, losses: list | None = None, waits=None,
                hooks: HookTimes | None = None) -> tuple[list, list, dict]:
    """The step times after the warm-up (memory.first_step_s is the first step's), with `waits`
    (daemon_waits of the model) each step's seconds of each wait (the timed steps',
    memory.first_step_waits_s the first's), and how many cores the trainer and the daemon
    (memory.daemon_pid) kept busy over the timed steps; `hooks` counts from the first timed step."""
    data = batches(args, "cuda")
    times, waited = [], []
    cpu_before = (0.0, 0.0, 0.0)
    # Without Python stacks by default: tracing every Python call inflated the 124M's hooks by an
    # unknown factor (benchmarks/results/train_gpt.md, 2026-12-05, night); each torch op's own CPU time
    # is what tells the modes apart.
    profiler = torch.profiler.profile(with_stack=args.profile_stacks) if args.profile else None
    for i in range(args.warmup + args.steps):
        tokens, targets = next(data)
        torch.cuda.synchronize()
        if i == args.warmup:
            cpu_before = (time.perf_counter(), cpu_seconds(), daemon_cpu_seconds(memory.daemon_pid))
            if profiler:  # a timeline of the timed steps (which it slows) for chrome://tracing or Perfetto
                profiler.start()
            if hooks:
                hooks.reset()
        before = waits() if waits else {}
        start = time.perf_counter()
        PHASES.start()
        loss = step_fn(tokens, targets)
        PHASES.mark("optimizer")
        torch.cuda.synchronize()
        PHASES.mark("gpu")
        memory.sample()
        PHASES.mark("memory sample")
        if losses is not None and loss is not None:
            losses.append(float(loss))
        after = waits() if waits else {}
        step_waits = {name: after[name] - before[name] for name in after}
        if i == 0:
            memory.first_step_s = time.perf_counter() - start
            memory.first_step_waits_s = step_waits
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            waited.append(step_waits)
    wall = time.perf_counter() - cpu_before[0]
    if profiler:
        profiler.stop()
        profiler.export_chrome_trace(args.profile)
        with open(os.path.splitext(args.profile)[0] + "_ops.txt", "w") as f:  # totals over the timed steps
            f.write(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=50))
    cores = {"trainer": (cpu_seconds() - cpu_before[1]) / wall}
    daemon_after = daemon_cpu_seconds(memory.daemon_pid)
    if cpu_before[2] is not None and daemon_after is not None:
        cores["daemon"] = (daemon_after - cpu_before[2]) / wall
    return times, waited, cores


def pinned_h2d_gbs(gib: float = 1.0) -> float:
    """Host-to-device bandwidth from page-locked memory (torch's pin_memory), best of five."""
    host = torch.empty(int(gib * GIB), dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, host.numel() / (time.perf_counter() - start) / 1e9)
    return best


def forward_backward(model, tokens, targets, autocast: bool, paging: bool = False, paging_gib: float = 0):
    max_bytes = int(paging_gib * GIB) if paging_gib else None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), \
            trainstream.activation_paging(max_bytes=max_bytes) if paging else contextlib.nullcontext():
        loss = model(tokens, targets)
    PHASES.mark("forward")
    loss.backward()
    PHASES.mark("backward")
    return loss.detach()


def param_offload(value: str):
    """--param-offload: "true", a fraction, or comma-separated block indices."""
    if value.lower() == "true":
        return True
    return [int(i) for i in value.split(",")] if "," in value else float(value)


def cap_torch(args, outside_torch: int) -> None:
    """Caps torch's allocator so that what this process holds on the GPU stays under --vram-cap-gib:
    `outside_torch` bytes (the CUDA context, buffers from the driver) count against it too."""
    total = torch.cuda.get_device_properties(0).total_memory
    left = args.vram_cap_gib * GIB - outside_torch
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, left / total)))
    torch.cuda.empty_cache()  # the parameters' old blocks: torch's cache would count them


def run(args, mode: str) -> dict:
    torch.cuda.empty_cache()
    weight_dtype = torch.bfloat16 if args.bf16_weights else torch.float32
    autocast = not args.bf16_weights
    result = {"mode": mode}
    model_options = {"checkpoint_blocks": args.checkpoint_blocks, "chunked_loss": args.chunked_loss,
                     "detached_lookup": args.probe_detached_lookup}
    losses: list[float] = []
    daemon_pid = None
    hooks = None  # HookTimes of a trainstream model, with --hook-times
    torch.zeros(1, device="cuda")  # creates the CUDA context
    torch.cuda.synchronize()
    context_bytes = max(0, process_gpu_bytes().get(os.getpid(), 0) - torch.cuda.memory_reserved())
    result["cuda_context_gib"] = context_bytes / GIB
    if mode == "gpu-only" and args.uncapped_reference:
        args.vram_cap_gib = 0
        torch.cuda.set_per_process_memory_fraction(1.0)
    if args.vram_cap_gib:  # what this process holds outside torch counts against the cap too
        cap_torch(args, context_bytes)
    try:
        torch.manual_seed(0)
        if mode.startswith("deepspeed"):
            import deepspeed_modes
            start = time.perf_counter()
            builder = lambda dtype: build(args.config, "cuda", dtype, chunked_loss=args.chunked_loss)  # noqa: E731
            if mode == "deepspeed-zero2":
                engine, step = deepspeed_modes.build_zero2(builder, 1e-4, args.bf16_weights, args.batch,
                                                           args.max_grad_norm or 0.0)
            else:
                engine, step = deepspeed_modes.build_zero3(builder, 1e-4, args.bf16_weights, args.batch,
                                                           args.checkpoint_blocks, args.max_grad_norm or 0.0)
            result["init_seconds"] = time.perf_counter() - start
            result["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.parameters())
        else:
            on_cpu = mode == "trainstream" and args.param_offload  # paged: built on the CPU, never whole on the GPU
            model = build(args.config, "cpu" if on_cpu else "cuda", weight_dtype, **model_options)
            result["params"] = sum(p.numel() for p in model.parameters())
        if mode.startswith("deepspeed"):
            pass
        elif mode == "gpu-only":
            def step(tokens, targets):
                loss = forward_backward(model, tokens, targets, autocast)
                for p in model.parameters():
                    p.grad = None
                return loss
        elif mode == "stock":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step(tokens, targets):
                loss = forward_backward(model, tokens, targets, autocast)
                if args.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss
        elif mode == "torchao":  # torchao's CPUOffloadOptimizer, gradients offloaded, fused CPU AdamW
            from torchao.optim import CPUOffloadOptimizer
            opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, fused=True,
                                      lr=1e-4)

            def step(tokens, targets):
                loss = forward_backward(model, tokens, targets, autocast)
                if args.max_grad_norm:
                    clip_torchao_gradients(opt, args.max_grad_norm)
                opt.step()
                opt.zero_grad()
                return loss
        else:
            decisions = _Decisions()  # offload="auto" logs what it decided, from which figures
            # Built before the clock starts: torch's first optimizer imports torch._dynamo (2.1 s on the
            # dev box), a cost of every torch program, not of wrap().
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            start = time.perf_counter()
            private = None
            own_daemon = args.daemon_threads or args.daemon_nice is not None or args.daemon_policy or args.daemon_trace
            if own_daemon and mode == "trainstream":
                trace_dir = tempfile.mkdtemp(prefix="trainstream-trace-") if args.daemon_trace else None
                private = PrivateDaemon(threads=args.daemon_threads, worker_nice=args.daemon_nice,
                                        trace_dir=trace_dir, worker_policy=args.daemon_policy)
                client = trainstream.connect(f"unix:{private.socket_path}")
            else:
                client = trainstream.connect()
            daemon_pid = client.ping()["pid"]
            paging = {"device": "cuda", "param_offload": param_offload(args.param_offload),
                      "page_prefetch": args.page_prefetch, "page_dtype": args.page_dtype} if args.param_offload else {}
            model, opt = trainstream.wrap(model, optimizer,
                                          # auto: wrap's own connection, whose private daemon stops at the switch
                                          client=None if mode == "auto" else client,
                                          moment_dtype=args.moment_dtype, bucket_mb=args.bucket_mb,
                                          max_grad_norm=args.max_grad_norm, offload="auto" if mode == "auto" else True,
                                          # one backward pass a step, said: the results before counting stay
                                          # comparable (benchmarks/drop_in measures the one line)
                                          accumulation_steps=1,
                                          state_halves=args.state_halves if args.state_halves == "auto"
                                          else int(args.state_halves), **paging)
            result["wrap_seconds"] = time.perf_counter() - start
            rank = trainstream._wrap._rank_of(model)
            result["wrap_phases_s"] = dict(rank.timings)
            transport = rank.transport
            result["transport"] = transport.name
            if rank.pager is not None:
                result["paged_blocks"] = len(rank.paging.blocks)
                result["paged_bytes"] = sum(b.nbytes for b in rank.pager.blocks.values())
                result["page_slots"] = len(rank.pager.in_slot)
            # cuda-ipc keeps the parameters and gradient staging slots outside torch's allocator: they
            # count against the cap too, so torch gets what is left; so does the CUDA context.
            result["gpu_buffers_gib"] = getattr(transport, "device_bytes", 0) / GIB
            if args.vram_cap_gib:
                cap_torch(args, getattr(transport, "device_bytes", 0) + context_bytes)
            pager, job = rank.pager, rank.job
            hooks = HookTimes(rank) if args.hook_times else None
            if args.gpu_phases and mode == "trainstream" and hasattr(transport, "bucket_done"):
                mark_first_staged(transport)
            del rank, transport  # auto's switch frees the transport's GPU buffers: no reference may keep them

            def step(tokens, targets):
                loss = forward_backward(model, tokens, targets, autocast, args.activation_paging, args.paging_gib)
                opt.step()
                return loss
        memory = Memory(daemon_pid)  # the peaks of the training steps, not of building the model
        offloaded = mode in ("trainstream", "auto")
        waits = functools.partial(daemon_waits, model) if offloaded else None
        if args.gpu_phases and not mode.startswith("deepspeed"):  # the token embedding: the forward's first kernel
            model.wte.register_forward_hook(lambda *_: PHASES.mark_gpu("token embedding"))
            # the final norm: what follows (the output projection and the loss) needs the tied weight's update
            # whole, and backward then runs the projection's before its first gradient goes to the daemon
            model.ln.register_forward_hook(lambda *_: PHASES.mark_gpu(TO_THE_PROJECTION))
        PHASES.gpu = args.gpu_phases
        sampled = daemon_pid if args.daemon_busy and offloaded else None
        with neighbor(args.beside) as beside, sampling(sampled, daemon_workers(args)) as samples:
            times, waited, cores = timed_steps(args, step, memory, losses, waits, hooks)
        if beside:
            result["beside"] = beside
        if args.gpu_phases:
            result["gpu_phases_ms"] = PHASES.gpu_medians_ms(args.warmup)
        if samples:
            result["daemon_busy"] = daemon_busy(samples, PHASES.gpu_windows_ns(args.warmup))
        result["step_times_ms"] = [1000 * t for t in times]
        result["phases_ms"] = PHASES.medians_ms(args.warmup)
        result["busy_cores"] = cores
        if offloaded:  # where a step's time beyond the GPU's went: the trainer waiting for the daemon
            for name, (_, key) in WAITS.items():
                result[key] = [1000 * w[name] for w in waited]
            if hooks:  # and in trainstream's hooks
                result["hooks_per_step"] = hooks.per_step(args.steps)
                hooks.close()
        # The first step and where its time went in every mode: the GPU-only one is the model's own warm-up
        # (kernels loaded, allocator grown), the floor under trainstream's first step.
        result["first_step_seconds"] = memory.first_step_s
        result["first_step_phases_ms"] = {phase: 1000 * s for phase, s in PHASES.steps[0].items()}
        if "wrap_seconds" in result:  # from wrap() to the end of the first step
            result["wrap_to_first_step_seconds"] = result["wrap_seconds"] + memory.first_step_s
            result["first_step_waits_ms"] = {name: 1000 * s for name, s in memory.first_step_waits_s.items()}
        result["losses"] = losses
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
        if mode == "auto" and not opt.offloaded:  # switched: the job dropped, the private daemon stopped
            private = client.private_daemon
            result["daemon_stopped"] = private is not None and private.process.poll() is not None
            trainstream.unwrap(model)
        elif mode in ("trainstream", "auto"):
            trainstream.synchronize(model)
            stats = client.stats()
            result["daemon_rss_gib"] = stats["rss_bytes"] / GIB
            result["daemon_segments_gib"] = stats["host_bytes"] / GIB
            result["kernel"] = stats["kernel"]
            for counts in (j for j in stats["jobs"] if j["name"] == job):
                result["state_halves"] = counts["state_halves"]
                if args.max_grad_norm:  # how many steps clipped, and so were redone or waited for the norm
                    result["clipping"] = {k: counts[k] for k in ("completed_step", "speculative_steps", "redone_steps")}
            torch.cuda.set_per_process_memory_fraction(1.0)  # cuda-ipc: the parameters move back into torch
            if pager is not None:
                # Not unwrapped: unwrap() copies the paged weights and the optimizer state into this
                # process (torch holds them from then on), which for the 10.1B is 60 GB beside its job's
                # 94 GiB on a 125 GiB host (the OOM killer took the process). Its job goes at exit.
                result["page_loads_per_step"] = pager.loads / (args.warmup + args.steps)
            else:
                trainstream.unwrap(model)
            if args.daemon_trace and private is not None:  # its job writes the trace as the daemon stops
                private.stop()
                trace = daemon_trace.load(trace_dir)
                result["daemon_trace"] = daemon_trace.analyse(
                    trace, PHASES.start_ns, [0] * args.warmup + [round(t * 1e9) for t in times],
                    args.warmup, PHASES.gpu_windows_ns(args.warmup) if args.gpu_phases else None)
                if args.json:  # the spans themselves beside the result, for questions the summary does not answer
                    daemon_trace.keep(trace, PHASES.start_ns, args.json.removesuffix(".json") + ".trace.json.gz")
                shutil.rmtree(trace_dir, ignore_errors=True)
                print(daemon_trace.summary(result["daemon_trace"]), flush=True)
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
    sixteen = args.bf16_weights or args.page_dtype  # page_dtype: the blocks' Linear weights, most of the model
    weights = 2 if sixteen else 4
    moments = 2 if args.moment_dtype == "bfloat16" else 4
    upload = 2 if sixteen else 0  # fp32 weights are read from the master weights in place
    return weights + 8 + 4 * moments + upload  # gradient, master r/w, two moments r/w, upload


def clip_torchao_gradients(opt, max_norm: float) -> None:
    """torch's clip_grad_norm_ for a torchao CPUOffloadOptimizer with offloaded gradients, which has no
    clipping of its own: once every gradient's copy to the host has landed, over the host gradients and
    those of the small parameters it keeps on the GPU (torch's norm sums across devices)."""
    for copied in opt.queue.values():
        copied.synchronize()
    on_gpu = [p for group in opt.d_param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_([*opt.param_d2h_map.values(), *on_gpu], max_norm)


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
    parser.add_argument("--state-halves", default="auto", choices=["auto", "1", "2"],
                        help="trainstream modes: copies of the optimizer state in the daemon (wrap's state_halves)")
    parser.add_argument("--activation-paging", action="store_true",
                        help="trainstream mode: saved activations in pinned host memory (activation_paging)")
    parser.add_argument("--paging-gib", type=float, default=0,
                        help="with --activation-paging: page only the first this many GiB (max_bytes)")
    parser.add_argument("--modes", default="gpu-only,stock,trainstream,auto",
                        help="any of gpu-only, stock, trainstream, auto, torchao, deepspeed-zero2, deepspeed-zero3")
    parser.add_argument("--param-offload", default="",
                        help="trainstream mode: weight paging (true, a fraction, or block indices i,j,...)")
    parser.add_argument("--page-prefetch", type=int, default=2)
    parser.add_argument("--page-dtype", choices=["bfloat16"],
                        help="with --param-offload and fp32 weights: the blocks' Linear weights page in bf16 (wrap's "
                             "page_dtype; the forward runs under bf16 autocast)")
    parser.add_argument("--checkpoint-blocks", action="store_true", help="recompute each block in backward")
    parser.add_argument("--chunked-loss", action="store_true", help="output projection + loss in chunks of tokens")
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--probe-detached-lookup", action="store_true",
                        help="a probe, not training: the token lookup reads the tied embedding detached, so that its "
                             "gradient is the output projection's alone, complete early in backward: the most that "
                             "splitting the tied embedding's update could gain (its rows' update after backward left "
                             "out)")
    parser.add_argument("--uncapped-reference", action="store_true",
                        help="the gpu-only reference runs without --vram-cap-gib (a model that does not fit under it)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="the torch triad's threads")
    parser.add_argument("--daemon-threads", type=int, default=0,
                        help="mode trainstream: a private daemon with this many worker threads (default: 1 per CPU)")
    parser.add_argument("--daemon-nice", type=int,
                        help="mode trainstream: a private daemon whose worker threads run at this nice value")
    parser.add_argument("--daemon-policy", choices=("normal", "idle"),
                        help="mode trainstream: a private daemon whose worker threads run at this policy")
    parser.add_argument("--profile", help="a torch.profiler trace of the timed steps into this file (for one mode), "
                        "and its ops' CPU times beside it (<file>_ops.txt)")
    parser.add_argument("--profile-stacks", action="store_true", help="with --profile: Python stacks too (slows it)")
    parser.add_argument("--hook-times", action="store_true",
                        help="time trainstream's hooks on the trainer's thread (hook_times.py): hooks_per_step")
    parser.add_argument("--gpu-phases", action="store_true",
                        help="each step's phases on the GPU's clock too (gpu_phases_ms), the token embedding, the "
                             "forward to the output projection and (cuda-ipc) backward to its first staged gradients "
                             "apart")
    parser.add_argument("--daemon-trace", action="store_true",
                        help="mode trainstream: a private daemon that writes its step trace (trainstreamd "
                        "--trace-dir): each bucket's pulls, update blocks and pushes against the steps "
                        "(daemon_trace.py): daemon_trace")
    parser.add_argument("--daemon-busy", action="store_true",
                        help="trainstream modes: the daemon's running workers sampled every 0.5 ms (busy_sampler.py), "
                        "per GPU phase (implies --gpu-phases): daemon_busy")
    parser.add_argument("--beside", help="triad:N, compute:N, adamw:N or copies:N: a process beside every mode's "
                        "steps, of N threads streaming host memory, computing in cache or running torch's fused CPU "
                        "AdamW, or copying N GB/s each way between the GPU and pinned host memory in a CUDA context "
                        "of its own (neighbor.py)")
    parser.add_argument("--adamw-json", help="benchmarks/adamw result of this machine, for the triad bandwidth")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--single-mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.gpu_phases = args.gpu_phases or args.daemon_busy

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
    h2d = pinned_h2d_gbs()
    results = {"config": args.config, "batch": args.batch, "seq": args.seq, "vram_cap_gib": args.vram_cap_gib,
               "param_offload": args.param_offload, "page_dtype": args.page_dtype,
               "checkpoint_blocks": args.checkpoint_blocks,
               "chunked_loss": args.chunked_loss, "max_grad_norm": args.max_grad_norm,
               "probe_detached_lookup": args.probe_detached_lookup, "pinned_h2d_gbs": h2d,
               "activation_paging": args.activation_paging, "paging_gib": args.paging_gib,
               "bf16_weights": args.bf16_weights, "moment_dtype": args.moment_dtype,
               "gpu": torch.cuda.get_device_name(0), "host": platform.node(), "threads": args.threads,
               "daemon_threads": daemon_workers(args),
               "daemon_worker_nice": args.daemon_nice, "daemon_worker_policy": args.daemon_policy,
               "host_bandwidth_gbs": triad, "host_bandwidth_source": triad_source, "runs": []}
    for mode in args.modes.split(","):
        r = run_in_subprocess(mode)
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
    by_mode = {r["mode"]: r for r in results["runs"]}
    params = next((r["params"] for r in results["runs"] if "params" in r), 0)
    results["host_update_bytes_per_param"] = host_update_bytes_per_param(args)
    results["host_update_ms"] = 1000 * params * results["host_update_bytes_per_param"] / (triad * 1e9)
    paged_bytes = by_mode.get("trainstream", {}).get("paged_bytes", 0)
    if paged_bytes:  # every paged weight crosses PCIe twice per step
        results["paging_bound_ms"] = 1000 * 2 * paged_bytes / (h2d * 1e9)
    if "step_ms" in by_mode.get("trainstream", {}) and "step_ms" in by_mode.get("gpu-only", {}):
        bound = max(by_mode["gpu-only"]["step_ms"], results["host_update_ms"], results.get("paging_bound_ms", 0))
        results["bound_ms"] = bound
        results["trainstream_vs_bound"] = by_mode["trainstream"]["step_ms"] / bound
    for peer in ("deepspeed-zero3", "deepspeed-zero2", "torchao", "stock"):
        if "step_ms" in by_mode.get(peer, {}) and "step_ms" in by_mode.get("trainstream", {}):
            results[f"{peer}_vs_trainstream"] = by_mode[peer]["step_ms"] / by_mode["trainstream"]["step_ms"]
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
