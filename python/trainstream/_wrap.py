"""wrap / unwrap / synchronize: the user-facing entry points."""

from __future__ import annotations

import atexit
import logging
import os
import random
import weakref

import torch

from trainstream import _blocks, _peers
from trainstream._C import TrainstreamError
from trainstream._connect import Client, connect
from trainstream._optimizer import OffloadedOptimizer
from trainstream._rank import Rank, default_job_name

_ranks: "weakref.WeakKeyDictionary[torch.nn.Module, Rank]" = weakref.WeakKeyDictionary()
_auto_named: list[Rank] = []


def _local_ranks(rank: int | None, world_size: int | None, job: str | None) -> tuple[int, int, str | None]:
    """Explicit arguments, else the data-parallel ranks of this node from torch.distributed: an
    initialized process group, or torchrun's environment (LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    if rank is not None or world_size is not None:
        return rank or 0, world_size or 1, job
    env = os.environ
    if "LOCAL_RANK" not in env or "LOCAL_WORLD_SIZE" not in env:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise TrainstreamError("torch.distributed is initialized but LOCAL_RANK/LOCAL_WORLD_SIZE are not set: "
                                   "pass rank= and world_size= (this node's ranks) to trainstream.wrap")
        return 0, 1, job
    local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    spans_nodes = int(env.get("WORLD_SIZE", local_world)) > local_world
    if job is None and (local_world > 1 or spans_nodes) and "TORCHELASTIC_RUN_ID" in env:
        if env["TORCHELASTIC_RUN_ID"] == "none":  # torchrun's default without --rdzv-id or --standalone
            raise TrainstreamError("torchrun's run id is 'none' (no --rdzv-id): every such run would be the job "
                                   "'torchrun-none' and resume the last one's state; pass job= to trainstream.wrap, "
                                   "or start torchrun with --rdzv-id=<unique id> or --standalone")
        job = f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    return local_rank, local_world, job


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, client: Client | None = None,
         job: str | None = None, rank: int | None = None, world_size: int | None = None,
         max_grad_norm: float | None = None,
         accumulation_steps: int = 1, bucket_mb: float = 32, moment_dtype: str = "float32",
         seed: int | None = None, peers: list[str] | None = None,
         node_rank: int | None = None, device: str | torch.device | None = None, param_offload=False,
         blocks=None, page_prefetch: int = 2,
         page_pool_mb: float | None = None, state_halves="auto",
         speculative_clipping="auto") -> tuple[torch.nn.Module, OffloadedOptimizer]:
    """Offloads `optimizer` (torch.optim.AdamW or Adam) of `model` to trainstreamd.

    Returns the same model, with hooks that stream gradients out during backward and bring new weights
    in before forward, and an optimizer that behaves as the torch one. `job` names the job in the
    daemon: ranks of one data-parallel job pass the same name, and a restarted process that passes it
    again resumes from the daemon's state. `rank`/`world_size` are this node's data-parallel ranks;
    by default they come from torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE (and the job name from its run
    id). The daemon averages the ranks' gradients: do not also wrap the model in
    DistributedDataParallel. `max_grad_norm` clips like torch.nn.utils.clip_grad_norm_
    (do not clip p.grad yourself: gradients leave during backward). With `accumulation_steps=k`, call
    optimizer.step() after every k backward passes. `peers` lists the peer-plane addresses
    ("host:port") of the job's daemons on every node, in node order, and `node_rank` is this node's
    index (defaults: $TRAINSTREAM_PEERS, comma-separated, and $TRAINSTREAM_NODE_RANK, torchrun's
    GROUP_RANK, or RANK // LOCAL_WORLD_SIZE); the daemons then all-reduce the node-summed gradients
    between them. Without `peers` and $TRAINSTREAM_PEERS, a torchrun job spanning several nodes
    (WORLD_SIZE > LOCAL_WORLD_SIZE) exchanges the daemons' advertised addresses through its
    torch.distributed store (the initialized process group's, else torchrun's agent store).

    Models whose weights do not fit on the GPU: `param_offload` pages the weights of the repeated
    block stack from the daemon's host memory to the GPU block by block (True: every block; a fraction
    in (0, 1]: that share of the blocks, the first ones; a list of block indices). `blocks` names the
    block modules (default: the longest nn.ModuleList of modules of one class, such as model.blocks or
    model.model.layers); parameters outside them stay on the GPU. `device` moves the model's other
    parameters and buffers there (build the model on the CPU: the paged blocks never need the GPU
    whole). The GPU holds `page_prefetch` + 1 blocks (or `page_pool_mb` MiB of them): the block computing
    now and the next ones, copied while it computes. Each paged weight crosses PCIe twice per step
    (forward and backward). Frozen parameters (requires_grad=False) of paged blocks, a LoRA base, are
    kept once in host memory in their dtype, with no optimizer state.

    The daemon keeps the optimizer state (master weights, moments, step counts) in `state_halves`
    copies: 2 commits every update by one atomic switch, so a job resumes exactly after its daemon
    or a trainer is killed, and enables speculative clipping; it costs 12 bytes per parameter more
    (8 with bf16 moments). 1 updates in place. "auto" (default): 2 where the daemon's memory allows.
    With `speculative_clipping` ("auto": where the job has two halves; True needs them) and
    `max_grad_norm`, each bucket's update starts as its gradients arrive, before the global norm is
    known, and steps that clip are redone exactly. A restarted process resumes after
    `optimizer.resume_step` optimizer steps (docs/usage.md, "Resuming").
    """
    if model in _ranks:
        raise TrainstreamError("this model is already wrapped; call trainstream.unwrap(model) first")
    peers, node_rank = _peers.resolve(peers, node_rank)
    from_store = not peers and _peers.env_node_count() > 1
    rank, world_size, job = _local_ranks(rank, world_size, job)
    if (world_size > 1 or len(peers) > 1 or from_store) and job is None:
        raise TrainstreamError("ranks of a job with world_size > 1 or several nodes must pass the same job name")
    paging = _blocks.plan_paging(model, [p for g in optimizer.param_groups for p in g["params"]], param_offload,
                                 blocks)
    if device is not None:
        device = _place(model, torch.device(device), paging.paged_ids if paging else set())
    elif paging is not None:
        resident = {p.device for p in model.parameters() if id(p) not in paging.paged_ids}
        if len(resident) != 1 or next(iter(resident)).type == "cpu":
            raise TrainstreamError(f"param_offload with the model's parameters on {sorted(map(str, resident))}: pass "
                                   "device= (where the blocks compute, e.g. device='cuda'); the paged weights are "
                                   "copied there block by block")
        device = next(iter(resident))
    client = client or connect()
    if from_store:
        peers = _peers.from_store(client, job, node_rank, rank)
    auto_named = job is None
    state = optimizer.state_dict() if optimizer.state else None
    r = Rank(client, model, optimizer, job=job or default_job_name(), rank=rank, world_size=world_size,
             max_grad_norm=max_grad_norm, accumulation_steps=accumulation_steps, bucket_mb=bucket_mb,
             moment_dtype=moment_dtype, seed=random.getrandbits(63) if seed is None else seed, peers=peers,
             node_rank=node_rank, paging=paging, device=device, page_prefetch=page_prefetch,
             page_pool_mb=page_pool_mb, state_halves=state_halves, speculative_clipping=speculative_clipping)
    _ranks[model] = r
    if auto_named:
        _auto_named.append(r)  # nobody can resume it: dropped when the process exits
    wrapped = OffloadedOptimizer(optimizer, r)
    if state is not None:
        wrapped.load_state_dict(state)  # an optimizer that already stepped keeps its moments
    return model, wrapped


def _place(model: torch.nn.Module, device: torch.device, paged: set[int]) -> torch.device:
    """Moves every parameter and buffer of `model` but the paged parameters to `device` (in place: the
    optimizer's parameters stay the same objects); paged parameters stay where they are until the job
    holds their weights."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and id(p) not in paged and p.device != device:
                    p.data = p.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)
    return device


