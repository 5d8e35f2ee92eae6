"""wrap / unwrap / synchronize: the user-facing entry points, and what a wrapped model is made of.

Each wrapped model has a `Wrapped` record: the optimizer `wrap` returned (an OffloadedOptimizer), how to
attach a Rank of its job again (after a conversion of the model, `_relayout`), and the automatic modes that
watch it (offload="auto", activation_offload). The optimizer's state is in the daemon while
`optimizer.offloaded`, else in a stock torch optimizer: with offload=False, after auto's switch, after
unwrap (`_leave_daemon`).

Invariants: a model is in `_wrapped` from wrap to unwrap; while its optimizer is offloaded, the Rank's hooks
are on the model and its job holds the state; once the optimizer left the daemon, no hook of the Rank is
left and the job is gone from the daemon (or kept for resuming, after an unwrap of a named job).
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import random
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from trainstream import _clipping, _compile, _layout
from trainstream._C import TrainstreamError
from trainstream._connect import Client, check_wait_timeout, connect
from trainstream._guards import Conversion
from trainstream._job_options import check_accumulation_steps, check_max_grad_norm, default_job_name
from trainstream._optimizer import OffloadedOptimizer
from trainstream._rank import Rank
from trainstream._watched import internal
from trainstream.activations.offload import ActivationOffload
from trainstream.activations.offload import check as check_activation_offload
from trainstream.distributed import group as _distributed
from trainstream.distributed import peers as _peers
from trainstream.fallback.offload_auto import AutoOffload
from trainstream.fallback.stock import StockOptimizer
from trainstream.paging import blocks as _blocks

log = logging.getLogger("trainstream")
OFFLOAD_CHOICES = ("auto", True, False)


@dataclass
class Wrapped:
    model: torch.nn.Module
    optimizer: OffloadedOptimizer
    attach: Callable[..., Rank] | None  # a Rank of the job for the model's current parameters
    auto_named: bool                    # nobody can resume the job: it is dropped when left
    ranks: int                          # the job's data-parallel ranks, all nodes'
    max_grad_norm: float | None
    activations: ActivationOffload | None = None
    own_client: bool = False  # wrap() connected (or started a private daemon) itself: no caller holds the client


_wrapped: "weakref.WeakKeyDictionary[torch.nn.Module, Wrapped]" = weakref.WeakKeyDictionary()


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, client: Client | None = None,
         job: str | None = None, rank: int | None = None, world_size: int | None = None,
         max_grad_norm: float | None = None,
         accumulation_steps="auto", bucket_mb: float = 32, moment_dtype: str = "float32",
         seed: int | None = None, peers: list[str] | None = None,
         node_rank: int | None = None, device: str | torch.device | None = None, param_offload=False,
         blocks=None, page_prefetch: int = 2,
         page_pool_mb: float | None = None, page_dtype: str | None = None, offload=True, activation_offload=False,
         distributed="auto", wait_timeout: float | None = None, state_halves="auto",
         speculative_clipping="auto") -> tuple[torch.nn.Module, OffloadedOptimizer]:
    """Offloads `optimizer` (torch.optim.AdamW or Adam) of `model` to trainstreamd.

    Returns the same model, with hooks that stream gradients out during backward and bring new weights
    in before forward, and an optimizer that behaves as the torch one. `job` names the job in the
    daemon: ranks of one data-parallel job pass the same name, and a restarted process that passes it
    again resumes from the daemon's state. `rank`/`world_size` are this node's data-parallel ranks;
    by default they come from torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE (and the job name from its run
    id), else, with `distributed="auto"` (the default) or True, from an initialized torch.distributed
    process group of more than one rank: the ranks agree on the node-local ranks, the nodes and the job
    name over it (see distributed/group.py); `distributed=False` ignores both. The daemon averages the ranks'
    gradients: do not also wrap the model in DistributedDataParallel. The training loop stays as it is:
    gradients leave during backward, and the backward passes between two optimizer.step() calls are
    summed (`accumulation_steps="auto"`; a number k says every step has k, which a step's update can then
    start during its last backward pass from the first step on), torch.nn.utils.clip_grad_norm_ on the
    model's parameters clips the step in the daemon and returns its norm, zero_grad() before step() drops
    the step's gradients, and a torch.amp.GradScaler steps it as it steps torch's fused optimizers.
    `max_grad_norm` clips every step like clip_grad_norm_ (then the loop need not). `peers` lists the
    peer-plane addresses ("host:port") of the job's daemons on every node, in node order, and `node_rank`
    is this node's index (defaults: $TRAINSTREAM_PEERS, comma-separated, and $TRAINSTREAM_NODE_RANK,
    torchrun's GROUP_RANK, or RANK // LOCAL_WORLD_SIZE); the daemons then all-reduce the node-summed
    gradients between them. Without `peers` and $TRAINSTREAM_PEERS, a job spanning several nodes
    exchanges the daemons' advertised addresses through its torch.distributed store (the initialized
    process group's, else torchrun's agent store).

    `offload`: True (the default) keeps the optimizer state in the daemon; "auto" measures the first 2
    steps offloaded and, when stock fused AdamW fits on the device (its state, the gradients and the
    measured peak, with a margin), moves the state into a `torch.optim.AdamW(fused=True)` over the same
    param groups and drops the daemon's job; the returned optimizer stays the same object (schedulers,
    hooks, state_dict) and keeps clipping and clearing p.grad after each step; False runs that stock
    optimizer from the start, without a daemon.

    Models whose weights do not fit on the GPU: `param_offload` pages the weights of the repeated
    block stack from the daemon's host memory to the GPU block by block (True: every block; a fraction
    in (0, 1]: that share of the blocks, the first ones; a list of block indices; "auto": the fewest
    first blocks that leave the resident blocks within half of the GPU memory available, none when they
    fit). `blocks` names the block modules (default: the longest nn.ModuleList of modules of one class,
    such as model.blocks or model.model.layers); parameters outside them stay on the GPU. `device` moves
    the model's other parameters and buffers there (build the model on the CPU: the paged blocks never
    need the GPU whole). The GPU holds `page_prefetch` + 1 blocks (or `page_pool_mb` MiB of them): the
    block computing now and the next ones, copied while it computes. Each paged weight crosses PCIe
    twice per step (forward and backward). Frozen parameters (requires_grad=False) of paged blocks, a
    LoRA base, are kept once in host memory in their dtype, with no optimizer state. `page_dtype`
    ("bfloat16" or "float16") pages the float32 weights and biases of the paged blocks' nn.Linear layers
    in that dtype, for forwards under torch.autocast of it (which casts them so anyway): half the bytes
    across PCIe and through host memory, the same results; their fp32 master weights stay in the daemon
    (state dicts hold them), and on the GPU they show as tensors of that dtype. A paged block's forward
    without that autocast is refused.

    `activation_offload` runs the model's forward inside trainstream.activation_paging(): True pages
    every saved activation, a fraction in (0, 1] that share of the bytes the first step saved, "auto"
    the smallest share that fits the GPU memory available, measured in the first step.

    Every wait for the daemon or the other ranks (a forward waiting for new weights, say) wakes for
    Ctrl-C (KeyboardInterrupt) and gives up after `wait_timeout` seconds without progress (default
    $TRAINSTREAM_WAIT_TIMEOUT, else 300) with a TrainstreamError naming what it waited for and who is
    missing; the "trainstream" logger warns about such a wait while it goes on.

    The daemon keeps the optimizer state (master weights, moments, step counts) in `state_halves`
    copies: 2 commits every update by one atomic switch, so a job resumes exactly after its daemon
    or a trainer is killed, and enables speculative clipping; it costs 12 bytes per parameter more
    (8 with bf16 moments). 1 updates in place. "auto" (default): 2 where the daemon's memory allows.
    With `speculative_clipping` ("auto": where the job has two halves; True needs them) and
    `max_grad_norm`, each bucket's update starts as its gradients arrive, before the global norm is
    known, and steps that clip are redone exactly. A restarted process resumes after
    `optimizer.resume_step` optimizer steps (docs/usage.md, "Resuming after a crash").
    """
    if model in _wrapped:
        raise TrainstreamError("this model is already wrapped; call trainstream.unwrap(model) first")
    holder, optimizer = optimizer, _inside_holders(optimizer)  # accelerate's AcceleratedOptimizer, say
    _clipping.install_accelerate()  # loaded since trainstream was
    accumulation_steps = check_accumulation_steps(accumulation_steps)  # None: counted
    max_grad_norm = check_max_grad_norm(max_grad_norm)
    _check_choice("offload", offload, OFFLOAD_CHOICES, "'auto', True or False")
    check_activation_offload(activation_offload)
    _check_number("wait_timeout", wait_timeout,
                  "a number of seconds > 0, or None (TRAINSTREAM_WAIT_TIMEOUT, else 300 s)")
    if wait_timeout is not None:
        wait_timeout = check_wait_timeout(wait_timeout, "wait_timeout")
    _check_paging_sizes(page_prefetch, page_pool_mb)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
        raise TrainstreamError(f"seed must be None (random) or an integer in [0, 2**64), not {seed!r}")
    if job is not None and (not isinstance(job, str) or not job):
        raise TrainstreamError(f"job must be a non-empty string, or None for a name unique to this process; "
                               f"not {job!r}")
    _check_parameters_are_the_models(model, optimizer)
    if offload is False:
        model, wrapped = _wrap_in_torch(model, optimizer, max_grad_norm, param_offload, blocks, device,
                                        activation_offload, page_dtype)
        return model, _rehome(holder, optimizer, wrapped)
    started = time.perf_counter()
    own_client = client is None
    given_node_rank = node_rank
    peers, node_rank = _peers.resolve(peers, node_rank)
    placed = _distributed.place(distributed, rank, world_size, job, client)
    rank, world_size, job, client = placed.rank, placed.world_size, placed.job, placed.client
    if given_node_rank is None and placed.node_rank is not None:
        node_rank = placed.node_rank
    nodes = placed.nodes if placed.nodes is not None else _peers.env_node_count()
    from_store = not peers and nodes > 1
    if (world_size > 1 or len(peers) > 1 or from_store) and job is None:
        raise TrainstreamError("ranks of a job with world_size > 1 or several nodes must pass the same job name")
    target = torch.device(device) if device is not None else _parameters_device(model)
    paging = _blocks.plan_paging(model, [p for g in optimizer.param_groups for p in g["params"]], param_offload,
                                 blocks, device=_with_index(target), page_dtype=page_dtype)
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
        peers = _peers.exchange(_peers.job_store(), client, job, node_rank, nodes, rank)
    if _distributed.spans_group(max(nodes, len(peers))):
        _distributed.share_first_ranks_weights(list(model.parameters()))  # frozen ones too
    auto_named = job is None or placed.agreed_name
    state = optimizer.state_dict() if optimizer.state else None
    attach = functools.partial(
        Rank, client, model, optimizer, job=job or default_job_name(), rank=rank, world_size=world_size,
        max_grad_norm=max_grad_norm, accumulation_steps=accumulation_steps, bucket_mb=bucket_mb,
        moment_dtype=moment_dtype, seed=random.getrandbits(63) if seed is None else seed, peers=peers,
        node_rank=node_rank, page_prefetch=page_prefetch, page_pool_mb=page_pool_mb, wait_timeout=wait_timeout,
        state_halves=state_halves, speculative_clipping=speculative_clipping)
    placed_s = time.perf_counter() - started  # placement, the daemon's start or connection, the group's agreement
    r = attach(paging=paging, device=device)
    r.timings = {"place and connect": placed_s, **r.timings}
    in_group = world_size * max(1, len(peers)) > 1 and _distributed.spans_group(2)
    wrapped = OffloadedOptimizer(optimizer, r, dp=torch.distributed.group.WORLD if in_group else None)
    w = Wrapped(model, wrapped, attach, auto_named, world_size * max(1, len(peers)), max_grad_norm,
                own_client=own_client)
    _wrapped[model] = w
    _compile.adopt(model)
    r.relayout = functools.partial(_relayout, w)
    if state is not None:
        wrapped.load_state_dict(state)  # an optimizer that already stepped keeps its moments
    if offload == "auto":
        auto = AutoOffload(wrapped, functools.partial(_switch, w), w.ranks)
        wrapped.after_step.append(auto.after_step)
    _watch_activations(w, activation_offload, r.device)
    return model, _rehome(holder, optimizer, wrapped)


def _inside_holders(optimizer):
    """The torch optimizer inside framework wrappers that hold it as `.optimizer` (accelerate's
    AcceleratedOptimizer, a LightningOptimizer's `_optimizer`): what trainstream wraps."""
    for _ in range(8):
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            break
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def _rehome(holder, inner: torch.optim.Optimizer, wrapped: OffloadedOptimizer):
    """The framework wrapper `holder` (or `wrapped` itself, given a torch optimizer), now holding
    `wrapped` where it held `inner`; accelerate's, which patches its optimizer's step() for a GradScaler,
    patches the new one's."""
    if holder is inner:
        return wrapped
    outer = holder
    while True:
        attribute = "optimizer" if getattr(outer, "optimizer", None) is not None else "_optimizer"
        below = getattr(outer, attribute)
        if below is inner:
            setattr(outer, attribute, wrapped)
            break
        outer = below
    if hasattr(outer, "_optimizer_original_step_method"):
        from accelerate.optimizer import patch_optimizer_step
        outer._optimizer_original_step_method = wrapped.step
        outer._optimizer_patched_step_method = patch_optimizer_step(outer, wrapped.step)
    return holder


_torch_zero_grad = torch.nn.Module.zero_grad


def _zero_grad(module: torch.nn.Module, set_to_none: bool = True) -> None:
    """Module.zero_grad() (the Hugging Face Trainer's way to zero them) of a module holding a wrapped model's
    parameters, all of them: as optimizer.zero_grad(), the step's gradients so far are dropped in the daemon
    too; some of them, between backward and step: refused (a step's gradients are dropped whole). torch's
    own then clears the other parameters' p.grad, past the watched parameters' refusal of p.grad after
    backward (_watched.py). A copy of the model (copy.deepcopy) is not wrapped and zeroes its own."""
    if _wrapped:
        ids = {id(p) for p in module.parameters()}
        for w in list(_wrapped.values()):
            r = w.optimizer.job_rank
            if r is None:
                continue
            mine = sum(id(p) in ids for p in r.params)
            if mine == len(r.params):
                r.zero_grad(set_to_none)
            elif mine and r.mid_step:
                raise TrainstreamError(
                    f"zero_grad() of a module holding {mine} of the {len(r.params)} parameters of a wrapped model, "
                    "between backward() and optimizer.step(): trainstream drops a step's gradients for the whole "
                    "model; call model.zero_grad() or optimizer.zero_grad()")
    with internal():
        _torch_zero_grad(module, set_to_none)


def install() -> None:
    """Module.zero_grad of modules holding wrapped parameters drops their step's gradients in the daemon."""
    torch.nn.Module.zero_grad = _zero_grad


def _check_number(option: str, value, allowed: str) -> None:
    """`value` is None or a real number (not a bool or a string that float() would take)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TrainstreamError(f"{option} must be {allowed}, not {value!r}")


def _check_paging_sizes(page_prefetch, page_pool_mb) -> None:
    """The paging pool's size: blocks loaded ahead, or MiB; checked whether or not anything pages, so a
    mistake shows where it was made. Against the GPU's memory: paging/pager.py's BlockPager."""
    if isinstance(page_prefetch, bool) or not isinstance(page_prefetch, int) or not 0 <= page_prefetch <= 1024:
        raise TrainstreamError(f"page_prefetch must be an integer in [0, 1024] (the blocks loaded while one "
                               f"computes), not {page_prefetch!r}")
    allowed = "None (page_prefetch + 1 blocks) or a finite number of MiB > 0"
    _check_number("page_pool_mb", page_pool_mb, allowed)
    if page_pool_mb is not None and not 0 < page_pool_mb < math.inf:  # nan too
        raise TrainstreamError(f"page_pool_mb must be {allowed}, not {page_pool_mb!r}")


def _check_choice(option: str, value, choices: tuple, allowed: str) -> None:
    if not any(value is c if isinstance(c, bool) else (isinstance(value, str) and value == c) for c in choices):
        raise TrainstreamError(f"{option} must be {allowed}, not {value!r}")


def _wrap_in_torch(model, optimizer, max_grad_norm, param_offload, blocks, device, activation_offload,
                   page_dtype) -> tuple[torch.nn.Module, OffloadedOptimizer]:
    """offload=False: the optimizer runs in torch from the start (fused where torch has the kernels), with
    wrap's contract: clipping by max_grad_norm, p.grad emptied after each step."""
    if isinstance(param_offload, str) and param_offload == "auto":
        log.info("param_offload='auto' with offload=False: nothing pages (the paged weights live in the daemon)")
    elif param_offload is not None and param_offload is not False:
        raise TrainstreamError(f"param_offload={param_offload!r} needs offload=True or 'auto': the paged weights live "
                               "in the daemon's job")
    _blocks.refuse_options_without_paging(blocks, page_dtype)
    _layout.optimizer_kind(optimizer)
    if device is not None:
        _place(model, torch.device(device), set())
    params = _layout.parameters_of(optimizer)
    wrapped = OffloadedOptimizer(optimizer, None)
    wrapped.use_stock(StockOptimizer(type(optimizer), optimizer.param_groups, optimizer.defaults,
                                     dict(optimizer.state), fused=True, max_grad_norm=max_grad_norm,
                                     clear_grads=True))
    w = Wrapped(model, wrapped, None, False, 1, max_grad_norm)
    _wrapped[model] = w
    _watch_activations(w, activation_offload, params[0].device)
    return model, wrapped


def _check_parameters_are_the_models(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Gradients leave through the model's hooks: an optimizer parameter outside the model would never
    be trained, and one that another wrapped model trains would get two ranks' worth of hooks."""
    own = {id(p) for p in model.parameters()}
    taken = {id(p): w for w in _wrapped.values() for p in w.model.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in own:
                raise TrainstreamError(f"param group {gi} holds a parameter of shape {tuple(p.shape)} that is not a "
                                       "parameter of the model: pass the optimizer over this model's parameters")
            if id(p) in taken:
                r = taken[id(p)].optimizer.job_rank
                owner = f"job {r.job!r}" if r is not None else "in torch"
                raise TrainstreamError(f"a parameter of shape {tuple(p.shape)} (param group {gi}) is already trained "
                                       f"by another wrapped model ({owner}): wrapped models cannot share parameters; "
                                       "wrap the model that holds them all once")


def _watch_activations(w: Wrapped, mode, device: torch.device) -> None:
    if mode is not False:
        w.activations = ActivationOffload(w.model, mode, device)
        w.optimizer.after_step.append(w.activations.after_step)


def _parameters_device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _with_index(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _place(model: torch.nn.Module, device: torch.device, paged: set[int]) -> torch.device:
    """Moves every parameter and buffer of `model` but the paged parameters to `device` (in place: the
    optimizer's parameters stay the same objects); paged parameters stay where they are until the job
    holds their weights."""
    device = _with_index(device)
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and id(p) not in paged and p.device != device:
                    p.data = p.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)
    return device


# ----- leaving the daemon, and coming back in another layout -----

def _leave_daemon(w: Wrapped, *, fused: bool | None, contract: bool, drop: bool, force: bool = False,
                  device: torch.device | None = None) -> None:
    """The state moves from the job into a stock torch optimizer, the Rank detaches (its hooks go, the
    parameters return to torch's memory; paged ones come back on the CPU or `device`), and the job is
    dropped when `drop`. `contract`: the stock optimizer keeps wrap's clipping and clearing of p.grad."""
    optimizer = w.optimizer
    state = optimizer.daemon_state()  # views of the job's memory: valid after the session closed
    r = optimizer.release_rank()
    r.close(device=device)
    client, job = r.client, r.job
    del r  # with it go the transport's GPU buffers (cuda-ipc's), before the state comes to the GPU
    if drop:
        try:
            client.drop_job(job, force)
        except TrainstreamError as e:  # another rank of the job may still be attached: the last one drops it
            log.debug("job %r not dropped: %s", job, e)
    optimizer.use_stock(StockOptimizer(
        optimizer.inner_type, optimizer.param_groups, optimizer.defaults, state, fused=fused,
        max_grad_norm=w.max_grad_norm if contract else None, clear_grads=contract))


def _switch(w: Wrapped) -> None:
    """offload="auto" decided for stock AdamW (a single rank: the job is this process's alone)."""
    client = w.optimizer.job_rank.client
    _leave_daemon(w, fused=True, contract=True, drop=True, force=True)
    if w.own_client:
        _stop_unused_private_daemon(client)


def _stop_unused_private_daemon(client: Client) -> None:
    """Stops the private daemon `client` reaches once it holds no job (so no wrapped model uses it): its
    CUDA context would otherwise stay on the GPU for the rest of training (0.51 GiB on an H200, where the
    124M GPT after auto's switch held 1.10x stock's device memory, 2026-12-02). A later connect() or
    wrap() starts another."""
    daemon = client.private_daemon
    if daemon is None:
        return
    try:
        if client.stats()["jobs"]:
            return
    except TrainstreamError:
        return
    daemon.stop()
    log.info("offload='auto': the private trainstreamd stopped (no job left), and its GPU memory with it")


def _relayout(w: Wrapped, convert: Callable[[], torch.nn.Module], changes: list[Conversion]) -> torch.nn.Module:
    """`model.to()` / `.cuda()` / `.half()` after wrap (from ApplyGuard): the job is dropped and attached
    again around `convert()` in the parameters' new dtype or device, with the old job's fp32 master weights,
    moments and step counts copied in exactly; the parameters then take the master weights in their new
    dtype. Refused before anything changes when the new layout is not one trainstream takes."""
    r = w.optimizer.job_rank
    if r.pager is not None:
        raise TrainstreamError("cannot convert a model whose weights page (param_offload): call "
                               "trainstream.unwrap(model, device=...) first, convert, then wrap again")
    if w.ranks > 1:
        raise TrainstreamError(f"cannot convert one of the {w.ranks} ranks of a data-parallel job: convert the model "
                               "before trainstream.wrap on every rank")
    _check_conversions(r.params, changes)
    r.require_idle("convert the model")
    regions = r.regions
    saved = [(regions.master_view(i), *regions.moment_views(i), regions.param_step(i)) for i in range(len(r.params))]
    before = {str(p.dtype) + " on " + str(p.device) for p in r.params}
    r.close()
    r.client.drop_job(r.job, True)
    result = convert()
    new = w.attach()
    with torch.no_grad():
        for i, (master, exp_avg, exp_avg_sq, steps) in enumerate(saved):
            new.regions.master_view(i).copy_(master)
            moments = new.regions.moment_views(i)
            moments[0].copy_(exp_avg)
            moments[1].copy_(exp_avg_sq)
            new.regions.set_param_step(i, steps)
    new.publish()
    new.relayout = functools.partial(_relayout, w)
    w.optimizer.use_rank(new)
    after = {str(p.dtype) + " on " + str(p.device) for p in new.params}
    log.info("job %r attached again for parameters now %s (were %s); fp32 master weights and moments kept",
             new.job, ", ".join(sorted(after)), ", ".join(sorted(before)))
    return result


def _check_conversions(params: list[torch.nn.Parameter], changes: list[Conversion]) -> None:
    for change in changes:
        if change.dtype not in _layout.DTYPE_CODES:
            raise TrainstreamError(f"this would turn parameter {change}, but trainstream takes float32, bfloat16 "
                                   "and float16 parameters")
        if change.device.type not in ("cpu", "cuda"):
            raise TrainstreamError(f"this would turn parameter {change}, but trainstream takes parameters on the CPU "
                                   "or a CUDA device")
    moved = {id(c.param): c.device for c in changes}
    devices = {moved.get(id(p), p.device) for p in params}
    if len(devices) > 1:
        raise TrainstreamError(f"this would put the optimizer's parameters on {sorted(map(str, devices))}: all of "
                               "them must be on one device")


# ----- entry points -----

def _wrapped_of(model: torch.nn.Module) -> Wrapped:
    w = _wrapped.get(model)
    if w is None:
        raise TrainstreamError("this model is not wrapped by trainstream")
    return w


def current_rank(model: torch.nn.Module) -> Rank | None:
    """The Rank whose hooks `model` has now: none when it is not wrapped or its optimizer runs in torch."""
    w = _wrapped.get(model)
    return w.optimizer.job_rank if w is not None else None


def _rank_of(model: torch.nn.Module) -> Rank:
    r = _wrapped_of(model).optimizer.job_rank
    if r is None:
        raise TrainstreamError("this model's optimizer state is not in trainstreamd (offload=False, or "
                               "offload='auto' switched to stock AdamW)")
    return r


def synchronize(model: torch.nn.Module | None = None) -> None:
    """Waits for in-flight updates and makes the parameters show the latest weights (every wrapped
    model when `model` is None)."""
    for w in ([_wrapped_of(model)] if model is not None else list(_wrapped.values())):
        w.optimizer.synchronize()


def unwrap(model: torch.nn.Module, device: str | torch.device | None = None) -> torch.nn.Module:
    """Removes trainstream from `model` and returns it with its current weights. The optimizer `wrap`
    returned stays usable as a plain torch optimizer holding the state (step(), state_dict(); no clipping
    or clearing of p.grad of its own from now on). The job's state stays in the daemon (dropped if the job
    was auto-named). With the cuda-ipc transport the parameters move back into torch's allocator, which
    then needs room for them before their old buffer is freed. Paged weights (param_offload) come back on
    the CPU, or on `device` if given."""
    w = _wrapped_of(model)
    if w.activations is not None:
        w.activations.remove()
    w.optimizer.after_step.clear()
    r = w.optimizer.job_rank
    if r is not None:
        r.synchronize()
        where = torch.device(device) if device is not None else None
        if r.pager is not None:
            log.info("unwrap: the paged weights of %d block(s) come back on %s%s", len(r.paging.blocks),
                     where or "cpu", "" if device is not None else " (pass device= to bring them to the GPU)")
        _leave_daemon(w, fused=None, contract=False, drop=w.auto_named, device=where)
    else:
        w.optimizer.end_contract()
    del _wrapped[model]
    return model


@atexit.register
def _drop_auto_named_jobs() -> None:
    for w in list(_wrapped.values()):
        r = w.optimizer.job_rank
        if r is None or not w.auto_named:
            continue
        try:
            r.close(drop=True)
        except Exception:  # the daemon may be gone already; nothing to clean then
            pass
