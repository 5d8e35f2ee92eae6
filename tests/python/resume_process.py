"""A training process for the crash-consistency tests: trains a small MLP of several buckets through
trainstreamd on deterministic batches (batch N comes from seed N), starting at `optimizer.resume_step`
the way docs/usage.md shows, and prints "resumed N" at attach and "step N loss L" after each step (L
exactly, as repr() writes the float: the tests compare attempts bit for bit).

--die-at STEP:K SIGKILLs the process from inside backward: in the gradient hook of the K-th parameter
(in backward order) of step STEP, after the gradients of the parameters before it left. At the end
(--steps steps done) it saves the model's weights and the optimizer's state dict to --out. --paged:
bf16 weights and moments, the hidden layers paged through CPU slots."""

import argparse
import os
import signal
import sys

import torch

import trainstream


def make_model(width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))


def make_optimizer(model, **kw) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, **kw)


def loss_of(model, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, model[0].in_features, generator=g), torch.randn(16, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def die_in_backward(model, step_box, die_step: int, k: int) -> None:
    """SIGKILL in the k-th gradient hook (backward order) of step die_step; registered after wrap's
    hooks, so the gradients of this parameter and those before it were handed to trainstream."""
    seen = [0]

    def hook(_param):
        if step_box[0] != die_step:
            return
        seen[0] += 1
        if seen[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--state-halves", type=int, default=2)
    parser.add_argument("--die-at", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=0.01)
    parser.add_argument("--paged", action="store_true")
    args = parser.parse_args()
    model, paging, dtype = make_model(args.width), {}, torch.float32
    if args.paged:
        dtype = torch.bfloat16
        model = model.to(dtype)
        paging = {"device": "cpu", "param_offload": True, "blocks": list(model)[:8:2], "moment_dtype": "bfloat16",
                  "seed": 1}  # bf16 moments round stochastically: the same seed in every job
    model, opt = trainstream.wrap(model, make_optimizer(model), client=trainstream.connect(args.socket),
                                  job=args.job, bucket_mb=args.bucket_mb, state_halves=args.state_halves, **paging)
    step_box = [opt.resume_step]
    if args.die_at:
        die_step, k = (int(v) for v in args.die_at.split(":"))
        die_in_backward(model, step_box, die_step, k)
    print(f"resumed {opt.resume_step}", flush=True)
    for step in range(opt.resume_step, args.steps):
        step_box[0] = step
        loss = loss_of(model, step, dtype)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item()!r}", flush=True)
    trainstream.synchronize(model)
    if args.out:
        torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optimizer": opt.state_dict()}, args.out)
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
