"""Probe: how fast the kernel backs a job's shared memory (the attach phase of wrap()), and what scales it.

wrap() of the 1.86B GPT spent 12-24 s attaching on the GPU machine (2026-12-02), populating 35-49 GiB of
/dev/shm segments with MADV_POPULATE_WRITE on 16 threads: 2.0-3.2 GiB/s, while host_register.py found
one shm file filled at 4.5 GiB/s and anonymous memory at 20 GiB/s. This measures, for the same bytes:

  one-file      one /dev/shm file, its pages split among T threads (what shm/segment.cpp does)
  files         T /dev/shm files, one thread each (does the tmpfs inode serialize the faults?)
  anon-shared   MAP_SHARED|MAP_ANONYMOUS (shmem too, without a file name)
  anon-private  MAP_PRIVATE|MAP_ANONYMOUS, for comparison
  huge-tmpfs    one file on a tmpfs mounted with huge=always, when --huge-mount can be mounted (root)

each with MADV_POPULATE_WRITE (ctypes releases the GIL, so the threads fault at once) for T in --threads.

    python3 benchmarks/transfer/populate.py --gib 4 --threads 1,4,16 --json populate.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import threading
import time

from host_register import split_range

GIB = 1 << 30
MADV_POPULATE_WRITE = 23
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(address: int, nbytes: int) -> None:
    if LIBC.madvise(address, nbytes, MADV_POPULATE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_POPULATE_WRITE) of {nbytes} B")


def address_of(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def timed(jobs: list[tuple[int, int]]) -> float:
    """Populates each (address, bytes) on a thread of its own, all at once; the wall time."""
    threads = [threading.Thread(target=populate, args=job) for job in jobs]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def file_mappings(folder: str, count: int, nbytes: int) -> tuple[list[mmap.mmap], list[str]]:
    mappings, paths = [], []
    for i in range(count):
        path = os.path.join(folder, f"ts-populate-probe-{os.getpid()}-{i}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nbytes)
        mappings.append(mmap.mmap(fd, nbytes, mmap.MAP_SHARED))
        os.close(fd)
        paths.append(path)
    return mappings, paths


def measure(kind: str, nbytes: int, threads: int, huge_mount: str | None) -> float:
    paths: list[str] = []
    if kind == "files":
        mappings, paths = file_mappings("/dev/shm", threads, nbytes // threads)
        jobs = [(address_of(m), len(m)) for m in mappings]
    else:
        if kind in ("one-file", "huge-tmpfs"):
            mappings, paths = file_mappings("/dev/shm" if kind == "one-file" else huge_mount, 1, nbytes)
        else:
            flags = mmap.MAP_SHARED if kind == "anon-shared" else mmap.MAP_PRIVATE
            mappings = [mmap.mmap(-1, nbytes, flags | mmap.MAP_ANONYMOUS)]
        base = address_of(mappings[0])
        jobs = [(base + offset, length) for offset, length in split_range(nbytes, threads, mmap.PAGESIZE)]
    try:
        return timed(jobs)
    finally:
        for mapping in mappings:
            mapping.close()
        for path in paths:
            os.unlink(path)


def mount_huge(folder: str, gib: float) -> str | None:
    """A tmpfs with huge=always at folder, or None with the reason printed."""
    os.makedirs(folder, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(gib) + 1}G,huge=always", "none", folder],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"huge-tmpfs skipped: {done.stderr.strip()}")
        return None
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--kinds", default="one-file,files,anon-shared,anon-private,huge-tmpfs")
    parser.add_argument("--huge-mount", default="/tmp/ts-huge-probe")
    parser.add_argument("--json")
    args = parser.parse_args()
    nbytes = int(args.gib * GIB) // mmap.PAGESIZE * mmap.PAGESIZE
    kinds = args.kinds.split(",")
    huge = mount_huge(args.huge_mount, args.gib) if "huge-tmpfs" in kinds else None
    rows = []
    try:
        for kind in kinds:
            if kind == "huge-tmpfs" and huge is None:
                continue
            for threads in (int(t) for t in args.threads.split(",")):
                seconds = measure(kind, nbytes, threads, huge)
                rows.append({"kind": kind, "threads": threads, "gib": nbytes / GIB, "seconds": seconds,
                             "gibs": nbytes / GIB / seconds})
                print(f"{kind:13s} {threads:2d} threads: {nbytes / GIB:.1f} GiB in {seconds:.2f} s = "
                      f"{nbytes / GIB / seconds:.1f} GiB/s", flush=True)
    finally:
        if huge:
            subprocess.run(["umount", huge], check=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "kernel": os.uname().release, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
