"""A Rank's paged weights (`wrap(param_offload=...)`): the BlockPager and its hooks on the blocks, and the
job's host copies that stand for the paged parameters wherever the user sees them (model.state_dict(),
model.load_state_dict(), unwrap).

Invariants: a paged parameter is a placeholder on the GPU side except while its block is loaded (or, for
a load_state_dict, while torch writes into its host copy); a state dict's entry of a trainable paged
parameter is a copy (the daemon rewrites the host weights), that of a frozen one the job's own memory.
"""

from __future__ import annotations

import torch

from trainstream.paging.host_pins import HostPins
from trainstream.paging.pager import BlockPager, PagingHooks, WeightGate, block_copies


class PagedWeights:
    def __init__(self, plan, regions, params: list[torch.nn.Parameter], model: torch.nn.Module,
                 device: torch.device, gate: WeightGate, prefetch: int, pool_mb: float | None,
                 pin_job_regions: bool):
        """The paged parameters become placeholders (their memory is released), their host copies are
        page-locked in the background (GPU; with `pin_job_regions` the frozen ones only: the transport
        pinned the job's regions already), and the pager's hooks go onto the blocks."""
        self.plan, self.regions = plan, regions
        self._index = {id(p): i for i, p in enumerate(params)}
        copies = block_copies(plan, regions)
        pins = None
        if device.type == "cuda":
            groups = [[(t.data_ptr(), r.nbytes) for r in c.ranges if r.frozen or not pin_job_regions
                       for t in r.copies()] for c in copies]
            pins = HostPins(device.index or 0, groups)
        self.pager = BlockPager(copies, device, gate, prefetch, None if pool_mb is None else int(pool_mb * (1 << 20)),
                                pins)
        self.hooks = PagingHooks(self.pager, model)
        self.block_of = {id(t.param): c.index for c in copies for t in c.tensors}  # id(paged parameter) -> block
        self._names = [(name, p) for name, p in model.named_parameters(remove_duplicate=False)
                       if id(p) in self.block_of]

    def host_views(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each paged parameter with the job's host copy of its current weights in its model dtype (the
        master weights of one paged in autocast's dtype)."""
        views = [(p, self.regions.master_view(self._index[id(p)]) if id(p) in self.plan.paged_as else
                  self.regions.upload_view(self._index[id(p)])) for b in self.plan.blocks for p in b.trainable]
        return views + [(p, v) for (_, p), v in zip(self.plan.frozen, self.regions.frozen_views)]

    def fill_state_dict(self, state_dict: dict, prefix: str) -> None:
        """model.state_dict(): a paged parameter's entry is its host weights on the CPU: a copy of a
        trainable one's, the job's own memory for a frozen one (it never changes, and peft's adapter
        checkpoints take the state dict of a whole base they then drop)."""
        host = {id(p): v for p, v in self.host_views()}
        frozen = {id(p) for _, p in self.plan.frozen}
        for name, p in self._names:
            if prefix + name in state_dict:
                state_dict[prefix + name] = host[id(p)] if id(p) in frozen else host[id(p)].clone()

    def show_host_copies(self) -> None:
        """Before model.load_state_dict() writes into the parameters: every block leaves the GPU and each
        paged parameter becomes its host copy; the pager's release_all() after the load puts the
        placeholders back."""
        self.pager.evict_all()
        for p, view in self.host_views():
            p.data = view

    def close(self, device: torch.device | None) -> None:
        """Unhooks and closes the pager; the paged parameters get their current weights from the host
        copies: on the CPU, or on `device`."""
        self.hooks.remove()
        self.pager.close()
        with torch.no_grad():
            for p, host in self.host_views():
                p.data = host.to(device or "cpu", copy=True)
