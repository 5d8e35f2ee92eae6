"""How gradients reach the job's host slots and new weights reach the parameters.

HostTransport  — parameters on the CPU: plain copies between the parameters and the segments.
CudaCopyTransport — parameters on a CUDA device, copied by this process: the rank's gradient region
    and the job's upload region are pinned (cudaHostRegister) and the copies run on a side CUDA
    stream, ordered against the compute stream by events, without any CPU wait. A
    bucket's GRAD_READY is sent by a sender thread once an event recorded after its copies has
    completed. The daemon needs no CUDA context for this transport (DESIGN.md "Fallback").

Both keep the invariant of _rank.py: a slot is written only after the daemon released it, and the
upload region is read (by a copy that may still be queued) only until the daemon's next update of
that bucket, which cannot start before this rank's next gradients — queued after that copy.
"""

from __future__ import annotations

import queue
import threading

import torch

from trainstream._C import TrainstreamError


class HostTransport:
    name = "host"

    def __init__(self, rank):
        self.rank = rank

    def grad_out(self, i: int, grad: torch.Tensor) -> None:
        self.rank.grad_views[i].copy_(grad)

    def bucket_done(self, b: int, send) -> None:
        send()

    def wait_sent(self, b: int) -> None:
        pass

    def weights_in(self, i: int) -> None:
        self.rank.params[i].copy_(self.rank.upload_views[i])

    def weights_done(self) -> None:
        pass

    def step_done(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class CudaCopyTransport:
    name = "cuda-client-copy"

    def __init__(self, rank, device: torch.device):
        self.rank = rank
        self.device = device
        self._registered = []
        for address, nbytes in _ranges_to_pin(rank):
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
            self.rank.grad_views[i].copy_(grad, non_blocking=True)
        grad.record_stream(self.copy_stream)  # not reused by the allocator before the copy has run

    def bucket_done(self, b: int, send) -> None:
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        self._raise_pending()
        self._sent[b] = threading.Event()
        self._queue.put((event, send, self._sent[b]))

    def wait_sent(self, b: int) -> None:
        """Waits until bucket b's last GRAD_READY has gone out (not the buckets queued after it, so
        the next bucket's copies are queued while earlier ones are still in flight)."""
        sent = self._sent.get(b)
        if sent is not None:
            sent.wait()
        self._raise_pending()

    def step_done(self) -> None:
        """optimizer.step(): new weights may overwrite the parameters once the queued kernels ran."""
        self._compute_done = torch.cuda.Event()
        self._compute_done.record(torch.cuda.current_stream(self.device))

    def weights_in(self, i: int) -> None:
        if self._compute_done is not None:
            self.copy_stream.wait_event(self._compute_done)
        with torch.cuda.stream(self.copy_stream):
            self.rank.params[i].copy_(self.rank.upload_views[i], non_blocking=True)

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


_PAGE = 4096


def _ranges_to_pin(rank) -> list[tuple[int, int]]:
    """What DMA touches, as page-aligned, disjoint (address, bytes) ranges: this rank's gradient
    region, the upload region, and the master weights of fp32 buckets (read in place); not the rest of
    the master weights or the moments, which never cross PCIe."""
    s = rank.session
    ranges = [(s.grads().address, s.grads().nbytes), (s.upload().address, s.upload().nbytes)]
    master = s.master().address
    ranges += [(master + 4 * b["elem_offset"], 4 * b["numel"]) for b in rank.buckets if b["dtype"] == 0]
    pages = sorted((a // _PAGE * _PAGE, -(-(a + n) // _PAGE) * _PAGE) for a, n in ranges if n)
    merged: list[list[int]] = []
    for start, end in pages:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


_TRANSPORTS = {"cpu": HostTransport, "cuda": CudaCopyTransport}


def transport_name(device: torch.device) -> str:
    """The transport for parameters on `device`, named before attaching (the daemon logs it)."""
    if device.type not in _TRANSPORTS:
        raise TrainstreamError(f"parameters on {device} are not supported (cpu or cuda)")
    return _TRANSPORTS[device.type].name


def describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    properties = torch.cuda.get_device_properties(device)
    return f"{device} ({properties.name}, GPU-{properties.uuid})"


def transport_for(rank, device: torch.device):
    return HostTransport(rank) if device.type == "cpu" else CudaCopyTransport(rank, device)
