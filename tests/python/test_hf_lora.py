"""LoRA (peft) on a frozen base through TrainstreamTrainer with the base's decoder layers paged, against
the stock Trainer on the same small model: losses, adapter weights, a base that never changes and never
gets optimizer state, checkpoints that resume with or without trainstream, and a base loaded with
from_pretrained from a checkpoint on disk. CPU: the paging runs with CPU slots (device="cpu"); the GPU
machine runs the same through the GPU (and the benchmarks at 14B/32B shapes)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import trainstream  # noqa: E402
from trainstream.hf import TrainstreamTrainer  # noqa: E402
from trainstream.paging import blocks as _blocks  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def base(path=None):
    torch.manual_seed(0)
    if path is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**CONFIG), dtype=torch.float32)


def lora(path=None):
    model = peft.get_peft_model(base(path), peft.LoraConfig(**LORA))
    torch.manual_seed(1)
    for name, p in model.named_parameters():  # lora_B starts at zero: give the adapters something to learn
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def dataset():
    tokens = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


class Losses(transformers.TrainerCallback):
    def __init__(self):
        self.values = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.values.append(logs["loss"])


def train(trainer_class, out, client=None, model=None, max_steps=20, resume=None, **extra):
    model = model if model is not None else lora()
    extra.setdefault("save_strategy", "no")
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
        max_grad_norm=1.0, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1, **extra)
    options = {"trainstream": {"client": client, "device": "cpu", "param_offload": True}} \
        if trainer_class is TrainstreamTrainer else {}
    losses = Losses()
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), callbacks=[losses], **options)
    trainer.train(resume_from_checkpoint=resume)
    if trainer_class is TrainstreamTrainer:
        trainstream.unwrap(model)
    return losses.values, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_decoder_layers_page_and_the_rest_stays():
    model = lora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = _blocks.plan_paging(model, trainable, True)
    layers = model.base_model.model.model.layers
    assert [b.module for b in plan.blocks] == list(layers)
    paged = plan.paged_ids
    assert all(id(p) in paged for p in layers.parameters())
    resident = [n for n, p in model.named_parameters() if id(p) not in paged]
    assert resident == ["base_model.model.model.embed_tokens.weight", "base_model.model.model.norm.weight",
                        "base_model.model.lm_head.weight"]
    # the base's weights are frozen: once in host memory in their dtype; only the adapters are trained
    assert {id(p) for _, p in plan.frozen} == {id(p) for p in layers.parameters() if not p.requires_grad}
    assert all("lora_" in n for n, p in model.named_parameters() if id(p) in plan.partition)
    assert _blocks.host_bytes_per_parameter(torch.bfloat16, torch.float32, trainable=False) == 2


def test_lora_through_trainstream_matches_the_stock_trainer(client, tmp_path):
    stock_losses, stock = train(transformers.Trainer, tmp_path / "stock")
    model = lora()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ours_losses, ours = train(TrainstreamTrainer, tmp_path / "ours", client, model=model)
    assert len(ours_losses) == len(stock_losses) == 20
    assert max(abs(a - b) for a, b in zip(ours_losses, stock_losses)) <= 1e-5
    for name, value in stock.items():
        if "lora_" in name:
            torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-5)
        else:  # the base never changes
            assert torch.equal(ours[name], base_before[name]), name


def test_the_base_gets_no_optimizer_state(client, tmp_path):
    model = lora()
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_bytes = sum(p.numel() * p.element_size() for b in model.base_model.model.model.layers
                       for p in b.parameters() if not p.requires_grad)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = TrainstreamTrainer(model=model, args=args, train_dataset=dataset(),
                                 trainstream={"client": client, "device": "cpu", "param_offload": True,
                                              "job": "lora-state"})
    trainer.train()
    job = next(j for j in client.stats()["jobs"] if j["name"] == "lora-state")
    assert job["elements"] < adapters + 64 * len(trainer.optimizer.state_dict()["param_groups"][0]["params"]) * 4
    assert job["state_bytes"] >= frozen_bytes  # the base, once, in its dtype
    trainstream.unwrap(model)


@pytest.mark.parametrize("resume_with", ["trainstream", "stock"])
def test_a_lora_checkpoint_resumes_with_or_without_trainstream(client, tmp_path, resume_with):
    _, whole = train(TrainstreamTrainer, tmp_path / "whole", client, max_steps=8)
    train(TrainstreamTrainer, tmp_path / "first", client, max_steps=8, save_strategy="steps", save_steps=4)
    trainer_class = TrainstreamTrainer if resume_with == "trainstream" else transformers.Trainer
    _, resumed = train(trainer_class, tmp_path / "again", client, max_steps=8,
                       resume=str(tmp_path / "first" / "checkpoint-4"))
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-5)


def test_a_base_loaded_from_disk_pages_without_a_second_copy(client, tmp_path):
    base().save_pretrained(tmp_path / "base")  # no hub here: a checkpoint on local disk
    model = lora(tmp_path / "base")
    reference = lora()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if "lora_" not in n:
            assert torch.equal(p, q), n  # the base's weights, loaded
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = TrainstreamTrainer(model=model, args=args, train_dataset=dataset(),
                                 trainstream={"client": client, "device": "cpu", "param_offload": True})
    trainer.train()
    layers = model.base_model.model.model.layers
    # every paged weight is a placeholder of one element or a view into a GPU/CPU slot of the pool:
    # none keeps the memory it was loaded into
    rank = trainstream._wrap._rank_of(model)
    pool = rank.pager.pool.untyped_storage().data_ptr()
    for p in layers.parameters():
        storage = p.untyped_storage()
        assert storage.nbytes() == p.element_size() or storage.data_ptr() == pool
    trainstream.unwrap(model)


def test_a_bf16_full_fine_tune_pages_fp32_linears_in_bf16_with_the_same_results(client, tmp_path):
    """bf16=True: the Trainer's forward runs under bf16 autocast, which casts the float32 Linear weights to
    bf16 anyway; TrainstreamTrainer pages them so, and trains exactly as with them paged in float32."""
    def run(options):
        model = base()
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                              learning_rate=1e-3, max_grad_norm=1.0, report_to=[], use_cpu=True,
                                              bf16=True, seed=0, disable_tqdm=True, logging_steps=1,
                                              save_strategy="no")
        losses = Losses()
        trainer = TrainstreamTrainer(model=model, args=args, train_dataset=dataset(), callbacks=[losses],
                                     trainstream={"client": client, "device": "cpu", "param_offload": True, **options})
        trainer.create_optimizer()
        layer = model.model.layers[0]
        dtypes = (layer.self_attn.q_proj.weight.dtype, layer.input_layernorm.weight.dtype)
        trainer.train()
        trainstream.unwrap(model)
        return losses.values, dtypes, [p.detach().clone() for p in model.parameters()]

    bf16, bf16_dtypes, bf16_weights = run({})
    fp32, fp32_dtypes, fp32_weights = run({"page_dtype": None})
    assert bf16_dtypes == (torch.bfloat16, torch.float32) and fp32_dtypes == (torch.float32, torch.float32)
    assert len(bf16) == 4 and bf16 == fp32
    assert all(torch.equal(a, b) for a, b in zip(bf16_weights, fp32_weights))
