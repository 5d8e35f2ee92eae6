"""Writes the hand-made seeds of the fuzz corpora (tests/fuzz/corpus/<harness>/seed-*): valid inputs
each harness's format starts from; the rest of each corpus is what fuzzing found, merged
(scripts/fuzz.sh). Protobuf messages are encoded by hand (no protobuf package needed).
    python3 tests/fuzz/make_seeds.py"""

import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, value) -> bytes:
    if isinstance(value, (bytes, str)):
        data = value.encode() if isinstance(value, str) else value
        return varint(number << 3 | 2) + varint(len(data)) + data
    if isinstance(value, float):
        return varint(number << 3 | 1) + struct.pack("<d", value)
    return varint(number << 3) + varint(value)


def param(name: str, shape: list[int], dtype: int = 0, group: int = 0) -> bytes:
    packed = b"".join(varint(d) for d in shape)
    return field(1, name) + field(2, packed) + field(3, dtype) + field(4, group)


def layout(world_size: int = 1, accumulation: int = 1, clip: float = 0.0) -> bytes:
    return (field(1, param("w", [40, 25])) + field(1, param("b", [300])) + field(1, param("e", [64], dtype=1))
            + field(2, 1) + field(3, 4096) + field(6, accumulation) + field(7, world_size) + field(8, clip))


def message(kind: int, flags: int = 0, bucket: int = 0, step: int = 0, micro: int = 0) -> bytes:
    return struct.pack("<HHIQII", kind, flags, bucket, step, micro, 0) + bytes(36)


def step_terms(flags: int, step: int, micro: int, max_norm: float = 0.0, factor: float = 1.0) -> bytes:
    return struct.pack("<HHIQIIIfdf", 4, flags, 0, step, micro, 0, 0, 1.0, max_norm, factor) + bytes(20)


def write(harness: str, name: str, data: bytes) -> None:
    folder = os.path.join(HERE, "corpus", harness)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"seed-{name}"), "wb") as f:
        f.write(data)


def ring_seeds() -> None:
    grad, load, final = 1, 2, 1
    one_step = message(load) + b"".join(message(grad, final, b, 1) for b in range(3))
    pieces = [one_step[i:i + 64] for i in range(0, 256, 64)]
    write("fuzz_ring_messages", "one-rank-one-step", bytes([0]) + b"".join(bytes([0]) + m for m in pieces))
    two = [bytes([0]) + message(load)] + [bytes([r]) + message(grad, final, b, 1) for b in range(3) for r in (0, 1)]
    write("fuzz_ring_messages", "two-ranks-clipped", bytes([1 | 4]) + b"".join(two))
    accumulate = [bytes([0]) + message(load)] + [bytes([0]) + message(grad, final if m else 0, b, 1, m)
                                                 for m in (0, 1) for b in range(3)]
    write("fuzz_ring_messages", "accumulation", bytes([2]) + b"".join(accumulate))
    # step terms, counted accumulation, two halves: two micro-batches (the first held, then "more"),
    # clip_grad_norm_ and optimizer.step() in one kStepTerms; then a step dropped by zero_grad()
    more, discard, uncertain, clip_commit = 5, 6, 4, 16 | 32
    counted = [message(load)] + [message(grad, uncertain, b, 1, 0) for b in range(3)] + [message(more, 0, 0, 1, 0)]
    counted += [message(grad, final, b, 1, 1) for b in range(3)] + [step_terms(clip_commit, 1, 2, 1.0)]
    counted += [message(grad, final, b, 2) for b in range(3)] + [message(discard, 0, 0, 2, 1)]
    write("fuzz_ring_messages", "step-terms", bytes([2 | 16 | 32]) + b"".join(bytes([0]) + m for m in counted))


def layout_seeds() -> None:
    for name, spec in {"plain": layout(), "ranks-clip": layout(2, 2, 1.0)}.items():
        # FuzzedDataProvider takes integers from the end: the bool (proto, not fields), then the length
        write("fuzz_layout", name, spec + bytes(64) + struct.pack("<H", len(spec)) + bytes([1]))


def peer_seeds() -> None:
    floats = struct.pack("<8f", *range(8))
    header = field(1, "job") + field(2, 3) + field(3, 1) + field(4, 0) + field(5, 1) + field(6, 0) + field(8, 0)
    write("fuzz_peer_wire", "fragment", header + field(7, floats) + bytes([0]))


