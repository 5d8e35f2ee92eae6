"""LoRA r=16 on a Qwen2.5-shaped base bigger than a VRAM cap: TrainstreamTrainer (the base's decoder layers
paged from host memory) beside same-run references, each mode in its own process. The base is built from
its configuration with random weights (no download, no Hugging Face init: a seeded random pool tiled into
each matrix at memory speed), in bf16, on the CPU; gradient checkpointing; batch 4 x 512.

Modes (--modes, comma-separated; each runs in a subprocess with --mode-timeout seconds, so one mode's
out-of-memory, crash or timeout is recorded as that mode's error and the others still run):
  trainstream      TrainstreamTrainer, decoder layers paged, under --vram-cap-gib
  gpu-only         the stock Trainer with the whole base on the GPU, uncapped (the bound's GPU-only step;
                   on a machine without CUDA, the stock Trainer on the CPU)
  accelerate       the stock Trainer with each decoder layer's frozen base linears offloaded by
                   accelerate.cpu_offload (weights in host memory, copied in at each forward, so twice
                   a step with checkpointing), the rest on the GPU, under the cap
  deepspeed-zero3  the stock Trainer with deepspeed= ZeRO-3, parameters and optimizer offloaded to pinned
                   host memory, bf16, under the cap (benchmarks/train_gpt/deepspeed_modes.py's configuration
                   and one-process NCCL group; skipped, with the reason, without CUDA or deepspeed). Checked
                   off the GPU machine only with DeepSpeed 0.19.8's CPU accelerator (gloo, fp32, torch AdamW)

The parent prints one JSON line (and writes --json): per mode the median step after --warmup steps, step
times, losses, torch peak, the process's GPU memory, peak host RSS, build and setup seconds, or the error;
with CUDA also the pinned host-to-device GB/s, bound_s = max(gpu-only step, 2 x base bytes / H2D) and each
mode's ratio to it.

    python3 benchmarks/lora/lora_bench.py --shape 14b --vram-cap-gib 8 --json out.json
    python3 benchmarks/lora/lora_bench.py --shape tiny --modes trainstream,gpu-only   # a smoke run (CPU or GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train_gpt"))
import deepspeed_modes  # noqa: E402  (imports without DeepSpeed: it is imported where used)

GIB = 1 << 30
SHAPES = {  # Qwen2.5 configurations (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (64, 128, 4, 4, 2, 512),
    "1.5b": (1536, 8960, 28, 12, 2, 151936),
    "7b": (3584, 18944, 28, 28, 4, 152064),
    "14b": (5120, 13824, 48, 40, 8, 152064),
    "32b": (5120, 27648, 64, 40, 8, 152064),
}
MODES = ("trainstream", "gpu-only", "accelerate", "deepspeed-zero3")
POOL = (1 << 22) + 17  # random values tiled into the weights; odd length, so tiles never line up with rows
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config_of(shape: str):
    import transformers
    hidden, intermediate, layers, heads, kv, vocab = SHAPES[shape]
    return transformers.Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                    max_position_embeddings=4096, tie_word_embeddings=False)


def _no_init_weights():
    """transformers' switch that skips its weight init (moved between major versions)."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        with contextlib.suppress(ImportError, AttributeError):
            return getattr(__import__(where, fromlist=["no_init_weights"]), "no_init_weights")()
    return contextlib.nullcontext()


def fill_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights as Hugging Face's init would give them in distribution (matrices ~N(0, 0.02), norm
    weights one, biases zero), deterministic in `seed`, at memory speed: a small random pool is tiled into
    each matrix from a seeded offset."""
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=g) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            with _gathered(p):
                if p.dim() == 1:
                    p.fill_(1.0 if "norm" in name else 0.0)
                    continue
                flat, start = p.view(-1), int(torch.randint(0, POOL, (1,), generator=g))
                done = 0
                while done < flat.numel():
                    n = min(POOL - start, flat.numel() - done)
                    flat[done:done + n].copy_(pool[start:start + n])
                    done, start = done + n, 0


def _gathered(p: torch.nn.Parameter):
    """A parameter that ZeRO-3 partitioned as it was built (zero.Init) whole while it is written, then
    partitioned again; any other parameter as it is."""
    if not hasattr(p, "ds_numel"):
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters([p], modifier_rank=0)


def build(shape: str, fast: bool = True):
    """The peft LoRA model on a random bf16 base on the CPU. `fast=False` is Hugging Face's own init."""
    import peft
    import transformers
    torch.manual_seed(0)
    with _no_init_weights() if fast else contextlib.nullcontext():
        model = transformers.AutoModelForCausalLM.from_config(config_of(shape), dtype=torch.bfloat16)
    if fast:
        fill_random(model)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    return peft.get_peft_model(model, lora)


