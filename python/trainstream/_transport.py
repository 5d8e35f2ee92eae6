"""How gradients reach the job's host slots and new weights reach the parameters.

HostTransport  — parameters on the CPU: plain copies between the parameters and the segments.
CudaIpcTransport — parameters on a CUDA device, copied by the daemon (docs/architecture.md, "The
    cuda-ipc transport"): the parameters become views of one flat buffer allocated outside torch's
    allocator, completed
    buckets' gradients go into a few staging slots, and both are exported once by CUDA IPC handle,
    with interprocess events that order the daemon's copies after this process's kernels. Nothing is
    pinned in this process. The default for CUDA parameters. The forward does not wait for weights
    on the host: the compute stream waits on a host-mapped word per bucket that the session sets
    when the bucket's PARAMS_READY comes in (RankSession::MirrorParamsReady), so this thread goes on
    queuing kernels while the daemon updates (TRAINSTREAM_GPU_WAITS=0: wait on the host).
CudaCopyTransport — the fallback where the daemon cannot open IPC handles (another PID namespace, no
    driver in the daemon's view): parameters copied by this process: the rank's gradient region
    and the job's upload region are pinned (cudaHostRegister) and the copies run on a side CUDA
    stream, ordered against the compute stream by events, without any CPU wait. A
    bucket's GRAD_READY is sent by a sender thread once an event recorded after its copies has
    completed. The daemon needs no CUDA context for this transport (docs/architecture.md, "Repository layout").

Both keep the invariant of _rank.py: a slot is written only after the daemon released it, and the
upload region is read (by a copy that may still be queued) only until the daemon's next update of
that bucket, which cannot start before this rank's next gradients — queued after that copy.

Each implements `Transport`, the calls the Rank makes, and is built from no more than the job's
`Regions` (_regions.py), the session and the device: no transport sees the Rank.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid as _uuid
import warnings
from typing import Callable, Protocol

import torch

from trainstream import _C, _layout
from trainstream._C import TrainstreamError
from trainstream._regions import Regions
from trainstream.paging.host_pins import page_ranges


class Transport(Protocol):
    """What the Rank calls, in the order of a step; `i` is a parameter's index, `b` a bucket's."""

    name: str  # as the daemon logs it and stats() report it
    # Whether weights_in may run for a published bucket before its modules do, at no cost to the
    # forward. Not where it queues a GPU copy the compute stream then waits for (cuda-client-copy): taken
    # in at a forward's start, every published bucket would hold the first layer back.
    weights_in_early: bool
    # Whether wait_weights_on_gpu can queue every wait without this thread waiting (cuda-ipc, its words
    # mapped): the forward's start then queues them all (WeightReads.take_published).
    waits_on_gpu: bool
    # Whether it page-locks the job's upload region and fp32 master weights itself (cuda-client-copy):
    # weight paging then page-locks only the frozen weights.
    pins_job_regions: bool

    def open_bucket(self, b: int) -> None:
        """Before bucket b's first gradient of a micro-batch: returns once its last GRAD_READY has gone
        out (the Rank then waits for the daemon to free the slot)."""

    def grad_out(self, i: int, grad: torch.Tensor) -> None:
        """Backward: parameter i's complete gradient, for its slot; the Rank drops p.grad right after."""

    def bucket_done(self, b: int, send: Callable[..., None]) -> None:
        """Bucket b's gradients are all handed over: once they are in place, `send(slot=0, piece=0)`
        sends its GRAD_READY (once per staging slot and piece where the bucket goes in pieces)."""

    def step_done(self, step: int, weights_on_gpu: bool = False) -> None:
        """The weights of `step` are due (optimizer.step(), a load, an attach); `weights_on_gpu`: the
        parameters hold them already (this rank just loaded them from there)."""

    def wait_weights_on_gpu(self, b: int, step: int) -> bool:
        """Makes the current stream wait on the GPU for bucket b's weights of `step`; False: the caller
        waits for them on the host."""

    def weights_in(self, i: int) -> None:
        """Parameter i takes its new weights (its bucket's PARAMS_READY has come)."""

    def weights_done(self) -> None:
        """After a refresh's weights_in calls: the model may read what they brought."""

    def flush(self) -> None:
        """Waits until every bucket handed over has been sent (benchmarks time the backward with it)."""

    def close(self) -> None:
        """Unwrap: gives back what the transport holds; the parameters stay the model's."""


