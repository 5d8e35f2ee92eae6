"""Rank 0 of a job whose other ranks never attach: trains one step, prints "waiting", then waits for
that step's weights (which need every rank's gradients) until the wait times out or is interrupted.
Exits 0 after a TrainstreamError (printed), 130 after a KeyboardInterrupt."""

import argparse
import signal
import sys
import time

import torch

import trainstream

interrupted_at = 0.0


def on_sigint(signum, frame):
    """Python's default (KeyboardInterrupt), noting when it ran: CLOCK_MONOTONIC is system-wide, so the
    test that sent the signal can tell how long the native wait took to notice."""
    global interrupted_at
    interrupted_at = time.monotonic()
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGINT, on_sigint)
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--wait-timeout", type=float, default=None)
    args = parser.parse_args()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = trainstream.wrap(model, opt, client=trainstream.connect(args.socket), job=args.job, rank=0,
                                  world_size=args.world_size, wait_timeout=args.wait_timeout)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    print("waiting", flush=True)
    start = time.monotonic()
    try:
        trainstream.synchronize()
    except trainstream.TrainstreamError as e:
        print(f"TrainstreamError after {time.monotonic() - start:.1f} s: {e}", flush=True)
        return 0
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt at {interrupted_at:.6f}", flush=True)
        return 130
    print("synchronized", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
