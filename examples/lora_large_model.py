"""LoRA r=16 on a base bigger than the GPU, through TrainstreamTrainer: the base's decoder layers stay in
host memory (once, in bf16, with no optimizer state) and come to the GPU a few at a time.

    python3 examples/lora_large_model.py --shape 14b --cap-gib 8          # a Qwen2.5-14B-shaped base
    python3 examples/lora_large_model.py --shape 7b --compare-stock       # and the stock Trainer beside it

The base is built from its configuration with random weights (no download); pass --from-pretrained DIR
to load a checkpoint from disk instead (it is loaded on the CPU and never held twice in host RAM).
"""

from __future__ import annotations

import argparse
import time

import peft
import torch
import transformers

import trainstream
from trainstream.hf import TrainstreamTrainer

GIB = 1 << 30
SHAPES = {"1.5b": (1536, 8960, 28, 12, 2), "7b": (3584, 18944, 28, 28, 4), "14b": (5120, 13824, 48, 40, 8),
          "32b": (5120, 27648, 64, 40, 8)}


def base(args):
    if args.from_pretrained:
        return transformers.AutoModelForCausalLM.from_pretrained(args.from_pretrained, dtype=torch.bfloat16)
    hidden, intermediate, layers, heads, kv = SHAPES[args.shape]
    config = transformers.Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=152064,
                                      tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def lora(args):
    return peft.get_peft_model(base(args), peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]))


class Progress(transformers.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step}: loss {logs['loss']:.3f}, GPU peak "
                  f"{torch.cuda.max_memory_allocated() / GIB:.2f} GiB", flush=True)


def train(trainer_class, args, data):
    model = lora(args)
    training = transformers.TrainingArguments(
        output_dir="/tmp/lora-example", max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-4, bf16=True, gradient_checkpointing=True, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=False)
    trainer = trainer_class(model=model, args=training, train_dataset=data, callbacks=[Progress()])
    start = time.perf_counter()
    trainer.train()
    return model, (time.perf_counter() - start) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="14b", choices=sorted(SHAPES))
    parser.add_argument("--from-pretrained", help="a local checkpoint directory instead of random weights")
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compare-stock", action="store_true", help="also train with the stock Trainer (uncapped)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU")
    tokens = torch.randint(0, 152064, (args.batch * args.steps, args.seq))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    if args.compare_stock:
        _, stock = train(transformers.Trainer, args, data)
        print(f"stock Trainer: {stock:.2f} s/step, GPU peak {torch.cuda.max_memory_allocated() / GIB:.2f} GiB")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    model, ours = train(TrainstreamTrainer, args, data)
    stats = trainstream.connect().stats()
    print(f"trainstream: {ours:.2f} s/step under a {args.cap_gib:g} GiB cap, GPU peak "
          f"{torch.cuda.max_memory_allocated() / GIB:.2f} GiB; host: the daemon holds {stats['host_bytes'] / GIB:.1f} "
          "GiB (the base once in bf16, the adapters' master weights and moments)")
    trainstream.unwrap(model)


if __name__ == "__main__":
    main()
