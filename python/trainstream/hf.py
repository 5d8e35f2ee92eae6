"""Hugging Face Trainer integration: a `transformers.Trainer` whose AdamW runs in trainstreamd.

    from trainstream.hf import TrainstreamTrainer
    trainer = TrainstreamTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                                 trainstream_options={"moment_dtype": "bfloat16"})
    trainer.train()

The Trainer builds its optimizer as usual (`optim="adamw_torch"` or `"adamw_torch_fused"`, its
parameter groups, its LR scheduler); this class hands it to `trainstream.wrap` with the Trainer's
`max_grad_norm` and `gradient_accumulation_steps`. Gradients leave the parameters during backward,
so the daemon clips, and the Trainer neither clips nor logs a gradient norm. Optimizer checkpoints
are in torch.optim.AdamW's format, so they resume with or without trainstream. One process per GPU,
as with torchrun: ranks and the job name come from its environment (see `trainstream.wrap`).
Tested with transformers 5.x.
"""

from __future__ import annotations

from typing import Any

import transformers

import trainstream
from trainstream._optimizer import OffloadedOptimizer


class TrainstreamTrainer(transformers.Trainer):
    def __init__(self, *args, trainstream_options: dict[str, Any] | None = None, **kwargs):
        """`trainstream_options`: further arguments of `trainstream.wrap` (client, job, moment_dtype,
        bucket_mb, ...); `max_grad_norm` and `accumulation_steps` come from the TrainingArguments."""
        self.trainstream_options = dict(trainstream_options or {})
        taken = {"max_grad_norm", "accumulation_steps"} & self.trainstream_options.keys()
        if taken:
            raise trainstream.TrainstreamError(f"{sorted(taken)} come from TrainingArguments (max_grad_norm, "
                                               "gradient_accumulation_steps), not trainstream_options")
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it during train()
        if not isinstance(inner, OffloadedOptimizer):
            optimizer = super().create_optimizer(model)
            _, self.optimizer = trainstream.wrap(
                self.model if model is None else model, optimizer,
                max_grad_norm=self.args.max_grad_norm if self.args.max_grad_norm > 0 else None,
                accumulation_steps=self.args.gradient_accumulation_steps, **self.trainstream_options)
        return self.optimizer

    def _clip_grad_norm(self, model):
        return None  # the daemon clips: gradients are not in p.grad when the Trainer would

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # the Trainer would compute it from p.grad, which trainstream has emptied
