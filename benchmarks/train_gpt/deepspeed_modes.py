"""DeepSpeed ZeRO-Offload modes for the GPT training benchmark: the same model, batch and VRAM cap as
train_gpt.py's other modes, trained by DeepSpeed (0.19.x) in a process of its own.

What is measured: one training step (forward, engine.backward, engine.step) of
  - ZeRO-2 with the optimizer offloaded: bf16 weights and gradients on the GPU, the fp32 master
    weights and AdamW moments in pinned host memory, updated by DeepSpeed's CPU Adam (cpu_adam op,
    compiled on first use);
  - ZeRO-3 with the optimizer and the parameters offloaded: the bf16 weights too live in pinned host
    memory and are brought to the GPU module by module; optionally each transformer block's
    activations are recomputed in backward (torch.utils.checkpoint, non-reentrant).
DeepSpeed runs in its bf16 mode in both cases. With the benchmark's bf16 weights (--bf16-weights) the
forward runs as it is; with its default fp32 weights + autocast, DeepSpeed still keeps bf16 weights on
the GPU (its bf16 mode converts the model) and the forward runs under bf16 autocast, as the other
modes' forwards do: what differs from the stock mode is then also the GPU weights' dtype.

AdamW's hyperparameters are torch.optim.AdamW's defaults, as train_gpt.py constructs it (only lr
given): betas (0.9, 0.999), eps 1e-8, weight_decay 0.01 (DeepSpeed's own default is 0). DeepSpeed's
default gradient_clipping is 1.0: it is set to 0 (none, as in train_gpt.py) unless max_grad_norm is given.

Known caveat (ZeRO-3): under deepspeed.zero.Init each module's parameters are partitioned as soon as
the module is built, so the GPT's own nn.init calls in gpt.py run on empty partitions and the layers
keep torch's default init (first loss about 1065 instead of 11). build_zero3 therefore initialises
again with gpt.py's rule, block by block inside deepspeed.zero.GatheredParameters(modifier_rank=0).
The shapes, and so the step times, do not depend on it.

    engine, step = build_zero2(lambda dtype: gpt.build("1.86b", "cuda", dtype), lr=1e-4,
                               bf16_weights=False, batch=8)
    step(tokens, targets)

    python3 benchmarks/train_gpt/deepspeed_modes.py --dry-run   # the two configurations, as JSON

DeepSpeed is imported only inside the functions that need it, so this file imports (and --dry-run
runs) without it. Checked off the GPU machine only on DeepSpeed 0.19.8's CPU accelerator
(DS_ACCELERATOR=cpu, gloo instead of nccl, a 2-block GPT, bf16 weights): all three modes train and
start at ln(vocabulary); the autocast path and NCCL are untested there.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ModelBuilder = Callable[[torch.dtype], nn.Module]  # dtype -> the GPT, e.g. lambda d: gpt.build(name, "cuda", d)
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, targets) -> loss


def _config(stage: int, lr: float, batch: int, max_grad_norm: float) -> dict:
    offload = {"device": "cpu", "pin_memory": True}
    zero = {"stage": stage, "offload_optimizer": dict(offload), "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = dict(offload)
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(max_grad_norm),  # 0: none (DeepSpeed's default would be 1.0)
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def zero2_config(lr: float, batch: int, max_grad_norm: float = 0.0) -> dict:
    """The DeepSpeed configuration of build_zero2: ZeRO-2, optimizer in pinned host memory, bf16."""
    return _config(2, lr, batch, max_grad_norm)


def zero3_config(lr: float, batch: int, max_grad_norm: float = 0.0) -> dict:
    """The DeepSpeed configuration of build_zero3: ZeRO-3, optimizer and parameters in pinned host memory, bf16."""
    return _config(3, lr, batch, max_grad_norm)


def init_distributed() -> None:
    """One-process torch.distributed for DeepSpeed (NCCL, world size 1): RANK=0 LOCAL_RANK=0
    WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, where the environment does not set them."""
    import deepspeed

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed("nccl")


def _quiet() -> None:
    import logging

    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)


def _step_fn(engine, bf16_weights: bool) -> StepFn:
    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not bf16_weights):
            loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()  # the update, then the gradients are zeroed
        return loss

    return step


def build_zero2(model_builder: ModelBuilder, lr: float, bf16_weights: bool, batch: int,
                max_grad_norm: float = 0.0) -> tuple[object, StepFn]:
    """DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU; returns (engine, step_fn).

    `model_builder(torch.bfloat16)` builds the model (on the GPU or the CPU: the engine moves it);
    bf16 because DeepSpeed's bf16 mode would convert it anyway, and gpt.build initialises in fp32
    before converting, so the weights are the fp32 model's rounded. `bf16_weights` is the benchmark's
    flag: False runs the forward under bf16 autocast. step_fn(tokens, targets) runs one training step
    and returns the loss.
    """
    import deepspeed

    init_distributed()
    _quiet()
    model = model_builder(torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=zero2_config(lr, batch, max_grad_norm))
    return engine, _step_fn(engine, bf16_weights)


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward. The block is called as a module both
    times (forward and recomputation), so ZeRO-3's module hooks gather its parameters both times."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _initialise_partitioned(model: nn.Module) -> None:
    """gpt.py's initialisation again, on the full parameters: one module at a time gathered on the
    GPU, initialised there (rank 0) and partitioned back to host memory."""
    import deepspeed

    from gpt import _init

    layers = len(model.blocks)
    for module in (*model.blocks, model.wte, model.wpe):  # gpt.GPT's order: blocks, then the embeddings
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                with torch.no_grad():
                    _init(module, layers)


def build_zero3(model_builder: ModelBuilder, lr: float, bf16_weights: bool, batch: int, checkpoint_blocks: bool,
                max_grad_norm: float = 0.0) -> tuple[object, StepFn]:
    """DeepSpeed ZeRO-3 with the optimizer and the parameters offloaded to the CPU; returns (engine, step_fn).

    `model_builder(torch.bfloat16)` runs inside deepspeed.zero.Init(remote_device="cpu",
    pin_memory=True), which partitions each module's parameters into pinned host memory as it is
    built; the GPT is then initialised again (see the module docstring), its tied output projection
    (wte.weight, used by GPT.forward outside the embedding module) is registered as an external
    parameter of the GPT, and with `checkpoint_blocks` each of model.blocks is wrapped to recompute
    its activations in backward. `bf16_weights` as in build_zero2.
    """
    import deepspeed

    init_distributed()
    _quiet()
    config = zero3_config(lr, batch, max_grad_norm)
    # The config gives zero.Init its dtype (bf16): without it zero.Init would convert to fp16.
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=True, config_dict_or_path=config):
        model = model_builder(torch.bfloat16)
    _initialise_partitioned(model)
    deepspeed.zero.register_external_parameter(model, model.wte.weight)
    if checkpoint_blocks:
        model.blocks = nn.ModuleList(_Checkpointed(block) for block in model.blocks)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, _step_fn(engine, bf16_weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the ZeRO-2 and ZeRO-3 configurations as JSON")
    parser.add_argument("--lr", type=float, default=1e-4, help="train_gpt.py's learning rate")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-grad-norm", type=float, default=0.0)
    args = parser.parse_args()
    if not args.dry_run:
        parser.error("only --dry-run runs from the command line; train_gpt.py calls build_zero2/build_zero3")
    print(json.dumps({"zero2": zero2_config(args.lr, args.batch, args.max_grad_norm),
                      "zero3": zero3_config(args.lr, args.batch, args.max_grad_norm)}, indent=1))


if __name__ == "__main__":
    main()