class HostTransport:
    name = "host"
    weights_in_early = True  # a copy on the trainer's thread, now or at the module's pre-hook
    waits_on_gpu = False
    pins_job_regions = False

    def __init__(self, regions: Regions):
        self.regions = regions

    def grad_out(self, i: int, grad: torch.Tensor) -> None:
        self.regions.grad_views[i].copy_(grad)

    def bucket_done(self, b: int, send) -> None:
        send()

    def open_bucket(self, b: int) -> None:
        pass

    def wait_weights_on_gpu(self, b: int, step: int) -> bool:
        return False

    def weights_in(self, i: int) -> None:
        self.regions.params[i].copy_(self.regions.upload_view(i))

    def weights_done(self) -> None:
        pass

    def step_done(self, step: int, weights_on_gpu: bool = False) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class CudaCopyTransport:
    name = "cuda-client-copy"
    weights_in_early = False
    waits_on_gpu = False
    pins_job_regions = True

    def __init__(self, regions: Regions, session, device: torch.device):
        self.regions = regions
        self.device = device
        self._registered = []
        for address, nbytes in _ranges_to_pin(regions, session):
            self._register(address, nbytes)
        # Copies run on a stream of their own, ordered against the compute stream by events, so the
        # transfers overlap with the forward and backward kernels instead of queueing behind them.
        self.copy_stream = torch.cuda.Stream(device)
        self._compute_done = None  # event: the last step's kernels that read the weights have run
        self._queue: queue.Queue = queue.Queue()
        self._sent: dict[int, threading.Event] = {}  # bucket -> its last GRAD_READY has been sent
        self._error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="trainstream-sender", daemon=True)
        self._sender.start()

    def _register(self, address: int, nbytes: int) -> None:
        code = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(code) != 0:
            raise TrainstreamError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(code)}")
        self._registered.append(address)

    def grad_out(self, i: int, grad: torch.Tensor) -> None:
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradient is complete
        with torch.cuda.stream(self.copy_stream):
            self.regions.grad_views[i].copy_(grad, non_blocking=True)
        grad.record_stream(self.copy_stream)  # not reused by the allocator before the copy has run

    def bucket_done(self, b: int, send) -> None:
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        self._raise_pending()
        self._sent[b] = threading.Event()
        self._queue.put((event, send, self._sent[b]))

    def open_bucket(self, b: int) -> None:
        """Waits until bucket b's last GRAD_READY has gone out (not the buckets queued after it, so
        the next bucket's copies are queued while earlier ones are still in flight)."""
        sent = self._sent.get(b)
        if sent is not None:
            sent.wait()
        self._raise_pending()

    def step_done(self, step: int, weights_on_gpu: bool = False) -> None:
        """optimizer.step(): new weights may overwrite the parameters once the queued kernels ran."""
        self._compute_done = torch.cuda.Event()
        self._compute_done.record(torch.cuda.current_stream(self.device))

    def wait_weights_on_gpu(self, b: int, step: int) -> bool:
        return False

    def weights_in(self, i: int) -> None:
        if self._compute_done is not None:
            self.copy_stream.wait_event(self._compute_done)
        with torch.cuda.stream(self.copy_stream):
            self.regions.params[i].copy_(self.regions.upload_view(i), non_blocking=True)

    def weights_done(self) -> None:
        """The compute stream waits (on the GPU) for the weights copied in so far."""
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, send, sent = item
            try:
                if self._error is None:
                    event.synchronize()
                    send()
            except BaseException as e:  # surfaced on the training thread at its next call
                self._error = e
            finally:
                sent.set()
                self._queue.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise TrainstreamError(f"sending gradients failed: {self._error}")

    def flush(self) -> None:
        """Waits until every queued bucket has been sent."""
        self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        self._queue.put(None)
        self._sender.join(timeout=10)
        torch.cuda.synchronize(self.device)  # no copy may still read or write the regions
        for address in self._registered:
            torch.cuda.cudart().cudaHostUnregister(address)
        self._registered.clear()


def _ranges_to_pin(regions: Regions, session) -> list[tuple[int, int]]:
    """What DMA touches, as page-aligned, disjoint (address, bytes) ranges: this rank's gradient
    region, the upload region, and the master weights of fp32 buckets (read in place), in both state
    halves if the job has two; not the rest of the master weights or the moments, which never cross
    PCIe."""
    s = session
    ranges = [(s.grads().address, s.grads().nbytes), (s.upload().address, s.upload().nbytes)]
    for master in {s.master(h).address for h in range(s.state_halves)}:
        ranges += [(master + 4 * b["elem_offset"], 4 * b["numel"]) for b in regions.buckets if b["dtype"] == 0]
    return page_ranges(ranges)


