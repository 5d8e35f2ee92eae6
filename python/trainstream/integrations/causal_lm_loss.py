"""The causal-LM loss of a Hugging Face model without its logits, for TrainstreamTrainer.

While `active()`, the model's output projection (get_output_embeddings(), an nn.Linear) keeps its input,
the last hidden state, and returns a zero-width stand-in for the logits; the model's loss function
(PreTrainedModel.loss_function) is one that computes, from that hidden state and the projection's weight
and bias, the loss transformers' ForCausalLMLoss would compute from the logits, with
chunked_cross_entropy: labels shifted left by one and padded with ignore_index (or the given
shift_labels), the sum over the counted tokens divided by num_items_in_batch when given, else their mean.
The (tokens x vocabulary) logits never exist; a tied projection's gradient reaches the embedding as usual.

Recognised (`unsupported()` says why not): transformers models of the causal-LM mapping whose
config.model_type is one of PLAIN_HEADS (their forward hands the projection's output unchanged to the
loss function; a model whose logits are scaled or soft-capped there, Gemma 2, Cohere or Granite, is not),
with transformers' ForCausalLMLoss and a plain nn.Linear as the projection. A PEFT model counts as the
model it wraps.

Invariant: the loss reads the hidden state of the same forward; the stand-in is checked to be what reached
the loss function, so a forward that changes the logits on the way fails loudly instead of training on a
wrong loss.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from trainstream._C import TrainstreamError
from trainstream._losses import chunked_cross_entropy

PLAIN_HEADS = frozenset({
    "deepseek_v3", "gemma", "glm", "glm4", "gpt2", "gpt_neox", "gptj", "llama", "ministral", "mistral", "mixtral",
    "olmo", "olmo2", "opt", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3", "stablelm",
    "starcoder2",
})


def language_model(model):
    """The transformers model inside `model` (itself, or the one a PEFT model wraps), or None."""
    import transformers

    if isinstance(model, transformers.PreTrainedModel):
        return model
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return inner if isinstance(inner, transformers.PreTrainedModel) else None


def unsupported(model) -> str | None:
    """Why `model`'s loss cannot be computed here, or None."""
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    lm = language_model(model)
    if lm is None:
        return f"{type(model).__name__} is not a transformers model"
    if lm._get_name() not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return f"{lm._get_name()} is not a causal language model"
    model_type = getattr(lm.config, "model_type", None)
    if model_type not in PLAIN_HEADS:
        return (f"model type {model_type!r} is not one known to pass its logits unchanged to the loss "
                f"({', '.join(sorted(PLAIN_HEADS))})")
    if lm.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        return "its loss function is not transformers' ForCausalLMLoss"
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"its output projection is a {type(head).__name__}, not an nn.Linear"
    if "forward" in head.__dict__:
        return "its output projection's forward is replaced (by accelerate's hooks, say)"
    return None


class ChunkedCausalLMLoss:
    def __init__(self, model, chunk_size: int):
        self.model = language_model(model)
        self.head = self.model.get_output_embeddings()
        self.chunk_size = chunk_size
        self.hidden: torch.Tensor | None = None
        self.stand_in: torch.Tensor | None = None

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        self.stand_in = hidden.new_empty(*hidden.shape[:-1], 0)
        return self.stand_in

    def _loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
              shift_labels=None, **kwargs) -> torch.Tensor:
        if self.stand_in is None or logits is not self.stand_in:
            raise TrainstreamError(f"{self.model._get_name()} changed its logits between the output projection and "
                                   "the loss: pass chunked_loss=False to TrainstreamTrainer")
        hidden = self.hidden
        self.hidden = self.stand_in = None
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = chunked_cross_entropy(hidden, self.head.weight, shift_labels.to(hidden.device),
                                     chunk_size=self.chunk_size, ignore_index=ignore_index, reduction=reduction,
                                     bias=self.head.bias)
        if reduction == "sum":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    @contextlib.contextmanager
    def active(self):
        model = self.model
        had = "_loss_function" in model.__dict__
        previous = model.__dict__.get("_loss_function")
        self.head.forward = self._project
        model.loss_function = self._loss
        try:
            yield
        finally:
            del self.head.forward
            if had:
                model._loss_function = previous
            else:
                del model._loss_function
            self.hidden = self.stand_in = None