def base_bytes_of(shape: str) -> int:
    """The bf16 base's bytes, from a model on the meta device (nothing allocated)."""
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_of(shape), dtype=torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def pinned_h2d_gbs() -> float:
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, GIB / (time.perf_counter() - start) / 1e9)
    return best


def process_gpu_gib() -> float:
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return sum((p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                   if p.pid == os.getpid()) / GIB
    except Exception:
        return 0.0


def cap_gpu(cap_gib: float) -> None:
    if torch.cuda.is_available() and cap_gib:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory))


def offload_base_linears(model, device: torch.device) -> int:
    """accelerate's CPU offload of the frozen base: each decoder layer's base linears keep their weights in
    host memory (accelerate's weights map) and get them copied to `device` at each forward; everything
    else (embeddings, norms, the LoRA adapters, the head) lives on `device`. Trainer and accelerate are
    told not to move the model (its hf_device_map names the CPU and the device). Returns the bytes offloaded."""
    import accelerate
    frozen = [m for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name.endswith("base_layer") and ".layers." in name]
    offloaded = sum(p.numel() * p.element_size() for m in frozen for p in m.parameters())
    for module in frozen:
        accelerate.cpu_offload(module, execution_device=device)
    for module in model.modules():
        if module not in frozen:
            for key, p in module.named_parameters(recurse=False):
                if p.device.type != "meta":
                    module._parameters[key] = torch.nn.Parameter(p.data.to(device), requires_grad=p.requires_grad)
            for key, b in module.named_buffers(recurse=False):
                module._buffers[key] = b.to(device)
    home = (device.index or 0) if device.type == "cuda" else "cpu"
    model.base_model.model.hf_device_map = {"model.layers": "cpu", "": home}
    return offloaded


def _arguments_class(mode: str):
    import transformers

    class Arguments(transformers.TrainingArguments):
        @property
        def place_model_on_device(self):  # the accelerate mode placed the model itself
            return False if mode == "accelerate" else super().place_model_on_device

    return Arguments


