"""Probe: how fast cudaHostRegister page-locks memory like a trainstream job's shared memory, and whether
more threads, each registering an equal share at once, make it faster.

For each size (default 1 and 8 GiB) and each kind of memory, the mapping is created and populated
(written once, as a job's state is after rank 0 wrote the master weights), then registered with
cudaHostRegisterPortable by 1, 2, 4, 8 and 16 threads at once, each its page-aligned share, and
unregistered after each measurement. Kinds:
  shm             a POSIX shared-memory file under /dev/shm (os.open + ftruncate + mmap MAP_SHARED)
  shm-hugepage    the same with madvise(MADV_HUGEPAGE) before populating, when the kernel's policy
                  (/sys/kernel/mm/transparent_hugepage/shmem_enabled, /dev/shm's huge= option) allows it
  memfd-hugepage  (only when asked for) a memfd with MADV_HUGEPAGE: the internal shmem mount,
                  whose policy shmem_enabled is
  anon            anonymous private memory (mmap MAP_ANONYMOUS), for comparison (--anon-threads)
and, for comparison, the time torch.empty(pin_memory=True) takes to allocate the same size. Then H2D
copies (cudaMemcpyAsync through torch's copy_(non_blocking=True)) from each mapping, registered and
not, and from torch's pinned buffer: registered memory should copy at the pinned rate (about 55 GB/s
on an H200's PCIe Gen5 x16), pageable memory at about 7 GB/s.

The registering threads call libcudart through ctypes (the library torch loaded), which releases the
GIL during each call, so the calls overlap. Prints a table; --json writes everything.

    python3 benchmarks/transfer/host_register.py --json host_register.json
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import statistics
import threading
import time

import torch

GIB = 1 << 30
CUDA_HOST_REGISTER_PORTABLE = 1
THP = "/sys/kernel/mm/transparent_hugepage"


def split_range(nbytes: int, parts: int, align: int) -> list[tuple[int, int]]:
    """(offset, length) of at most `parts` consecutive shares that cover [0, nbytes) exactly.

    Every offset is a multiple of `align` (a page size); the shares hold whole aligned units, as
    equal as they can be: their counts of units differ by at most one, larger shares first; only the
    last share may end short of a unit boundary, where nbytes does. No share is empty: with fewer
    units than `parts` there are fewer shares.
    """
    if nbytes < 0 or parts < 1 or align < 1:
        raise ValueError(f"split_range needs nbytes >= 0, parts >= 1, align >= 1; got {nbytes}, {parts}, {align}")
    units = -(-nbytes // align)
    base, extra = divmod(units, parts)
    shares, offset = [], 0
    for i in range(min(parts, units)):
        length = min((base + (i < extra)) * align, nbytes - offset)
        shares.append((offset, length))
        offset += length
    return shares


class Cudart:
    """cudaHostRegister / cudaHostUnregister / cudaSetDevice of the libcudart torch loaded, through ctypes."""

    def __init__(self):
        torch.cuda.init()
        self.path = self._loaded_path() or ctypes.util.find_library("cudart")
        if self.path is None:
            raise RuntimeError("no libcudart among this process's libraries, nor on the library path")
        lib = ctypes.CDLL(self.path)
        self._register, self._unregister = lib.cudaHostRegister, lib.cudaHostUnregister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister.argtypes, self._unregister.restype = [ctypes.c_void_p], ctypes.c_int
        self._set_device = lib.cudaSetDevice
        self._set_device.argtypes, self._set_device.restype = [ctypes.c_int], ctypes.c_int
        self._error = lib.cudaGetErrorString
        self._error.argtypes, self._error.restype = [ctypes.c_int], ctypes.c_char_p

    @staticmethod
    def _loaded_path() -> str | None:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and os.path.basename(fields[5]).startswith("libcudart.so"):
                    return fields[5]
        return None

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: CUDA error {code} ({self._error(code).decode()})")

    def set_device(self, device: int) -> None:
        self.check(self._set_device(device), f"cudaSetDevice({device})")

    def register(self, address: int, nbytes: int) -> None:
        self.check(self._register(address, nbytes, CUDA_HOST_REGISTER_PORTABLE), f"cudaHostRegister({nbytes} B)")

    def unregister(self, address: int) -> None:
        self.check(self._unregister(address), "cudaHostUnregister")


def concurrently(calls: list, device: int, cudart: Cudart) -> tuple[float, list[float]]:
    """Runs each call on a thread of its own, all released at once; returns the wall time from the
    release until the last finished, and each call's own time."""
    go, errors, own = threading.Event(), [], [0.0] * len(calls)

    def run(i, call):
        try:
            cudart.set_device(device)
            go.wait()
            start = time.perf_counter()
            call()
            own[i] = time.perf_counter() - start
        except BaseException as e:  # re-raised below, on the calling thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # the threads are waiting at the event
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, own


