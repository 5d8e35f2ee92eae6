"""The one line in frameworks' own training loops: accelerate's (accumulate(), clip_grad_norm_ through the
Accelerator), Lightning's Trainer (gradient_clip_val, accumulate_grad_batches), TRL's SFTTrainer and
DPOTrainer (any transformers.Trainer subclass through trainstream.hf.trainstream_trainer). Each against the
same run without trainstream: CPU, fp32, tiny models built from configs, 20 steps, clipping active."""

from __future__ import annotations

import copy

import pytest
import torch

import trainstream

TOLERANCE = 1e-6


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(16, 64)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x)))


def batches(count: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 16, generator=g) * 3, torch.randn(8, 4, generator=g) * 3) for _ in range(count)]


# ----- accelerate -----

def accelerate_loop(model, optimizer, wrap_after_prepare: bool, client, scheduler_first: bool):
    """accelerate's documented accumulation loop: accumulate(), accelerator.backward, clip_grad_norm_ where
    the gradients sync, step and zero_grad (which the AcceleratedOptimizer skips between syncs)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=10) if scheduler_first else None
    if client is not None and not wrap_after_prepare:
        model, optimizer = trainstream.wrap(model, optimizer, client=client)
    model, optimizer = accelerator.prepare(model, optimizer)
    if client is not None and wrap_after_prepare:
        model, optimizer = trainstream.wrap(model, optimizer, client=client)
    norms = []
    for x, y in batches(40):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            if scheduler is not None and accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
    if client is not None:
        trainstream.synchronize(model)
    return norms


@pytest.mark.parametrize("wrap_after_prepare", [False, True], ids=["wrap-then-prepare", "prepare-then-wrap"])
def test_accelerate(client, wrap_after_prepare, recwarn):
    torch.manual_seed(0)
    plain = MLP()
    wrapped = copy.deepcopy(plain)
    norms = accelerate_loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False), False, None, True)
    norms_wrapped = accelerate_loop(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), wrap_after_prepare,
                                    client, True)
    assert len(norms) == 20 and all(n > 0.5 for n in norms)
    assert norms_wrapped == pytest.approx(norms, rel=1e-6)
    assert max_difference(plain, wrapped) < TOLERANCE
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


# ----- Lightning -----

def lightning_run(client, wrap: bool):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = MLP()
            self.norms = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=False)
            if wrap:
                _, optimizer = trainstream.wrap(self, optimizer, client=client)  # the one line
            return optimizer

    module = Module()
    trainer = L.Trainer(max_steps=20, accumulate_grad_batches=2, gradient_clip_val=0.5, accelerator="cpu",
                        devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(batches(40), batch_size=None)
    trainer.fit(module, loader)
    if wrap:
        trainstream.synchronize(module)
    return module.net


def test_lightning(client):
    plain = lightning_run(None, False)
    wrapped = lightning_run(client, True)
    assert max_difference(plain, wrapped) < TOLERANCE


# ----- TRL (any transformers.Trainer subclass) -----

def tiny_tokenizer():
    """A word-level tokenizer built here (no download): the words of the texts below and the specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = "the a cat dog sat ran on mat log fast slow big small red blue is was".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config)


def sentences(count: int, seed: int) -> list[str]:
    import random
    rng = random.Random(seed)
    subjects, verbs, objects = ["the cat", "a dog", "the big dog"], ["sat on", "ran on"], ["the mat", "a log"]
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(['fast', 'slow'])}"
            for _ in range(count)]


def trl_config(config_class, tmp_path, **extra):
    """A fine-tuning learning rate: at 1e-2 this model's training is chaotic (torch's own for-loop and fused
    AdamW end 1.8e-4 apart after 8 steps), at 3e-4 they agree within 4e-9."""
    return config_class(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=2,
                        gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-4, logging_steps=1,
                        report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
                        optim="adamw_torch", **extra)


def trl_run(trainer_class, make_config, make_dataset, tmp_path, client, wrap: bool):
    import trl
    tokenizer = tiny_tokenizer()
    model = tiny_llama(tokenizer)
    kwargs = {"ref_model": tiny_llama(tokenizer)} if issubclass(trainer_class, trl.DPOTrainer) else {}
    if wrap:
        from trainstream.hf import trainstream_trainer
        trainer_class = trainstream_trainer(trainer_class)
        extra = {"trainstream": {"client": client}}
    else:
        extra = {}
    trainer = trainer_class(model=model, args=make_config(tmp_path / ("ts" if wrap else "plain")),
                            train_dataset=make_dataset(), processing_class=tokenizer, **kwargs, **extra)
    trainer.train()
    if wrap:
        trainstream.synchronize(model)
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    return model, norms


def sft_dataset():
    from datasets import Dataset
    return Dataset.from_dict({"text": sentences(80, 1)})


def dpo_dataset():
    from datasets import Dataset
    good, bad = sentences(80, 2), sentences(80, 3)
    return Dataset.from_dict({"prompt": ["the cat"] * 80, "chosen": good, "rejected": bad})


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl(client, tmp_path, kind):
    import trl
    if kind == "sft":
        trainer_class, dataset = trl.SFTTrainer, sft_dataset

        def make_config(path):
            return trl_config(trl.SFTConfig, path, max_length=16, packing=False)
    else:
        trainer_class, dataset = trl.DPOTrainer, dpo_dataset

        def make_config(path):
            return trl_config(trl.DPOConfig, path, max_length=24)
    plain, norms = trl_run(trainer_class, make_config, dataset, tmp_path, client, False)
    wrapped, norms_wrapped = trl_run(trainer_class, make_config, dataset, tmp_path, client, True)
    assert len(norms) == 20 and sum(n > 0.5 for n in norms) >= 10  # clipping changed most updates
    assert norms_wrapped == pytest.approx(norms, rel=1e-5)
    assert max_difference(plain, wrapped) < TOLERANCE


def test_trainstream_trainer_takes_a_trainer_class_only():
    from trainstream.hf import trainstream_trainer
    with pytest.raises(trainstream.TrainstreamError, match="transformers.Trainer subclass"):
        trainstream_trainer(torch.nn.Module)