def run_mode(mode: str, args) -> dict:
    """One mode, in this process: builds, trains --warmup + --steps steps, measures."""
    import transformers
    cuda = torch.cuda.is_available()
    if mode == "deepspeed-zero3":
        deepspeed_modes.init_distributed()
    if mode != "gpu-only":
        cap_gpu(args.vram_cap_gib)
    # weight decay 0.01 in every mode: the Trainer refuses a deepspeed= config that disagrees with its arguments
    extra = {"deepspeed": deepspeed_modes.zero3_config(1e-4, args.batch, 1.0)} if mode == "deepspeed-zero3" else {}
    # Before the model, as Hugging Face's recipe for ZeRO-3 says: arguments with a ZeRO-3 config make
    # from_config build under deepspeed.zero.Init, each module partitioned into host memory as it is
    # built (the whole base on the GPU first was out of memory under the 14B's 8 GiB cap).
    training = _arguments_class(mode)(
        output_dir=tempfile.mkdtemp(prefix="lora-bench-"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.batch, learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0, bf16=cuda,
        gradient_checkpointing=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=not cuda, **extra)
    started = time.perf_counter()
    model = build(args.shape)
    result = {"build_s": time.perf_counter() - started}
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    started = time.perf_counter()
    if mode != "trainstream":
        model.enable_input_require_grads()  # peft's recipe for checkpointing a frozen base
    if mode == "gpu-only" and cuda:
        model.to(device)
    elif mode == "accelerate":
        result["offloaded_gib"] = offload_base_linears(model, device) / GIB
    result["place_s"] = time.perf_counter() - started
    vocab, steps = SHAPES[args.shape][5], args.warmup + args.steps
    tokens = torch.randint(0, vocab, (args.batch * steps, args.seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    if mode == "trainstream":
        from trainstream.hf import TrainstreamTrainer
        options = {} if cuda else {"trainstream": {"device": "cpu", "param_offload": True}}
        trainer = TrainstreamTrainer(model=model, args=training, train_dataset=data, callbacks=[Timer()], **options)
    else:
        trainer = transformers.Trainer(model=model, args=training, train_dataset=data, callbacks=[Timer()])
    result["setup_s"] = time.perf_counter() - started
    started = time.perf_counter()
    trainer.train()
    result.update(train_s=time.perf_counter() - started, step_s=statistics.median(times[args.warmup:] or times),
                  step_times_s=times, losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
                  host_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB)
    if mode == "trainstream":
        import trainstream
        rank = trainstream._wrap._rank_of(model)
        result.update(paged_blocks=len(rank.paging.blocks) if rank.paging else 0, transport=rank.transport.name,
                      daemon_host_gib=trainstream.connect().stats()["host_bytes"] / GIB)
        trainstream.unwrap(model)
    if cuda:
        result.update(torch_peak_gib=torch.cuda.max_memory_allocated() / GIB, process_gpu_gib=process_gpu_gib())
    return result


def mode_timeouts(text: str, parser) -> dict[str, float]:
    """--mode-timeout's seconds by mode ("" for the modes it does not name)."""
    timeouts = {"": 600.0}
    for item in filter(None, text.split(",")):
        mode, _, seconds = item.rpartition("=")
        try:
            timeouts[mode] = float(seconds)
        except ValueError:
            parser.error(f"--mode-timeout {text!r}: {item!r} is not N or MODE=N with N seconds")
        if mode and mode not in MODES:
            parser.error(f"--mode-timeout {text!r}: unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    return timeouts


def skip_reason(mode: str) -> str | None:
    """Why `mode` cannot run on this machine, if it cannot (decided without starting it)."""
    if mode != "deepspeed-zero3":
        return None
    if not torch.cuda.is_available():
        return "deepspeed-zero3 needs CUDA"
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable (scripts/device_run.sh's wheels stage installs it)"
    return None


def run_child(mode: str, args, timeout_s: float) -> dict:
    """`mode` in a subprocess of its own, within `timeout_s` seconds; its result, or its error."""
    if reason := skip_reason(mode):
        return {"skipped": reason}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    command = [sys.executable, os.path.abspath(__file__), "--run-mode", mode, "--mode-out", out,
               "--shape", args.shape, "--vram-cap-gib", str(args.vram_cap_gib), "--batch", str(args.batch),
               "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # its own group: a timeout ends its helpers too
    try:
        log, _ = process.communicate(timeout=timeout_s)
        error = None if process.returncode == 0 else f"exited {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log, _ = process.communicate()
        error = f"timed out after {timeout_s:g} s"
    except BaseException:  # this run stopped (SIGTERM from an outer timeout, ^C): the mode's group with it
        os.killpg(process.pid, signal.SIGKILL)
        raise
    result = {"wall_s": time.perf_counter() - started}
    with contextlib.suppress(OSError, ValueError):
        with open(out) as f:
            result.update(json.load(f))
    os.unlink(out)
    if error:
        lines = [line for line in (log or "").splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "Error" in line or "error" in line), "")
        result.update(error=f"{error}: {reason}".rstrip(": "), log_tail=lines[-15:])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="14b", choices=sorted(SHAPES))
    parser.add_argument("--vram-cap-gib", type=float, default=8)
    parser.add_argument("--modes", default="trainstream,gpu-only,accelerate",
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--mode-timeout", default="600",
                        help="seconds each mode may take: N for all, MODE=N for one (comma-separated: 150,gpu-only=90)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="measured steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--run-mode", choices=MODES, help=argparse.SUPPRESS)  # a child's mode
    parser.add_argument("--mode-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_mode:
        result = run_mode(args.run_mode, args)
        with open(args.mode_out, "w") as f:
            json.dump(result, f)
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes {args.modes!r}: unknown {unknown}; allowed: {', '.join(MODES)}")
    timeouts = mode_timeouts(args.mode_timeout, parser)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_child ends the running mode's group
    results = {mode: run_child(mode, args, timeouts.get(mode, timeouts[""])) for mode in modes}
    base = base_bytes_of(args.shape)
    report = {"shape": args.shape, "base_bytes": base, "base_gib": base / GIB, "batch": args.batch, "seq": args.seq,
              "vram_cap_gib": args.vram_cap_gib, "warmup": args.warmup, "steps": args.steps, "modes": results}
    if torch.cuda.is_available():  # after the children: this process holds no GPU memory while they run
        h2d = pinned_h2d_gbs()
        report.update(gpu=torch.cuda.get_device_name(0), pinned_h2d_gbs=h2d, paging_bound_s=2 * base / (h2d * 1e9))
        gpu_only = results.get("gpu-only", {}).get("step_s")
        report["gpu_only_step_s"] = gpu_only
        report["bound_s"] = max(gpu_only or 0.0, report["paging_bound_s"])
        for result in results.values():
            if result.get("step_s"):
                result["vs_bound"] = result["step_s"] / report["bound_s"]
    print(json.dumps(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