def register_threads(base: int, nbytes: int, threads: int, align: int, cudart: Cudart, device: int) -> dict:
    shares = split_range(nbytes, threads, align)
    wall, own = concurrently([lambda o=o, n=n: cudart.register(base + o, n) for o, n in shares], device, cudart)
    unwall, _ = concurrently([lambda o=o: cudart.unregister(base + o) for o, _ in shares], device, cudart)
    return {"threads": len(shares), "register_s": wall, "register_gibs": nbytes / GIB / wall,
            "per_thread_s": own, "unregister_s": unwall, "unregister_gibs": nbytes / GIB / unwall}


def meminfo_kib(*keys: str) -> dict:
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                values[name] = int(rest.split()[0])
    return values


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def selected(policy: str | None) -> str | None:
    """The bracketed choice of a sysfs policy line such as 'always within_size advise [never] deny force'."""
    if policy and "[" in policy:
        return policy.split("[", 1)[1].split("]", 1)[0]
    return policy


def dev_shm_huge_option() -> str | None:
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[1] == "/dev/shm":
                for option in fields[3].split(","):
                    if option.startswith("huge="):
                        return option[len("huge="):]
                return None
    return None


def hugepage_allowed(kind: str, shmem_enabled: str | None, mount_huge: str | None) -> tuple[bool, str]:
    """Whether madvise(MADV_HUGEPAGE) can give this kind huge pages, and why (the kernel decides)."""
    policy = selected(shmem_enabled)
    if policy is None:
        return False, "no transparent huge pages in this kernel"
    if policy == "deny":
        return False, "shmem_enabled is deny"
    if kind == "memfd-hugepage" or policy == "force":
        return policy in ("always", "within_size", "advise", "force"), f"shmem_enabled is {policy}"
    if mount_huge is not None:  # a tmpfs mount's own huge= option governs its files
        return mount_huge in ("always", "within_size", "advise"), f"/dev/shm is mounted huge={mount_huge}"
    return policy != "never", f"/dev/shm has no huge= option; shmem_enabled is {policy}"


class Mapping:
    """A populated mapping of one kind, as a uint8 tensor over its memory."""

    def __init__(self, kind: str, nbytes: int, hugepage_size: int):
        self.kind, self.nbytes = kind, nbytes
        fd = -1
        if kind.startswith("shm"):
            path = f"/dev/shm/ts-host-register-{os.getpid()}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)  # the mapping keeps the memory; nothing is left behind if this process dies
        elif kind.startswith("memfd"):
            fd = os.memfd_create("ts-host-register")
        if fd >= 0:
            try:
                os.ftruncate(fd, nbytes)
                self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        else:
            self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if kind.endswith("hugepage"):
            self.map.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self.align = hugepage_size if kind.endswith("hugepage") else mmap.PAGESIZE
        before = meminfo_kib("ShmemHugePages", "AnonHugePages")
        start = time.perf_counter()
        self.tensor.fill_(0x5A)  # written once: every page is present before registering
        self.populate_s = time.perf_counter() - start
        after = meminfo_kib("ShmemHugePages", "AnonHugePages")
        self.huge_gib = sum(after[k] - before.get(k, 0) for k in after) / (1 << 20)

    def close(self) -> None:
        del self.tensor
        self.map.close()


def h2d_gbs(source: torch.Tensor, target: torch.Tensor, repeats: int) -> float:
    """Median GB/s of copy_(non_blocking=True) from host `source` into GPU `target`, timed by CUDA events."""
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(source.numel() / (start.elapsed_time(end) / 1000) / 1e9)
    return statistics.median(rates)


