"""A full fine-tune of a Hugging Face causal LM through TrainstreamTrainer, optionally side by side with
the stock Trainer: AdamW runs in trainstreamd, the loss is computed in chunks (the logits of a 152k
vocabulary never exist whole), and a model given on the CPU has its decoder layers paged.

    python3 examples/hf_finetune.py --shape 1.5b --cap-gib 24 --compare-stock --json out.json
    python3 examples/hf_finetune.py --shape tiny --cpu                      # runs anywhere
    python3 examples/hf_finetune.py --shape 7b --paged --cap-gib 24 --moment-dtype bfloat16 --gradient-checkpointing

With --compare-stock the stock Trainer runs first under the cap (where it runs out of memory, the error is
recorded), then uncapped. --json writes each run's median step after the first two, its losses, gradient
norms and torch peak, and for trainstream how many steps the daemon updated before the norm was known
(speculated) and how many of those it redid (clipped). --host-gbs (the host's memory bandwidth, e.g. the
triad of benchmarks/adamw) adds the host update bound: the bytes the update moves per parameter over it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import transformers

import trainstream
from trainstream.hf import TrainstreamTrainer

GIB = 1 << 30
JOB = f"hf-finetune-{os.getpid()}"  # its counters in the daemon's stats
SHAPES = {"tiny": (64, 128, 2, 4, 2, 512), "1.5b": (1536, 8960, 28, 12, 2, 151936), "7b": (3584, 18944, 28, 28, 4,
                                                                                            152064)}


def model_of(shape: str, on_gpu: bool, init_on_gpu: bool):
    """The model with random weights, initialized on the GPU if `init_on_gpu` (the 1.5B's initialization
    takes about a minute on the CPU), then placed on the GPU, or on the CPU for paging. Runs that
    initialize alike start from the same weights."""
    hidden, intermediate, layers, heads, kv, vocab = SHAPES[shape]
    config = transformers.Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab)
    torch.manual_seed(0)
    with torch.device("cuda" if init_on_gpu else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.cuda() if on_gpu else model.cpu()


class Progress(transformers.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None
            memory = f", GPU peak {peak:.2f} GiB" if peak is not None else ""
            print(f"step {state.global_step}: loss {logs['loss']:.4f}{memory}", flush=True)


class StepTimer(transformers.TrainerCallback):
    def __init__(self):
        self.times: list[float] = []

    def on_step_begin(self, *a, **k):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.started = time.perf_counter()

    def on_step_end(self, *a, **k):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.started)


class Profile(transformers.TrainerCallback):
    """A torch.profiler timeline of the run's last two steps (which it slows) into `path`, for
    chrome://tracing or Perfetto."""

    def __init__(self, path: str, steps: int):
        self.path, self.first = path, max(0, steps - 2)
        self.profiler = torch.profiler.profile(with_stack=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.first:
            self.profiler.start()

    def on_train_end(self, *a, **k):
        self.profiler.stop()
        self.profiler.export_chrome_trace(self.path)


def cap_gpu(cap_gib: float) -> None:
    """Caps this process's torch allocations at `cap_gib` (0: the whole GPU)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total) if cap_gib else 1.0)


def run(trainer_class, args, data, on_gpu: bool, callbacks=(), **options) -> dict:
    """One training run: its median step after the first two, its losses and its torch peak."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    training = transformers.TrainingArguments(
        output_dir="/tmp/hf-finetune", max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-5, bf16=not args.cpu, max_grad_norm=1.0, report_to=[], save_strategy="no",
        logging_steps=1, use_cpu=args.cpu, disable_tqdm=False, gradient_checkpointing=args.gradient_checkpointing)
    gpu = torch.cuda.is_available() and not args.cpu
    model = model_of(args.shape, on_gpu, init_on_gpu=gpu and (args.init_on_gpu or not args.paged))
    timer = StepTimer()
    trainer = trainer_class(model=model, args=training, train_dataset=data, callbacks=[Progress(), timer, *callbacks],
                            **options)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    result = {"step_s": statistics.median(timer.times[2:] or timer.times), "step_times_s": timer.times,
              "losses": [h["loss"] for h in logged], "grad_norms": [h.get("grad_norm") for h in logged],
              "params": sum(p.numel() for p in model.parameters())}
    if torch.cuda.is_available():
        result["torch_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    if trainer_class is TrainstreamTrainer:
        trainstream.synchronize(model)
        for job in (j for j in trainstream.connect().stats()["jobs"] if j["name"] == JOB):
            result["clipping"] = {k: job[k] for k in ("completed_step", "speculative_steps", "redone_steps")}
            result["job_host_gib"] = job["host_bytes"] / GIB
        if not args.paged:  # unwrap() would copy the paged weights and the optimizer state into this process
            trainstream.unwrap(model)
    return result


def host_update_bytes_per_param(weight_bytes: int, moment_bytes: int = 4) -> int:
    """Gradient read, fp32 master weights read and written, both moments read and written, and for
    16-bit weights their upload copy written."""
    return weight_bytes + 8 + 4 * moment_bytes + (weight_bytes if weight_bytes < 4 else 0)


def run_stock_capped(args, data) -> dict:
    """The stock Trainer under the cap: its result, or the out-of-memory error it stopped with."""
    cap_gpu(args.cap_gib)
    try:
        return run(transformers.Trainer, args, data, True)
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"out of memory under {args.cap_gib:g} GiB: {str(e).splitlines()[0]}"}
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        cap_gpu(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cap-gib", type=float, default=0, help="GPU memory cap for trainstream's run")
    parser.add_argument("--paged", action="store_true", help="build the model on the CPU: its layers are paged")
    parser.add_argument("--init-on-gpu", action="store_true",
                        help="with --paged: initialize the weights on the GPU (faster, where they fit), then move them")
    parser.add_argument("--moment-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compare-stock", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--profile", help="a torch.profiler timeline of trainstream's last two steps into this file")
    parser.add_argument("--host-gbs", type=float, default=0, help="host memory bandwidth for the update bound")
    parser.add_argument("--json", help="write the runs' results here")
    args = parser.parse_args()
    vocab = SHAPES[args.shape][5]
    tokens = torch.randint(0, vocab, (args.batch * args.steps, args.seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    on_gpu = not args.cpu
    report = {"shape": args.shape, "batch": args.batch, "seq": args.seq, "steps": args.steps, "cap_gib": args.cap_gib}
    if args.compare_stock:
        if args.cap_gib and on_gpu:
            capped = report["stock_capped"] = run_stock_capped(args, data)
            print("stock Trainer under the cap:", capped.get("error") or f"{capped['step_s']:.3f} s/step")
        report["stock"] = run(transformers.Trainer, args, data, on_gpu)
        print(f"stock Trainer: {report['stock']['step_s']:.3f} s/step")
    if args.cap_gib and on_gpu:
        gc.collect()
        torch.cuda.empty_cache()  # the stock runs' cached blocks would otherwise count against the cap
        cap_gpu(args.cap_gib)
    paging = {"device": "cpu", "param_offload": True} if args.cpu and args.paged else {}
    profile = [Profile(args.profile, args.steps)] if args.profile else []
    ours = report["trainstream"] = run(TrainstreamTrainer, args, data, on_gpu and not args.paged, profile,
                                       trainstream={"job": JOB, "moment_dtype": args.moment_dtype, **paging})
    print(f"trainstream: {ours['step_s']:.3f} s/step" + (f" under a {args.cap_gib:g} GiB cap" if args.cap_gib else ""))
    if args.host_gbs:  # bf16 weights (model_of)
        moment_bytes = 2 if args.moment_dtype == "bfloat16" else 4
        per_param = host_update_bytes_per_param(weight_bytes=2, moment_bytes=moment_bytes)
        bound = report["host_update_bound_s"] = ours["params"] * per_param / (args.host_gbs * 1e9)
        report["trainstream_vs_host_bound"] = ours["step_s"] / bound
        print(f"host update bound {bound:.3f} s ({per_param} B/param at {args.host_gbs:g} GB/s): "
              f"trainstream takes {report['trainstream_vs_host_bound']:.2f}x")
    if args.compare_stock:
        pairs = zip(report["trainstream"]["losses"], report["stock"]["losses"])
        report["max_loss_difference"] = max(abs(a - b) for a, b in pairs)
        print(f"largest loss difference from the stock Trainer: {report['max_loss_difference']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
