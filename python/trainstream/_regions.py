"""The job's shared-memory regions, as torch views over them, and where each parameter lies in them.

`Regions` maps what the daemon's `attach` laid out: the buckets and each parameter's place (bucket,
offset, elements); the job's master weights, moments, per-parameter step counts and this rank's
gradient presence flags; each parameter's slot in this rank's gradient region (`grad_views`) and
the new weights it takes (`upload_views`: the master weights themselves for float32 parameters).
It only maps: who writes a view when is the step protocol's (_rank.py) and the transports' business.

Invariant: the views are the shared memory itself (no copies), shaped and typed as the parameters;
each holds its region, and a region its session, so the mapping outlives every view.
"""

from __future__ import annotations

import torch

from trainstream import _layout


class Regions:
    def __init__(self, session, params: list[torch.nn.Parameter], moment_dtype: torch.dtype,
                 frozen: list[torch.nn.Parameter] = ()):
        self.params = params
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
        self.presence = _bytes(session.presence())  # per parameter: 1 once it has its gradient of this micro-batch
        self._steps = _bytes(session.param_steps()).view(torch.int64)
        self._master = _bytes(session.master()).view(torch.float32)
        self._exp_avg = _bytes(session.exp_avg()).view(moment_dtype)
        self._exp_avg_sq = _bytes(session.exp_avg_sq()).view(moment_dtype)
        self.grad_views, self.upload_views, self.elem_ranges = [], [], []
        for i, p in enumerate(params):
            bucket_index, offset, numel = self.param_layout[i]
            bucket = self.buckets[bucket_index]
            first = bucket["elem_offset"] + offset
            self.elem_ranges.append((first, first + numel))
            start = bucket["grad_offset"] + offset * p.element_size()
            self.grad_views.append(grads[start:start + numel * p.element_size()].view(p.dtype).view(p.shape))
            if p.dtype == torch.float32:  # the new weights are the master weights themselves
                self.upload_views.append(self.master_view(i))
            else:
                start = bucket["upload_offset"] + offset * p.element_size()
                self.upload_views.append(upload[start:start + numel * p.element_size()].view(p.dtype).view(p.shape))

    def master_view(self, i: int) -> torch.Tensor:
        first, last = self.elem_ranges[i]
        return self._master[first:last].view(self.params[i].shape)

    def moment_views(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, last = self.elem_ranges[i]
        shape = self.params[i].shape
        return self._exp_avg[first:last].view(shape), self._exp_avg_sq[first:last].view(shape)

    def bucket_weights(self, b: int) -> torch.Tensor:
        """The bytes bucket b's new weights are read from, in its dtype's layout: the upload region of a
        16-bit bucket, the master weights of an fp32 one."""
        bucket = self.buckets[b]
        if bucket["dtype"] == 0:
            first = bucket["elem_offset"]
            return self._master[first:first + bucket["numel"]].view(torch.uint8)
        size = torch.empty(0, dtype=_layout.torch_dtype(bucket["dtype"])).element_size()
        return self._upload[bucket["upload_offset"]:bucket["upload_offset"] + bucket["numel"] * size]

    def frozen_bytes(self, first: int, last: int) -> torch.Tensor:
        """The frozen region's bytes from frozen parameter `first` to the end of `last - 1`."""
        tail = self.frozen_views[last - 1]
        end = self.frozen_offsets[last - 1] + tail.numel() * tail.element_size()
        return self._frozen[self.frozen_offsets[first]:end]

    def param_step(self, i: int) -> int:
        return int(self._steps[i])

    def set_param_step(self, i: int, steps: int) -> None:
        self._steps[i] = steps


def _bytes(region) -> torch.Tensor:
    """A shared-memory region as a uint8 tensor (torch.frombuffer refuses empty buffers)."""
    return torch.frombuffer(region, dtype=torch.uint8) if region.nbytes else torch.empty(0, dtype=torch.uint8)