def empty_host_cache() -> None:
    """Gives torch's cached pinned blocks back (its host allocator keeps freed ones)."""
    release = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gib", default="1,8", help="comma-separated sizes, GiB (default 1,8)")
    parser.add_argument("--threads", default="1,2,4,8,16", help="registering threads to try (default 1,2,4,8,16)")
    parser.add_argument("--anon-threads", default="1,16", help="threads to try on anonymous memory (default 1,16)")
    parser.add_argument("--kinds", default="shm,shm-hugepage,anon",
                        help="any of shm, shm-hugepage, memfd-hugepage, anon (default shm,shm-hugepage,anon)")
    parser.add_argument("--copy-gib", type=float, default=1.0, help="bytes per H2D copy, GiB (at most the size)")
    parser.add_argument("--repeats", type=int, default=5, help="H2D copies per measurement (median)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    started = time.perf_counter()
    torch.cuda.set_device(args.device)
    torch.set_num_threads(os.cpu_count() or 1)
    cudart = Cudart()
    shmem_enabled, mount_huge = read(f"{THP}/shmem_enabled"), dev_shm_huge_option()
    hugepage_size = int(read(f"{THP}/hpage_pmd_size") or 2 << 20)
    results = {"host": platform.node(), "gpu": torch.cuda.get_device_name(args.device), "torch": torch.__version__,
               "cpus": os.cpu_count(), "cudart": cudart.path, "page_size": mmap.PAGESIZE,
               "thp_shmem_enabled": shmem_enabled, "thp_enabled": read(f"{THP}/enabled"),
               "dev_shm_huge": mount_huge, "hpage_pmd_size": hugepage_size,
               "register": [], "pinned_alloc": [], "h2d": [], "mappings": [], "skipped": []}
    rows = []
    for size_gib in [float(x) for x in args.sizes_gib.split(",") if x]:
        nbytes = int(size_gib * GIB)
        copy_bytes = min(nbytes, int(args.copy_gib * GIB))
        target = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")

        start = time.perf_counter()
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        alloc_s = time.perf_counter() - start
        results["pinned_alloc"].append({"size_gib": size_gib, "seconds": alloc_s, "gibs": size_gib / alloc_s})
        rows.append(("torch pinned alloc", size_gib, "", alloc_s, size_gib / alloc_s, ""))
        gbs = h2d_gbs(pinned[:copy_bytes], target, args.repeats)
        results["h2d"].append({"source": "torch pinned", "size_gib": size_gib, "copy_gib": copy_bytes / GIB,
                               "gbs": gbs})
        del pinned
        empty_host_cache()

        for kind in [k for k in args.kinds.split(",") if k]:
            if kind.endswith("hugepage"):
                allowed, why = hugepage_allowed(kind, shmem_enabled, mount_huge)
                if not allowed:
                    results["skipped"].append({"kind": kind, "size_gib": size_gib, "why": why})
                    continue
            if kind.startswith("shm") and os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize < nbytes:
                results["skipped"].append({"kind": kind, "size_gib": size_gib, "why": "/dev/shm is too small"})
                continue
            mapping = Mapping(kind, nbytes, hugepage_size)
            try:
                results["mappings"].append({"kind": kind, "size_gib": size_gib, "populate_s": mapping.populate_s,
                                            "huge_pages_gib": mapping.huge_gib, "align": mapping.align})
                for threads in ints(args.anon_threads if kind == "anon" else args.threads):
                    r = register_threads(mapping.address, nbytes, threads, mapping.align, cudart, args.device)
                    results["register"].append({"kind": kind, "size_gib": size_gib, **r})
                    rows.append((kind, size_gib, r["threads"], r["register_s"], r["register_gibs"],
                                 r["unregister_gibs"]))
                source = mapping.tensor[:copy_bytes]
                pageable = h2d_gbs(source, target, min(args.repeats, 3))
                cudart.register(mapping.address, nbytes)
                try:
                    registered = h2d_gbs(source, target, args.repeats)
                finally:
                    cudart.unregister(mapping.address)
                for state, gbs in (("pageable", pageable), ("registered", registered)):
                    results["h2d"].append({"source": f"{kind} {state}", "size_gib": size_gib,
                                           "copy_gib": copy_bytes / GIB, "gbs": gbs})
                del source  # a view of the mapping: it must go before the mapping can close
            finally:
                mapping.close()
        del target
        torch.cuda.empty_cache()
    results["seconds"] = time.perf_counter() - started

    print(f"THP shmem_enabled: {shmem_enabled}; /dev/shm huge={mount_huge}; enabled: {results['thp_enabled']}")
    print(f"{'memory':<20} {'GiB':>5} {'threads':>7} {'seconds':>8} {'register GiB/s':>15} {'unregister GiB/s':>17}")
    for kind, size, threads, seconds, gibs, ungibs in rows:
        un = f"{ungibs:17.2f}" if ungibs != "" else f"{'':17}"
        print(f"{kind:<20} {size:5g} {threads!s:>7} {seconds:8.3f} {gibs:15.2f} {un}")
    for m in results["mappings"]:
        print(f"populated {m['kind']} {m['size_gib']:g} GiB in {m['populate_s']:.2f} s, "
              f"{m['huge_pages_gib']:.2f} GiB in huge pages")
    print(f"{'H2D source':<26} {'GiB':>5} {'GB/s':>7}")
    for h in results["h2d"]:
        print(f"{h['source']:<26} {h['copy_gib']:5g} {h['gbs']:7.1f}")
    for s in results["skipped"]:
        print(f"skipped {s['kind']} {s['size_gib']:g} GiB: {s['why']}")
    print(f"total {results['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