def _rank_of(model: torch.nn.Module) -> Rank:
    r = _ranks.get(model)
    if r is None:
        raise TrainstreamError("this model is not wrapped by trainstream")
    return r


def synchronize(model: torch.nn.Module | None = None) -> None:
    """Waits for in-flight updates and makes the parameters show the latest weights (every wrapped
    model when `model` is None)."""
    for r in ([_rank_of(model)] if model is not None else list(_ranks.values())):
        r.synchronize()


def unwrap(model: torch.nn.Module, device: str | torch.device | None = None) -> torch.nn.Module:
    """Removes trainstream from `model` and returns it with its current weights. The job's state stays
    in the daemon (dropped if the job was auto-named). With the cuda-ipc transport the parameters move
    back into torch's allocator, which then needs room for them before their old buffer is freed.
    Paged weights (param_offload) come back on the CPU, or on `device` if given."""
    r = _rank_of(model)
    r.synchronize()
    if r.pager is not None:
        where = torch.device(device) if device is not None else torch.device("cpu")
        logging.getLogger("trainstream").info(
            "unwrap: the paged weights of %d block(s) come back on %s%s", len(r.paging.blocks), where,
            "" if device is not None else " (pass device= to bring them to the GPU)")
    r.close(drop=r in _auto_named, device=torch.device(device) if device is not None else None)
    if r in _auto_named:
        _auto_named.remove(r)
    del _ranks[model]
    return model


@atexit.register
def _drop_auto_named_jobs() -> None:
    for r in list(_auto_named):
        try:
            r.close(drop=True)
        except Exception:  # the daemon may be gone already; nothing to clean then
            pass
