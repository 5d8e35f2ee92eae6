"""trainstream.hf.TrainstreamTrainer against transformers.Trainer with its own AdamW: the same run,
with the Trainer's parameter groups, warm-up + linear schedule, clipping and accumulation, and a
checkpoint resumed by a new trainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainstream  # noqa: E402
from trainstream.hf import TrainstreamTrainer  # noqa: E402


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def dataset():
    tokens = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


def train(trainer_class, out, client=None, max_steps=10, resume=None, chunked_loss=False, **extra):
    """Trains tiny_gpt2; chunked_loss is off here: these tests compare the optimizers (the chunked loss
    is test_causal_lm_loss.py's)."""
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
        gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=3, lr_scheduler_type="linear",
        weight_decay=0.01, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, **extra)
    options = {"trainstream_options": {"client": client}, "chunked_loss": chunked_loss} \
        if trainer_class is TrainstreamTrainer else {}
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), **options)
    trainer.train(resume_from_checkpoint=resume)
    if trainer_class is TrainstreamTrainer:
        trainstream.unwrap(model)  # waits for the last update
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_matches_the_plain_trainer(client, tmp_path):
    reference = train(transformers.Trainer, tmp_path / "ref", save_strategy="no")
    ours = train(TrainstreamTrainer, tmp_path / "ours", client, save_strategy="no")
    assert max_diff(ours, reference) <= 1e-6


def test_resumes_from_a_checkpoint(client, tmp_path):
    whole = train(TrainstreamTrainer, tmp_path / "whole", client, max_steps=8, save_strategy="no")
    train(TrainstreamTrainer, tmp_path / "first", client, max_steps=8, save_strategy="steps", save_steps=4)
    resumed = train(TrainstreamTrainer, tmp_path / "again", client, max_steps=8, save_strategy="no",
                    resume=str(tmp_path / "first" / "checkpoint-4"))
    assert max_diff(resumed, whole) <= 1e-6


def test_options_owned_by_the_training_arguments_are_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(trainstream.TrainstreamError, match="come from TrainingArguments"):
        TrainstreamTrainer(model=tiny_gpt2(), args=args, trainstream_options={"max_grad_norm": 1.0})


def test_train_twice_on_one_trainer(client, tmp_path):
    """After the first train(), accelerate has wrapped the offloaded optimizer; the second reuses it."""
    model = tiny_gpt2()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = TrainstreamTrainer(model=model, args=args, train_dataset=dataset(),
                                 trainstream_options={"client": client})
    trainer.train()
    trainer.train()
    trainstream.unwrap(model)