def control_seeds() -> None:
    attach = field(1, field(1, "job") + field(2, 0) + field(3, layout()) + field(4, 7) + field(6, "host"))
    # strings from the front, ended by a backslash and another byte; integers from the end: caller uid
    # index, the call, for a Session the number of messages
    write("fuzz_control", "attach", attach + b"\\x" + bytes([1, 3, 0]))
    write("fuzz_control", "handshake", field(1, 4) + b"\\x" + bytes([0, 0]))
    # Restore (call 5) of "restore.safetensors" (name 0) holding a snapshot, as root; then a snapshot
    # (call 4) of the restored job into the snapshot dir (the bool: 1).
    restore, snapshot = field(2, "restored"), field(1, "restored")
    write("fuzz_control", "restore-then-snapshot", restore + b"\\x" + escaped(snapshot_file()) + b"\\x" + snapshot
          + b"\\x" + bytes([1, 4, 0, 0, 5, 0]))


def escaped(data: bytes) -> bytes:
    """As FuzzedDataProvider.ConsumeRandomLengthString reads it back: a backslash doubled."""
    return data.replace(b"\\", b"\\\\")


def snapshot_file(dtypes: tuple[str, ...] = ("float32",), bucket_steps: tuple[int, ...] = (3,), master: float = 0.5,
                  moments: str = "float32") -> bytes:
    """A trainstream snapshot (daemon/snapshot/snapshot_format.h) of parameters of 4 elements, one of
    each of `dtypes` (a bucket per dtype), every parameter at AdamW step 3."""
    numels = [4] * len(dtypes)
    params = [{"name": f"p{i}", "shape": [n], "dtype": dtype, "group": 0, "partition": 0}
              for i, (n, dtype) in enumerate(zip(numels, dtypes))]
    layout = {"params": params, "frozen": [], "num_groups": 1, "bucket_bytes": 4096, "moment_dtype": moments,
              "optimizer": "adamw", "accumulation_steps": 1, "world_size": 1, "max_grad_norm": 0.0, "peers": [],
              "node_rank": 0, "state_halves": 1, "speculative_clipping": False}
    metadata = {"format": "trainstream.snapshot.v1", "job": "seed", "uid": "0", "seed": "7",
                "step": str(min(bucket_steps)), "layout": json.dumps(layout), "hparams": "[]",
                "daemon_version": "0.1.0"}
    moment_dtype, moment_size = ("F32", 4) if moments == "float32" else ("BF16", 2)
    tensors, data, offset = {}, b"", 0
    entries = []
    for i, n in enumerate(numels):
        entries += [(f"master.{i}", "F32", n, struct.pack(f"<{n}f", *[master] * n)),
                    (f"exp_avg.{i}", moment_dtype, n, bytes(n * moment_size)),
                    (f"exp_avg_sq.{i}", moment_dtype, n, bytes(n * moment_size))]
    entries += [("step", "I64", len(numels), struct.pack(f"<{len(numels)}q", *[3] * len(numels))),
                ("bucket_step", "I64", len(bucket_steps), struct.pack(f"<{len(bucket_steps)}q", *bucket_steps))]
    for name, dtype, count, content in entries:
        tensors[name] = {"dtype": dtype, "shape": [count], "data_offsets": [offset, offset + len(content)]}
        data += content
        offset += len(content)
    text = json.dumps({"__metadata__": metadata, **tensors}, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data


def snapshot_seeds() -> None:
    write("fuzz_snapshot_file", "one-parameter", snapshot_file())
    write("fuzz_snapshot_file", "two-buckets-a-step-apart", snapshot_file(("float32", "bfloat16"), (3, 4)))
    write("fuzz_snapshot_file", "bf16-moments", snapshot_file(moments="bfloat16"))
    write("fuzz_snapshot_file", "nan", snapshot_file(master=float("nan")))


def metrics_seeds() -> None:
    # integers from the end: whether a token is asked (last byte), then the number of cuts (0: one piece)
    token = "fuzz-token-0123456789"
    requests = {
        "scrape": f"GET /metrics HTTP/1.1\r\nHost: node0:9150\r\nAuthorization: Bearer {token}\r\n"
                  "Accept: text/plain\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n",
        "head": "HEAD /metrics?x=1 HTTP/1.0\n\n",
        "post": "POST /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody",
    }
    for name, request in requests.items():
        write("fuzz_metrics_http", name, request.encode() + bytes([0, 1]))


if __name__ == "__main__":
    metrics_seeds()
    ring_seeds()
    layout_seeds()
    peer_seeds()
    control_seeds()
    snapshot_seeds()
