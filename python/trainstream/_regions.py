"""The job's shared-memory regions, as torch views over them, and where each parameter lies in them.

`Regions` maps what the daemon's `attach` laid out: the buckets and each parameter's place (bucket,
offset, elements); the job's master weights, moments, per-parameter step counts and this rank's
gradient presence flags; each parameter's slot in this rank's gradient region (`grad_views`: for
a paged block's 16-bit parameter of a job with one rank, its upload copy) and
the new weights it takes (`upload_view`: the master weights themselves for float32 parameters).
It only maps: who writes a view when is the step protocol's (_rank.py) and the transports' business.

With two state halves (the daemon double-buffers master weights, moments and step counts), a
bucket's state is in the half its last committed step went to: master_view, moment_views,
param_step, upload_view (float32) and bucket_weights give that half, looked up when called, so take
them when they are read (after the bucket's PARAMS_READY), not ahead. The daemon writes the other
half only once every rank's next gradients of the bucket are in.

Invariant: the views are the shared memory itself (no copies), shaped and typed as the parameters;
each holds its region, and a region its session, so the mapping outlives every view.
"""

from __future__ import annotations

import torch

from trainstream import _layout


class Regions:
    def __init__(self, session, params: list[torch.nn.Parameter], dtypes: list[torch.dtype],
                 moment_dtype: torch.dtype, frozen: list[torch.nn.Parameter] = ()):
        """`dtypes`: the dtype the job keeps each parameter's weights and gradients in
        (PagingPlan.job_dtype, paging/blocks.py: its own, or autocast's for a float32 weight paged in it)."""
        self.params = params
        self.dtypes = dtypes
        self.session = session
        self.halves = session.state_halves
        self.buckets = session.buckets
        self.param_layout = session.params  # per parameter: (bucket, element offset in it, elements)
        self.bucket_of = [b for (b, _, _) in self.param_layout]
        self.bucket_params = [bucket["params"] for bucket in self.buckets]
        # Buckets of paged blocks (partition > 0): their weights reach the GPU through the pager, not
        # the transport.
        self.paged_buckets = {b for b, bucket in enumerate(self.buckets) if bucket["partition"]}
        grads, upload = _bytes(session.grads()), _bytes(session.upload())
        self._upload = upload
        self._frozen = _bytes(session.frozen())
        self.frozen_offsets = session.frozen_offsets  # bytes into the frozen region, per frozen parameter
        self.frozen_views = [self._frozen[start:start + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                             for start, p in zip(self.frozen_offsets, frozen)]
        # Per parameter: 1 once it has its gradient of this micro-batch. A memoryview, not a tensor: the
        # gradient hooks read and write one flag at a time, 0.1 us a store against 2 us for a tensor's
        # (the dev box), three times per parameter and step.
        self.presence = memoryview(session.presence())
        # Per state half (with one half, both name the same memory).
        self._steps = [_bytes(session.param_steps(h)).view(torch.int64) for h in (0, 1)]
        self._master = [_bytes(session.master(h)).view(torch.float32) for h in (0, 1)]
        self._exp_avg = [_bytes(session.exp_avg(h)).view(moment_dtype) for h in (0, 1)]
        self._exp_avg_sq = [_bytes(session.exp_avg_sq(h)).view(moment_dtype) for h in (0, 1)]
        self.grad_views, self._upload_views, self.elem_ranges = [], [], []
        for i, (p, dtype) in enumerate(zip(params, self.dtypes)):
            bucket_index, offset, numel = self.param_layout[i]
            bucket = self.buckets[bucket_index]
            first = bucket["elem_offset"] + offset
            self.elem_ranges.append((first, first + numel))
            size = dtype.itemsize
            # A paged 16-bit bucket of a job with one rank takes its gradients in its upload copy
            # (shm/job_layout.h says when and why).
            in_upload = bucket["grads_in_upload"]
            region, base = (upload, bucket["upload_offset"]) if in_upload else (grads, bucket["grad_offset"])
            start = base + offset * size
            self.grad_views.append(region[start:start + numel * size].view(dtype).view(p.shape))
            if dtype == torch.float32:  # the new weights are the master weights themselves (upload_view)
                self._upload_views.append(None)
            else:
                start = bucket["upload_offset"] + offset * size
                self._upload_views.append(upload[start:start + numel * size].view(dtype).view(p.shape))

    def _half(self, i: int) -> int:
        """The state half of parameter i's bucket's last committed step."""
        return self.session.committed_half(self.bucket_of[i])

    def master_view(self, i: int) -> torch.Tensor:
        first, last = self.elem_ranges[i]
        return self._master[self._half(i)][first:last].view(self.params[i].shape)

    def moment_views(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, last = self.elem_ranges[i]
        shape, half = self.params[i].shape, self._half(i)
        return self._exp_avg[half][first:last].view(shape), self._exp_avg_sq[half][first:last].view(shape)

    def upload_view(self, i: int) -> torch.Tensor:
        """The new weights parameter i takes, in its job dtype: its bucket's upload copy (16-bit), or its
        master weights (float32)."""
        view = self._upload_views[i]
        return self.master_view(i) if view is None else view

    def bucket_weights(self, b: int, half: int | None = None) -> torch.Tensor:
        """The bytes bucket b's new weights are read from, in its dtype's layout: the upload region of a
        16-bit bucket, the master weights of an fp32 one (in its committed half, or in `half`)."""
        bucket = self.buckets[b]
        if bucket["dtype"] == 0:
            first = bucket["elem_offset"]
            half = self.session.committed_half(b) if half is None else half
            return self._master[half][first:first + bucket["numel"]].view(torch.uint8)
        size = torch.empty(0, dtype=_layout.torch_dtype(bucket["dtype"])).element_size()
        return self._upload[bucket["upload_offset"]:bucket["upload_offset"] + bucket["numel"] * size]

    def bucket_weight_copies(self, b: int) -> list[torch.Tensor]:
        """Every place bucket b's weights are read from over training, for page-locking: both halves of an
        fp32 bucket's master weights with two state halves."""
        if self.buckets[b]["dtype"] == 0 and self.halves == 2:
            return [self.bucket_weights(b, 0), self.bucket_weights(b, 1)]
        return [self.bucket_weights(b)]

    def frozen_bytes(self, first: int, last: int) -> torch.Tensor:
        """The frozen region's bytes from frozen parameter `first` to the end of `last - 1`."""
        tail = self.frozen_views[last - 1]
        end = self.frozen_offsets[last - 1] + tail.numel() * tail.element_size()
        return self._frozen[self.frozen_offsets[first]:end]

    def param_step(self, i: int) -> int:
        return int(self._steps[self._half(i)][i])

    def set_param_step(self, i: int, steps: int) -> None:
        self._steps[self._half(i)][i] = steps


def _bytes(region) -> torch.Tensor:
    """A shared-memory region as a uint8 tensor (torch.frombuffer refuses empty buffers)."""
    return torch.frombuffer(region, dtype=torch.uint8) if region.nbytes else torch.empty(0, dtype=torch.uint8)
