"""The Hugging Face Trainer integration: TrainstreamMixin before any transformers.Trainer class hands its
optimizer to trainstream.wrap. What it does and how to use it: trainstream/hf.py, the names' public home."""

from __future__ import annotations

import logging
from typing import Any

import transformers

from trainstream._C import TrainstreamError
from trainstream._optimizer import OffloadedOptimizer
from trainstream._wrap import wrap
from trainstream.integrations.causal_lm_loss import ChunkedCausalLMLoss, unsupported

log = logging.getLogger("trainstream")


class TrainstreamMixin:
    """Put before a transformers.Trainer class in the bases: its optimizer runs in trainstreamd."""

    def __init__(self, *args, trainstream: dict[str, Any] | None = None,
                 trainstream_options: dict[str, Any] | None = None, chunked_loss: bool = True,
                 loss_chunk_size: int = 4096, **kwargs):
        """`trainstream` (or `trainstream_options`): further arguments of `trainstream.wrap` (offload,
        moment_dtype, client, job, ...); `max_grad_norm` and `accumulation_steps` come from the
        TrainingArguments. `chunked_loss`: compute a causal LM's loss without its logits (where the Trainer
        class keeps transformers.Trainer's compute_loss)."""
        if trainstream is not None and trainstream_options is not None:
            raise TrainstreamError("pass the wrap options as trainstream={...} or trainstream_options={...}, not both")
        self.trainstream_options = dict(trainstream or trainstream_options or {})
        taken = {"max_grad_norm", "accumulation_steps"} & self.trainstream_options.keys()
        if taken:
            raise TrainstreamError(f"{sorted(taken)} come from TrainingArguments (max_grad_norm, "
                                   "gradient_accumulation_steps), not the trainstream options")
        self.chunked_loss = chunked_loss and _computes_loss_as_transformers(type(self))
        self.loss_chunk_size = loss_chunk_size
        self._chunked: dict[int, ChunkedCausalLMLoss | None] = {}  # id(model) -> its loss, None: the model's own
        self._pages = self._pages_a_cpu_model(kwargs.get("model", args[0] if args else None),
                                              kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)

    def _pages_a_cpu_model(self, model, args) -> bool:
        """Whether the model stays on the CPU for weight paging (and the options say so to wrap())."""
        device = getattr(args, "device", None)
        on_cpu = model is not None and any(p.device.type == "cpu" for p in model.parameters())
        wanted = self.trainstream_options.get("param_offload", "default")
        if wanted == "default":
            if not (on_cpu and device is not None and device.type == "cuda"):
                return False
            self.trainstream_options["param_offload"] = True
            log.info("TrainstreamTrainer: the model is on the CPU: its block stack is paged from host memory to "
                     "%s (trainstream={'param_offload': False} moves it to the GPU instead)", device)
        elif wanted is False or wanted is None:
            return False
        if device is not None:
            self.trainstream_options.setdefault("device", device)
        if getattr(args, "bf16", False):
            self.trainstream_options.setdefault("page_dtype", "bfloat16")
        return True

    def _move_model_to_device(self, model, device):
        if not self._pages:  # with paging, wrap() places what stays resident; the blocks never come whole
            super()._move_model_to_device(model, device)

    def create_optimizer(self, model=None):
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it during train()
        if not isinstance(inner, OffloadedOptimizer):
            optimizer = super().create_optimizer(model)
            _, self.optimizer = wrap(
                self.model if model is None else model, optimizer,
                max_grad_norm=self.args.max_grad_norm if self.args.max_grad_norm > 0 else None,
                **self.trainstream_options)
        return self.optimizer

    def _has_mixed_mesh_grads(self, model) -> bool:
        """transformers asks (once, from p.grad after backward) whether the gradients span several device
        meshes; a wrapped model's are in the daemon, none a DTensor, and its watched parameters refuse p.grad
        reads there (_watched.py)."""
        return False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chunked = None
        if (self.chunked_loss and model.training and not return_outputs and "labels" in inputs
                and self.label_smoother is None and self.compute_loss_func is None):
            chunked = self._chunked_loss_of(self.accelerator.unwrap_model(model))
        if chunked is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with chunked.active():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _chunked_loss_of(self, model) -> ChunkedCausalLMLoss | None:
        key = id(model)
        if key not in self._chunked:
            reason = unsupported(model)
            if reason is not None:
                log.info("TrainstreamTrainer: the model's own loss, from its full logits: %s", reason)
            self._chunked[key] = None if reason else ChunkedCausalLMLoss(model, self.loss_chunk_size)
        return self._chunked[key]


def _computes_loss_as_transformers(trainer_class: type) -> bool:
    """Whether the class after the mixin keeps transformers.Trainer's compute_loss (the chunked loss
    replaces the model's logits, which a compute_loss of its own may read)."""
    mro = trainer_class.__mro__
    after = mro[mro.index(TrainstreamMixin) + 1:]
    owner = next((cls for cls in after if "compute_loss" in cls.__dict__), None)
    return owner is transformers.Trainer


class TrainstreamTrainer(TrainstreamMixin, transformers.Trainer):
    """A transformers.Trainer whose AdamW runs in trainstreamd."""


def trainstream_trainer(trainer_class: type) -> type:
    """`trainer_class` (a transformers.Trainer subclass: TRL's SFTTrainer, DPOTrainer, GRPOTrainer,
    Seq2SeqTrainer, ...) with its optimizer in trainstreamd; it takes the `trainstream={...}` options too."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TrainstreamError(f"trainstream_trainer takes a transformers.Trainer subclass, not {trainer_class!r}")
    if issubclass(trainer_class, TrainstreamMixin):
        return trainer_class
    return type(f"Trainstream{trainer_class.__name__}", (TrainstreamMixin, trainer_class),
                {"__module__": trainer_class.__module__, "__doc__": trainer_class.__doc__})


TrainStreamTrainer = TrainstreamTrainer  # TrainStream 0.2's name