class CudaIpcTransport:
    name = "cuda-ipc"
    weights_in_early = True  # nothing to do: the daemon wrote them
    pins_job_regions = False
    _WANT_EVENTS = 2  # weights-wanted events, used in turn
    _SLOT_CAP = 32 << 20  # a bucket larger than a slot (a large embedding) is staged piece by piece

    def __init__(self, regions: Regions, session, device: torch.device):
        self.regions = regions
        self.device = device
        self.session = session
        self._bucket_bytes = [b["numel"] * _layout.torch_dtype(b["dtype"]).itemsize for b in regions.buckets]
        self.slot_bytes = _round_up(min(max(self._bucket_bytes, default=1), self._SLOT_CAP), 256)
        slots = staging_slots(sum(self._bucket_bytes))
        # Where each bucket lies in the flat parameter buffer: the resident ones one after another;
        # paged buckets (weight paging) have no place there, the pager brings them into its own slots.
        self._param_offsets, params_bytes = [], 0
        for b, size in enumerate(self._bucket_bytes):
            self._param_offsets.append(None if b in regions.paged_buckets else params_bytes)
            params_bytes += 0 if b in regions.paged_buckets else _round_up(size, 256)
        with torch.cuda.device(device):
            self._params_buffer = _C.GpuBuffer(device.index, max(params_bytes, 1))
            self._staging_buffer = _C.GpuBuffer(device.index, slots * self.slot_bytes)
            self._grad_ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            self._wanted = [torch.cuda.Event(interprocess=True) for _ in range(self._WANT_EVENTS)]
            uuid = _uuid.UUID(str(torch.cuda.get_device_properties(device).uuid)).bytes
            refusal = self.session.register_cuda_ipc(
                uuid, self._params_buffer.ipc_handle(), self._params_buffer.nbytes, self._staging_buffer.ipc_handle(),
                self.slot_bytes, [bytes(e.ipc_handle()) for e in self._grad_ready],
                [bytes(e.ipc_handle()) for e in self._wanted],
                [_NOT_ON_GPU if offset is None else offset for offset in self._param_offsets])
        if refusal:
            raise CudaIpcRefused(refusal)
        self.device_bytes = self._params_buffer.nbytes + self._staging_buffer.nbytes  # outside torch's allocator
        self._staging = torch.as_tensor(self._staging_buffer, device=device)
        self._rehome_parameters(torch.as_tensor(self._params_buffer, device=device))
        self._pending: dict[int, list[tuple[int, torch.Tensor]]] = {}  # bucket -> gradients not yet staged
        self._views: dict[tuple[int, int, int], list] = {}  # (bucket, piece, slot) -> _staging_views
        self._next_slot = 0
        self._wants = 0  # kWeightsWanted messages sent
        self.slot_wait_s = 0.0  # time backward spent waiting for a free staging slot (benchmarks read it)
        self.wanted_wait_s = 0.0  # time step() waited for the daemon to pass a weights-wanted event (ditto)
        self._ready_words = None  # per bucket, what the GPU waits on for its weights (wait_weights_on_gpu)
        # Not with weight paging: that combination has not run on a GPU yet.
        if os.environ.get("TRAINSTREAM_GPU_WAITS", "1") != "0" and not regions.paged_buckets:
            self._ready_words = _C.HostMappedWords(device.index, len(regions.buckets))
            session.mirror_params_ready(self._ready_words)
        self.waits_on_gpu = self._ready_words is not None

    def _rehome_parameters(self, flat: torch.Tensor) -> None:
        """Every resident parameter becomes a view of the flat buffer at its bucket's offset, keeping its
        values."""
        with torch.no_grad():
            for i, p in enumerate(self.regions.params):
                offset = self._param_offsets[self.regions.param_layout[i][0]]
                if offset is None:
                    continue
                start = offset + self._byte_offset(i)
                view = flat[start:start + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p.detach())
                p.data = view

    def _byte_offset(self, i: int) -> int:
        """Where parameter i starts inside its bucket, in bytes."""
        return self.regions.param_layout[i][1] * self.regions.dtypes[i].itemsize

    def grad_out(self, i: int, grad: torch.Tensor) -> None:
        """Kept until the bucket is complete: slots hold whole buckets, so none waits for a half one."""
        self._pending.setdefault(self.regions.param_layout[i][0], []).append((i, grad))

    def bucket_done(self, b: int, send) -> None:
        """The bucket's gradients go out in slot-sized pieces, each in the next free slot."""
        grads = dict(self._pending.pop(b, []))
        stream = torch.cuda.current_stream(self.device)
        for piece in range(max(1, -(-self._bucket_bytes[b] // self.slot_bytes))):
            slot = self._free_slot()
            copy_to_staging(self._staging_views(b, piece, slot), grads)
            self._grad_ready[slot].record(stream)
            send(slot, piece)

    def _staging_views(self, b: int, piece: int, slot: int) -> list[tuple[int, slice | None, torch.Tensor]]:
        """staging_views of bucket b's piece in slot `slot`, built on first use: slicing 75 parameters'
        gradients into bytes cost the 124M's backward about 300 torch calls a step."""
        key = (b, piece, slot)
        if (views := self._views.get(key)) is None:
            start = piece * self.slot_bytes
            end = min(start + self.slot_bytes, self._bucket_bytes[b])
            places = [(i, self._byte_offset(i), self.regions.param_layout[i][2], self.regions.dtypes[i],
                       self.regions.params[i].shape) for i in self.regions.bucket_params[b]]
            views = self._views[key] = staging_views(self._staging[slot * self.slot_bytes:], start, end, places)
        return views

    def _free_slot(self) -> int:
        """The next slot in turn, once the daemon has copied out what it held."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._grad_ready)
        started = time.perf_counter()
        self.session.wait_staging_free(slot)
        self.slot_wait_s += time.perf_counter() - started
        return slot

    def open_bucket(self, b: int) -> None:
        pass

    def wait_weights_on_gpu(self, b: int, step: int) -> bool:
        """The forward's thread queues on, its kernels wait on the GPU. The 124M GPT's forced offload
        waited 10-11 ms a step on the host at the tied embedding, whose update is the last, while this
        thread, the step's limit there, queued nothing: 59-68 ms a step, 51-56 ms with this (one H100
        machine, 2026-12-05, benchmarks/results/train_gpt.md)."""
        if self._ready_words is None:
            return False
        value = self.session.expect_params_ready(b, step)
        if value is None:
            return False
        if value:
            self._ready_words.queue_wait(torch.cuda.current_stream(self.device).cuda_stream, b, value)
        return True

    def weights_in(self, i: int) -> None:
        pass  # the daemon wrote them, and its PARAMS_READY comes after the copy completed

    def weights_done(self) -> None:
        pass

    def step_done(self, step: int, weights_on_gpu: bool = False) -> None:
        """The daemon may write the weights of `step` once the kernels queued so far have run;
        `weights_on_gpu`: the parameters hold them already (this rank just loaded them from there)."""
        n = self._wants
        if n >= self._WANT_EVENTS:  # its event's previous use must have been waited for
            started = time.perf_counter()
            self.session.wait_weights_wanted_waits(n - self._WANT_EVENTS + 1)
            self.wanted_wait_s += time.perf_counter() - started
        event = n % self._WANT_EVENTS
        self._wanted[event].record(torch.cuda.current_stream(self.device))
        self.session.send_weights_wanted(step, event, weights_on_gpu)
        self._wants += 1

    def flush(self) -> None:
        """Waits until the daemon has copied every staging slot out."""
        for slot in range(len(self._grad_ready)):
            self.session.wait_staging_free(slot)

    def close(self) -> None:
        """The parameters move back into torch's memory: the flat buffer goes with this transport."""
        torch.cuda.synchronize(self.device)
        with torch.no_grad():
            for i, p in enumerate(self.regions.params):
                if self._param_offsets[self.regions.param_layout[i][0]] is not None:
                    p.data = p.data.clone()
        self._pending.clear()


_NOT_ON_GPU = (1 << 64) - 1  # a paged bucket's offset in the flat parameter buffer (shm::kNotOnGpu)


def staging_views(slot: torch.Tensor, start: int, end: int, places) -> list[tuple[int, slice | None, torch.Tensor]]:
    """Where a bucket's bytes [start, end) go in `slot` (bytes, the piece's first at its byte 0): for each
    parameter of `places` (index, byte offset in the bucket, elements, dtype, shape) overlapping the
    piece, (index, the part of its flattened elements there or None for all, the view of `slot` that
    part goes to, shaped like the parameter when whole)."""
    views = []
    for i, first, numel, dtype, shape in places:
        nbytes = numel * dtype.itemsize
        lo, hi = max(first, start), min(first + nbytes, end)
        if lo < hi:
            view = slot[lo - start:hi - start].view(dtype)
            whole = hi - lo == nbytes
            part = None if whole else slice((lo - first) // dtype.itemsize, (hi - first) // dtype.itemsize)
            views.append((i, part, view.view(shape) if whole else view))
    return views


def copy_to_staging(views: list[tuple[int, slice | None, torch.Tensor]], grads: dict[int, torch.Tensor]) -> None:
    """Copies the gradients (parameter index -> gradient; a missing one is skipped) into the staging views
    staging_views gave for one piece, in a few batched kernels rather than a launch per parameter."""
    into, out_of = [], []
    for i, part, view in views:
        if (grad := grads.get(i)) is not None:
            into.append(view)
            out_of.append(grad if part is None else grad.reshape(-1)[part])
    if into:
        torch._foreach_copy_(into, out_of)


class CudaIpcRefused(TrainstreamError):
    """The daemon cannot reach this process's GPU memory (the message says why)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# cuda-ipc's defaults, by the bytes of a step's gradients. The 124M GPT's forced offload (0.47 GiB of
# gradients) on H100s: 4 slots 42.2-43.2 ms a step in five runs (13 ms of it waiting for a free slot), 16
# slots 38.2 ms; in a later call 34.1-34.9 against 32.4-33.4 ms (benchmarks/results/train_gpt.md,
# 2026-12-05 and 2026-12-06). The 1.86B (7 GiB of gradients) at its 24 GiB cap ran out of GPU memory with
# 16 slots (384 MiB more outside torch's allocator) and fits with 4: a large model's GPU memory is the
# scarcer resource.
STAGING_SLOTS = 16
STAGING_SLOTS_LARGE = 4
LARGE_GRADIENTS_BYTES = 1 << 30
MAX_STAGING_SLOTS = 64  # as many grad-ready events as the daemon opens (cuda_rank_transfer.cpp's kMaxEvents)


def staging_slots(gradient_bytes: int = 0) -> int:
    """cuda-ipc's gradient staging slots: $TRAINSTREAM_STAGING_SLOTS, else STAGING_SLOTS for a step's
    gradients of up to LARGE_GRADIENTS_BYTES and STAGING_SLOTS_LARGE above."""
    value = os.environ.get("TRAINSTREAM_STAGING_SLOTS")
    if value is None:
        return STAGING_SLOTS if gradient_bytes <= LARGE_GRADIENTS_BYTES else STAGING_SLOTS_LARGE
    slots = int(value) if value.strip().isdigit() else 0
    if not 1 <= slots <= MAX_STAGING_SLOTS:
        raise TrainstreamError(f"TRAINSTREAM_STAGING_SLOTS={value!r}: a whole number of GPU staging slots from 1 "
                               f"to {MAX_STAGING_SLOTS}")
    return slots


def transport_name(device: torch.device) -> str:
    """The transport for parameters on `device`, named before attaching (the daemon logs it)."""
    if device.type == "cpu":
        return HostTransport.name
    if device.type != "cuda":
        raise TrainstreamError(f"parameters on {device} are not supported (cpu or cuda)")
    wanted = os.environ.get("TRAINSTREAM_TRANSPORT", CudaIpcTransport.name)
    if wanted not in (CudaIpcTransport.name, CudaCopyTransport.name):
        raise TrainstreamError(f"TRAINSTREAM_TRANSPORT={wanted!r}: use {CudaIpcTransport.name!r} or "
                               f"{CudaCopyTransport.name!r}")
    if wanted == CudaIpcTransport.name:
        staging_slots()  # a bad count is refused before the job is attached
    return wanted


def describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    properties = torch.cuda.get_device_properties(device)
    return f"{device} ({properties.name}, GPU-{properties.uuid})"


def transport_for(regions: Regions, session, device: torch.device) -> Transport:
    name = transport_name(device)
    if name == HostTransport.name:
        return HostTransport(regions)
    if name == CudaIpcTransport.name:
        try:
            return CudaIpcTransport(regions, session, device)
        except CudaIpcRefused as refusal:
            warnings.warn(f"trainstream: the daemon cannot copy this process's GPU data ({refusal}); "
                          "this process copies it instead (cuda-client-copy)", RuntimeWarning, stacklevel=3)
    return CudaCopyTransport(regions, session, device)
