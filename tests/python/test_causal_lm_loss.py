"""TrainstreamTrainer's causal-LM loss without the logits (chunked_cross_entropy from the last hidden state
and the output projection) against the stock transformers.Trainer's loss, on tiny models built from
configs (CPU, real daemons): untied and tied projections, a projection with a bias, labels with ignored
positions, gradient accumulation (the Trainer's num_items_in_batch); the full logits never exist. Models it
does not recognise keep their own loss, with one log line. Also the documented import and keyword:
`trainstream.integrations.huggingface.TrainStreamTrainer`, `trainstream={...}`."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainstream  # noqa: E402
from trainstream import TrainstreamError  # noqa: E402
from trainstream.hf import TrainstreamTrainer  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402

VOCAB, SEQ = 96, 24
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=False)
    elif kind == "qwen2-tied":
        config = transformers.Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)
    elif kind == "phi-bias":
        config = transformers.PhiConfig(**SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    elif kind == "gemma2":  # soft-caps its logits between the projection and the loss
        config = transformers.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8)
    return transformers.AutoModelForCausalLM.from_config(config)


def dataset():
    g = torch.Generator().manual_seed(1)
    rows = []
    for tokens in torch.randint(0, VOCAB, (32, SEQ), generator=g):
        labels = tokens.clone()
        labels[: int(torch.randint(0, 6, (), generator=g))] = -100  # a prompt that does not count
        rows.append({"input_ids": tokens, "labels": labels})
    return rows


class Recording:
    """Keeps every training loss compute_loss returns, and the width of the projection's outputs."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(loss.item())
        return loss


class Stock(Recording, transformers.Trainer):
    pass


class Ours(Recording, TrainstreamTrainer):
    pass


def train(trainer_class, kind, out, **options):
    model = tiny(kind)
    widths = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, output: widths.append(output.shape[-1]))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, max_grad_norm=1.0, weight_decay=0.01, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, save_strategy="no")
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), **options)
    trainer.losses = []
    trainer.train()
    if trainer_class is not Stock:
        trainstream.unwrap(model)
    return trainer.losses, [p.detach().clone() for p in model.parameters()], widths


def assert_same_training(ours, stock, params_tolerance=2e-5):
    assert len(ours[0]) == len(stock[0]) == 12
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(stock[0]), rtol=1e-5, atol=0)
    assert max((a - b).abs().max().item() for a, b in zip(ours[1], stock[1])) <= params_tolerance


@pytest.mark.parametrize("kind", ["llama", "qwen2-tied", "phi-bias"])
def test_chunked_loss_matches_the_stock_trainers_loss_without_logits(client, tmp_path, kind):
    stock = train(Stock, kind, tmp_path / "stock")
    ours = train(Ours, kind, tmp_path / "ours", trainstream={"client": client}, loss_chunk_size=16)
    assert_same_training(ours, stock)
    assert set(stock[2]) == {VOCAB} and set(ours[2]) == {0}  # the full logits never existed


def test_models_it_does_not_recognise_keep_their_own_loss(client, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainstream")
    stock = train(Stock, "gemma2", tmp_path / "stock")
    ours = train(Ours, "gemma2", tmp_path / "ours", trainstream={"client": client})
    assert_same_training(ours, stock, params_tolerance=1e-6)
    assert set(ours[2]) == {VOCAB}
    notes = [r.getMessage() for r in caplog.records if "the model's own loss" in r.getMessage()]
    assert len(notes) == 1 and "model type 'gemma2'" in notes[0]


def test_the_documented_import_and_keyword_with_offload_auto(client, tmp_path, memory_budget):
    memory_budget(1 << 20)
    assert TrainStreamTrainer is TrainstreamTrainer
    stock = train(Stock, "llama", tmp_path / "stock")
    ours = train(type("Documented", (Recording, TrainStreamTrainer), {}), "llama", tmp_path / "ours",
                 trainstream={"client": client, "offload": "auto"})
    assert_same_training(ours, stock)
    assert client.stats()["jobs"] == []  # offload="auto" switched to stock AdamW inside the Trainer


def test_both_option_keywords_at_once_are_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(TrainstreamError, match="not both"):
        TrainstreamTrainer(model=tiny("llama"), args=args, trainstream={}, trainstream_options={})
