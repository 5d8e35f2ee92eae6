"""Hugging Face Trainer integration: any `transformers.Trainer` whose AdamW runs in trainstreamd.

    from trainstream.hf import TrainstreamTrainer, trainstream_trainer
    trainer = TrainstreamTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                                 trainstream={"moment_dtype": "bfloat16"})
    trainer.train()

    SFTTrainer = trainstream_trainer(trl.SFTTrainer)  # any Trainer subclass: TRL's, Seq2SeqTrainer, yours
    class MyTrainer(TrainstreamMixin, trl.DPOTrainer): ...  # the same, by hand

The Trainer builds its optimizer as usual (`optim="adamw_torch"` or `"adamw_torch_fused"`, its
parameter groups, its LR scheduler); the mixin hands it to `trainstream.wrap` with the options of
`trainstream={...}` (or, the older name, `trainstream_options={...}`), and the Trainer's `max_grad_norm`
(which its own clip_grad_norm_ calls then clip in the daemon, logging the real `grad_norm`). Its
gradient accumulation is counted, the last step of an epoch's shorter remainder included. Optimizer
checkpoints are in torch.optim.AdamW's format, so they resume with or without trainstream. One process
per GPU, as with torchrun: ranks and the job name come from its environment (see `trainstream.wrap`).
`TrainStreamTrainer` (`from trainstream.integrations.huggingface import TrainStreamTrainer`) is TrainStream
0.2's name for TrainstreamTrainer. The code is in trainstream/integrations/huggingface.py.

A model given on the CPU while the Trainer trains on a GPU is not moved there whole: its decoder
layers (the model's block stack: model.model.layers, and peft's wrapped equivalent) are paged from
host memory (`param_offload=True`, `device=` the Trainer's device), and the rest goes to the GPU; a
LoRA base's frozen weights then live once in host memory in their dtype, with no optimizer state. Pass
`trainstream={"param_offload": ...}` to choose otherwise (False moves the model to the GPU as usual).
With `bf16=True` the Trainer runs the forward under bf16 autocast, so the paged layers' float32 Linear
weights page in bf16 (`page_dtype="bfloat16"`: half the bytes, the same results; `page_dtype=None`
pages them in float32).

Causal language models (see integrations/causal_lm_loss.py for which) compute their training loss with
trainstream.chunked_cross_entropy from the last hidden state and the output projection, so the full
logits never exist (`chunked_loss=False` keeps the model's own loss; `loss_chunk_size` tokens per chunk).
Evaluation, models that are not recognised, and Trainer subclasses with a compute_loss of their own (TRL's
read the logits for their metrics) use the model's own loss (logged once). Tested with transformers 5.x
and TRL 1.x.
"""

from trainstream.integrations.huggingface import TrainstreamMixin, TrainstreamTrainer, trainstream_trainer

__all__ = ["TrainstreamMixin", "TrainstreamTrainer", "trainstream_trainer"]
