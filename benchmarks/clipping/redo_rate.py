"""How often speculative clipping redoes a step, over a real run (issue 18).

Trains the benchmark GPT (benchmarks/train_gpt/gpt.py) with max_grad_norm through trainstream twice
from the same initial weights and data: with speculative clipping (each bucket's update starts before
the global norm is known; a step that clips is redone from the committed state half) and without (the
updates wait for the norm). Prints and records the redo rate (redone steps / speculative steps, from
Client.stats()), the redo rate after the warm-up, the step times of both runs, and the memory the
second state half costs. The data has structure (not uniform noise): token sequences of a fixed
random Markov chain in which each token has a few likely successors, so the loss falls and the
gradient norm moves as in real training (large early, under the limit later, with spikes).

  GPU (the 124M GPT, 200+ steps):  python benchmarks/clipping/redo_rate.py --device cuda
  CPU (a small GPT, runs anywhere): python benchmarks/clipping/redo_rate.py --config tiny --steps 200

The speculation cost on the common path is the second state half's memory; its time cost is a second
update pass over the buckets of the redone steps (the step times show both). After three clipped
steps in a row the job waits for the norm until a step does not clip (daemon/engine/step_engine.h):
those steps are neither speculative nor redone."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train_gpt"))
from markov_text import MarkovText  # noqa: E402

import gpt  # noqa: E402
import trainstream  # noqa: E402


def build_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = gpt.config_of(args.config)
    with torch.device(args.device):
        return gpt.GPT(config)


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def train(args, data: list[torch.Tensor], client, speculative: bool) -> dict:
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    job = f"redo-rate-{os.getpid()}-{'speculative' if speculative else 'waiting'}"
    model, optimizer = trainstream.wrap(model, optimizer, client=client, job=job, max_grad_norm=args.max_grad_norm,
                                        bucket_mb=args.bucket_mb, state_halves=2, speculative_clipping=speculative)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps, args.steps))
    losses, redone_by_step, times = [], [], []
    autocast = args.device == "cuda"
    for step, tokens in enumerate(data):
        tokens = tokens.to(args.device, non_blocking=True)
        start = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        scheduler.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % args.poll == args.poll - 1 or step in (args.warmup_steps - 1, len(data) - 1):
            trainstream.synchronize(model)
            stats = next(j for j in client.stats()["jobs"] if j["name"] == job)
            redone_by_step.append((step, stats["redone_steps"]))
    trainstream.synchronize(model)
    stats = next(j for j in client.stats()["jobs"] if j["name"] == job)
    trainstream.unwrap(model)
    client.drop_job(job)
    polled = {s + 1 for s, _ in redone_by_step}  # steps that start after a wait for the update
    timed = sorted(t for s, t in enumerate(times) if s >= args.warmup_steps and s not in polled)
    return {
        "speculative_clipping": stats["speculative_clipping"],
        "state_halves": stats["state_halves"],
        "params": params,
        "speculative_steps": stats["speculative_steps"],
        "redone_steps": stats["redone_steps"],
        "redone_by_step": redone_by_step,
        "median_step_ms": 1e3 * timed[len(timed) // 2],
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "state_bytes": stats["state_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="124m", help="a benchmarks/train_gpt config, or 'tiny' for the CPU")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear LR warm-up, then cosine to 0.1x")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--bucket-mb", type=float, default=32)
    parser.add_argument("--poll", type=int, default=50,
                        help="read the redo count every this many steps (it waits for the update: the median step "
                             "time leaves those steps out)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    vocab = gpt.config_of(args.config).vocab
    text = MarkovText(vocab)
    data = [text.batch(step, args.batch, args.seq) for step in range(args.steps)]
    client = trainstream.connect()
    runs = {name: train(args, data, client, name == "speculative") for name in ("speculative", "waiting")}
    spec, wait = runs["speculative"], runs["waiting"]
    # Redone steps after the warm-up: the total less the count read after its last step.
    redone_after = spec["redone_steps"] - dict(spec["redone_by_step"]).get(args.warmup_steps - 1, 0)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "args": vars(args),
        "redo_rate": spec["redone_steps"] / max(1, spec["speculative_steps"]),
        "waited_steps": args.steps - spec["speculative_steps"],  # after runs of clipped steps
        "redo_rate_after_warmup": redone_after / max(1, args.steps - args.warmup_steps),
        "second_half_bytes": 12 * spec["params"],
        "step_ms_speculative": spec["median_step_ms"],
        "step_ms_waiting": wait["median_step_ms"],
        "runs": runs,
    }
    print(f"{args.config} on {result['device']}, {args.steps} steps, max_grad_norm {args.max_grad_norm}: "
          f"{spec['redone_steps']} of {spec['speculative_steps']} speculative steps redone, "
          f"{result['waited_steps']} waited for the norm after clipped steps "
          f"(redo rate {result['redo_rate']:.3f}; {result['redo_rate_after_warmup']:.3f} after the "
          f"{args.warmup_steps}-step warm-up); loss {spec['loss_first']:.2f} -> {spec['loss_last']:.2f}")
    print(f"median step: {spec['median_step_ms']:.1f} ms speculative, {wait['median_step_ms']:.1f} ms waiting for "
          f"the norm; the second state half: {result['second_half_bytes'] / 2**20:.1f} MiB "
          f"(12 B/param, fp32 moments)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
