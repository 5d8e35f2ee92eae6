"""A Hugging Face Trainer whose AdamW runs in trainstreamd (needs `pip install transformers accelerate`):

    python3 examples/hf_trainer.py            # CPU or the first GPU; a private daemon if none runs

A small GPT-2 built from its config (no download) learns random token sequences. Everything the
Trainer does stays: parameter groups, warm-up + linear LR schedule, clipping (max_grad_norm),
gradient accumulation, checkpoints in torch.optim.AdamW's format. The loss is computed in chunks from
the last hidden state (the full logits never exist); `trainstream={...}` passes wrap()'s options. The
Trainer's own progress bar shows steps/s; its logs (printed under the bar every `logging_steps`) get
this process's memory beside the loss.
"""

import os
import tempfile

import torch
import transformers

from trainstream.integrations.huggingface import TrainStreamTrainer


class MemoryInLogs(transformers.TrainerCallback):
    """Adds the memory in use (GPU allocated bytes on CUDA, else the resident set) to every log entry;
    it runs before the Trainer's progress callback prints the entry."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        if torch.cuda.is_available() and not args.use_cpu:
            logs["mem_mib"] = round(torch.cuda.memory_allocated() / 2**20)
        else:
            logs["mem_mib"] = round(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                                    / 2**20)


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=512, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 512, (256, 64), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=30, per_device_train_batch_size=8, gradient_accumulation_steps=2,
            learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0,
            logging_steps=10, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available())
        trainer = TrainStreamTrainer(model=model, args=args, train_dataset=dataset, callbacks=[MemoryInLogs()],
                                     trainstream={"moment_dtype": "bfloat16"})
        result = trainer.train()
    print(f"done: final training loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main()
