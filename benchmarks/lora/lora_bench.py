"""LoRA r=16 on a Qwen2.5-shaped base bigger than a VRAM cap, through TrainstreamTrainer, with the base's
decoder layers paged from host memory. The base is built from its configuration with random weights
(no download), in bf16, on the CPU; gradient checkpointing; batch 4 x 512.

References printed beside it: the paging bound (2 x the paged base bytes over the pinned host-to-device
bandwidth measured in this run) and, where it fits (small shapes), the stock Trainer on the GPU.

    python3 benchmarks/lora/lora_bench.py --shape 14b --vram-cap-gib 8 --json out.json
    python3 benchmarks/lora/lora_bench.py --shape tiny --steps 3       # a smoke run (CPU or GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

GIB = 1 << 30
SHAPES = {  # Qwen2.5 configurations (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (64, 128, 4, 4, 2, 512),
    "1.5b": (1536, 8960, 28, 12, 2, 151936),
    "7b": (3584, 18944, 28, 28, 4, 152064),
    "14b": (5120, 13824, 48, 40, 8, 152064),
    "32b": (5120, 27648, 64, 40, 8, 152064),
}


def build(shape: str):
    import peft
    import transformers
    hidden, intermediate, layers, heads, kv, vocab = SHAPES[shape]
    config = transformers.Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(model, lora)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="14b", choices=sorted(SHAPES))
    parser.add_argument("--vram-cap-gib", type=float, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    import transformers

    import trainstream
    from trainstream.hf import TrainstreamTrainer

    cuda = torch.cuda.is_available()
    if cuda and args.vram_cap_gib:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.vram_cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory))
    started = time.perf_counter()
    model = build(args.shape)
    built_s = time.perf_counter() - started
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    vocab = SHAPES[args.shape][5]
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t}
            for t in torch.randint(0, vocab, (args.batch * (args.steps + 2), args.seq), generator=g)]

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

    training = transformers.TrainingArguments(
        output_dir="/tmp/lora-bench", max_steps=args.steps + 2, per_device_train_batch_size=args.batch,
        learning_rate=1e-4, bf16=cuda, gradient_checkpointing=True, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, use_cpu=not cuda)
    options = {} if cuda else {"trainstream": {"device": "cpu", "param_offload": True}}
    trainer = TrainstreamTrainer(model=model, args=training, train_dataset=data, callbacks=[Timer()], **options)
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    stats = trainstream.connect().stats()
    rank = trainstream._wrap._rank_of(model)
    result = {"shape": args.shape, "params": sum(p.numel() for p in model.parameters()), "adapters": adapters,
              "base_gib": base_bytes / GIB, "batch": args.batch, "seq": args.seq, "vram_cap_gib": args.vram_cap_gib,
              "build_seconds": built_s, "train_seconds": train_s, "step_s": statistics.median(times[2:] or times),
              "step_times_s": times, "paged_blocks": len(rank.paging.blocks) if rank.paging else 0,
              "transport": rank.transport.name, "daemon_host_gib": stats["host_bytes"] / GIB,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if cuda:
        result.update(torch_peak_gib=torch.cuda.max_memory_allocated() / GIB, trainer_process_gib=process_gpu_gib(),
                      gpu=torch.cuda.get_device_name(0))
        h2d = pinned_h2d_gbs()
        result["pinned_h2d_gbs"] = h2d
        result["paging_bound_s"] = 2 * base_bytes / (h2d * 1e9)
        result["vs_paging_bound"] = result["step_s"] / result["paging_bound_s"]
    trainstream.unwrap(model)
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
