"""A rank that truncates its own job's segment under trainstreamd, as any uid may with the files it owns.

Started as root, it becomes --uid (another uid than the daemon's) once its modules are loaded (this
Python lives where that uid may not read), before it connects: the daemon knows it as --uid.

It attaches job --job through the raw session API (so that it touches exactly what it means to), seeds
the weights and trains two steps, prints "key <job key>" and "trained", then waits for a line on stdin.
Then it cuts --segment ("state": from its master weights on, keeping the header and the commit words;
"rank": from the first page boundary in its gradients on, keeping the rings), delivers step 3 and
waits for its weights, touching nothing past the cut itself. Prints "error: <message>" and exits 0
when that fails; exits 1 if the weights came."""

import argparse
import os
import sys

from conftest import raw_spec

import trainstream

PARAMS = [("w", [64, 64], 0, 0), ("b", [64], 0, 0)]  # one fp32 bucket of 16.6 KB: it spans several pages
PAGE = os.sysconf("SC_PAGESIZE")


def mapped_at(path: str) -> int:
    """Where this process maps `path` (the start of its mapping)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(path):
                return int(line.split("-", 1)[0], 16)
    raise RuntimeError(f"{path} is not mapped")


def fill(region, value: float) -> None:
    floats = memoryview(region).cast("f")
    for i in range(len(floats)):
        floats[i] = value * ((i % 7) - 3)


def deliver(session, step: int) -> None:
    session.set_hparams(step, 0, 1e-2, 0.9, 0.999, 1e-8, 0.01)
    fill(session.grads(), 0.1 * step)
    presence = memoryview(session.presence())
    for p in range(len(presence)):
        presence[p] = 1


def announce(session, step: int) -> None:
    for b in range(len(session.buckets)):
        session.send_grad_ready(b, step, 0, True)


def wait(session, step: int) -> None:
    for b in range(len(session.buckets)):
        session.wait_params_ready(b, step)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--segment", choices=["state", "rank"], required=True)
    parser.add_argument("--uid", type=int, required=True)
    args = parser.parse_args()
    os.setgroups([])
    os.setgid(args.uid)
    os.setuid(args.uid)
    client = trainstream.connect(args.socket)
    session = client.attach(args.job, 0, raw_spec(PARAMS), 7, wait_timeout_s=60.0)
    fill(session.master(session.committed_half(0)), 0.5)
    session.send_load_state(0)
    wait(session, 0)
    for step in (1, 2):
        deliver(session, step)
        announce(session, step)
        wait(session, step)
    key = next(j["job_key"] for j in client.stats()["jobs"] if j["name"] == args.job)
    print(f"key {key}", flush=True)
    print("trained", flush=True)
    sys.stdin.readline()

    path = f"/dev/shm/trainstream.{os.getuid()}.{key}.{'state' if args.segment == 'state' else 'rank0'}"
    base = mapped_at(path)
    deliver(session, 3)  # written before the cut: nothing past it is touched here afterwards
    if args.segment == "state":
        cut = min(session.master(h).address for h in range(session.state_halves)) - base
    else:
        cut = -(-(session.grads().address - base) // PAGE) * PAGE
    os.truncate(path, cut)
    announce(session, 3)
    try:
        wait(session, 3)
    except trainstream.TrainstreamError as e:
        print(f"error: {e}", flush=True)
        return 0
    print("the weights of step 3 came", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
