"""Which weights page: the block stack of a model, the share of it that `param_offload` selects, and
the parameters that leave the GPU with those blocks (the design document, "Weight paging").

Planning only: nothing here moves memory. Every refusal is raised at wrap time, naming the argument.
`param_offload="auto"` decides from the blocks' bytes and the memory budget of the device (_budget.py):
the fewest first blocks page that leave the resident blocks within half of it, none when they all fit,
and the decision is logged once (logger "trainstream").

Invariants of a plan:
- a paged parameter belongs to exactly one paged block: every module that holds it lies inside that
  block (a weight shared by two blocks, or tied to one outside the blocks, stays resident);
- trainable paged parameters are the optimizer's; frozen ones (requires_grad=False) are not, and get
  no optimizer state;
- blocks keep their order (forward runs them in it), and each paged block's trainable parameters form
  buckets of their own (their layout partition is 1 + the block's index), so that a block's weights
  are published, and copied to the GPU, bucket by bucket;
- with `page_dtype`, a paged float32 parameter pages in that 16-bit dtype only where autocast would cast
  it so anyway: the weight or bias of a plain nn.Linear (whose forward is F.linear, which autocast runs
  in its dtype) and of nothing else. Its master weights stay float32.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from trainstream import _budget
from trainstream._C import TrainstreamError

log = logging.getLogger("trainstream")
_GIB = 1 << 30


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The longest nn.ModuleList whose modules are all of one class (model.blocks, model.model.layers),
    with its name; the first one found where two are as long."""
    best_name, best = "", []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and len(module) > 0 \
                and len({type(m) for m in module}) == 1:
            best_name, best = name, list(module)
    if not best:
        raise TrainstreamError("param_offload: found no block stack in the model (an nn.ModuleList of modules of one "
                               "class, such as model.blocks or model.model.layers); pass blocks=[...] to name them")
    return best_name, best


def resolve_blocks(model: nn.Module, blocks) -> tuple[list[str], list[nn.Module]]:
    """`blocks=` checked (modules of the model, each once, none inside another), or found; with names."""
    names = {id(m): name for name, m in model.named_modules()}
    if blocks is None:
        stack, found = find_blocks(model)
        return [f"{stack}.{i}" if stack else str(i) for i in range(len(found))], found
    blocks = list(blocks)
    if not blocks:
        raise TrainstreamError("blocks= is empty: name the model's repeated block modules, or leave it out")
    seen = set()
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise TrainstreamError(f"blocks[{i}] is a {type(block).__name__}, not an nn.Module of the model")
        if id(block) not in names or block is model:
            raise TrainstreamError(f"blocks[{i}] ({type(block).__name__}) is not a submodule of the model")
        if id(block) in seen:
            raise TrainstreamError(f"blocks[{i}] ({names[id(block)]}) appears twice in blocks=")
        seen.add(id(block))
    for i, block in enumerate(blocks):
        for inner in block.modules():
            if inner is not block and id(inner) in seen:
                raise TrainstreamError(f"blocks= names {names[id(inner)]} inside {names[id(block)]}: blocks must not "
                                       "nest")
    return [names[id(b)] for b in blocks], blocks


def select_blocks(param_offload, count: int, block_bytes: list[int] | None = None,
                  budget: int | None = None) -> list[int]:
    """The block indices `param_offload` pages: True every block, a fraction in (0, 1] that share of
    the blocks (the first ones, rounded up), a list of indices those blocks; False or None none; "auto"
    the fewest first blocks that leave the resident blocks' bytes (`block_bytes`, per block) within half
    of `budget`, none when all of them fit there."""
    if param_offload is None or param_offload is False:
        return []
    if param_offload is True:
        return list(range(count))
    if isinstance(param_offload, str) and param_offload == "auto":
        if block_bytes is None or budget is None:
            raise TrainstreamError("param_offload='auto' needs the blocks' bytes and the memory budget")
        resident, first = sum(block_bytes), 0
        while first < count and resident > budget // 2:
            resident -= block_bytes[first]
            first += 1
        return list(range(first))
    if isinstance(param_offload, (int, float)) and not isinstance(param_offload, bool):
        share = float(param_offload)
        if not 0 < share <= 1 or math.isnan(share):
            raise TrainstreamError(f"param_offload={param_offload!r}: a fraction must lie in (0, 1]; or pass True, "
                                   "False, 'auto' or a list of block indices")
        return list(range(max(1, math.ceil(share * count - 1e-9))))
    if isinstance(param_offload, (list, tuple, range)):
        indices = list(param_offload)
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
                raise TrainstreamError(f"param_offload: block index {i!r} out of range: the model has {count} blocks "
                                       f"(0..{count - 1})")
        if len(set(indices)) != len(indices):
            raise TrainstreamError(f"param_offload: block indices {indices} name a block twice")
        return sorted(indices)
    raise _unknown(param_offload)


def _unknown(param_offload) -> TrainstreamError:
    return TrainstreamError(f"param_offload={param_offload!r}: use False, True, 'auto', a fraction in (0, 1] or a list "
                            "of block indices")


@dataclass
class PagedBlock:
    index: int                      # in the block stack
    name: str                       # the module's name in the model
    module: nn.Module
    trainable: list[nn.Parameter] = field(default_factory=list)  # in the optimizer; updated by the daemon
    frozen: list[nn.Parameter] = field(default_factory=list)     # requires_grad=False; never change


@dataclass
class PagingPlan:
    blocks: list[PagedBlock]
    partition: dict[int, int]       # id(trainable paged parameter) -> its layout partition
    frozen: list[tuple[str, nn.Parameter]]  # every paged frozen parameter, block by block, with its name
    resident_shared: list[str]      # parameters of paged blocks kept resident because they are shared
    page_dtype: torch.dtype | None = None    # the autocast dtype the blocks' forward must run under
    paged_as: dict[int, torch.dtype] = field(default_factory=dict)  # id(float32 parameter) -> page_dtype

    def job_dtype(self, p: nn.Parameter) -> torch.dtype:
        """The dtype the job keeps parameter p's weights and gradients in: page_dtype or its own."""
        return self.paged_as.get(id(p), p.dtype)

    @property
    def paged_ids(self) -> set[int]:
        return {id(p) for b in self.blocks for p in (*b.trainable, *b.frozen)}


PAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def check_page_dtype(page_dtype) -> torch.dtype | None:
    """wrap()'s page_dtype: None, or the name of the 16-bit dtype of the blocks' autocast."""
    if page_dtype is None:
        return None
    if not isinstance(page_dtype, str) or page_dtype not in PAGE_DTYPES:
        raise TrainstreamError(f"page_dtype={page_dtype!r}: use None (each weight pages in its own dtype), "
                               "'bfloat16' or 'float16' (the dtype of the torch.autocast the blocks run under)")
    return PAGE_DTYPES[page_dtype]


def refuse_options_without_paging(blocks, page_dtype) -> None:
    given = [name for name, value in (("blocks=", blocks), ("page_dtype=", page_dtype)) if value is not None]
    if given:
        raise TrainstreamError(f"{' and '.join(given)} given but param_offload is off: pass param_offload=True (or a "
                               "share)")


def plan_paging(model: nn.Module, trainable: list[nn.Parameter], param_offload, blocks=None,
                device: torch.device | None = None, budget: int | None = None,
                page_dtype: str | None = None) -> PagingPlan | None:
    """What pages for `param_offload` (see select_blocks), None when nothing does. `trainable` is the
    optimizer's parameters; `device` where the blocks compute, and `budget` the memory "auto" plans for
    there (default: _budget.available(device); on the CPU "auto" pages nothing). `page_dtype`: see the
    invariants above."""
    dtype = check_page_dtype(page_dtype)
    if param_offload is None or param_offload is False:
        refuse_options_without_paging(blocks, page_dtype)
        return None
    if isinstance(param_offload, str) and param_offload != "auto" or not isinstance(
            param_offload, (bool, int, float, str, list, tuple, range)):
        raise _unknown(param_offload)  # before looking for blocks
    if isinstance(param_offload, str) and param_offload == "auto":
        plan = _plan_auto(model, trainable, blocks, device, budget)
    else:
        names, modules = resolve_blocks(model, blocks)
        plan = _plan(model, trainable, names, modules, select_blocks(param_offload, len(modules)))
    if plan is not None and dtype is not None:
        _page_linears_in(plan, dtype, _holders(model))
    return plan


def _page_linears_in(plan: PagingPlan, dtype: torch.dtype, holders: dict[int, list[nn.Module]]) -> None:
    plan.page_dtype = dtype
    for block in plan.blocks:
        for p in block.trainable:
            if p.dtype == torch.float32 and all(type(m).forward is nn.Linear.forward for m in holders[id(p)]):
                plan.paged_as[id(p)] = dtype


def _plan_auto(model, trainable, blocks, device, budget) -> PagingPlan | None:
    if budget is None and (device is None or device.type != "cuda"):
        log.info("param_offload='auto' on %s: nothing pages (paging saves GPU memory only)", device or "cpu")
        return None
    try:
        names, modules = resolve_blocks(model, blocks)
    except TrainstreamError as e:
        log.info("param_offload='auto': nothing pages: %s", e)
        return None
    block_bytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules]
    source = "given"
    if budget is None:
        figure = _budget.available(device)
        budget, source = figure.bytes, figure.source
    selected = select_blocks("auto", len(modules), block_bytes, budget)
    total, paged = sum(block_bytes), sum(block_bytes[k] for k in selected)
    if not selected:
        log.info("param_offload='auto': nothing pages: the %d blocks' %.2f GiB fit within half of the %.2f GiB "
                 "available (%s)", len(modules), total / _GIB, budget / _GIB, source)
        return None
    log.info("param_offload='auto': pages the first %d of %d blocks (%.2f of %.2f GiB of block weights): the resident "
             "blocks' %.2f GiB fit within half of the %.2f GiB available (%s)", len(selected), len(modules),
             paged / _GIB, total / _GIB, (total - paged) / _GIB, budget / _GIB, source)
    return _plan(model, trainable, names, modules, selected)


def _plan(model, trainable, names, modules, selected) -> PagingPlan:
    owner = _block_of_each_module(model, modules)
    holders = _holders(model)
    in_optimizer = {id(p) for p in trainable}
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    plan = PagingPlan(blocks=[], partition={}, frozen=[], resident_shared=[])
    for k in selected:
        block = PagedBlock(index=k, name=names[k], module=modules[k])
        for p in modules[k].parameters():
            if {owner.get(id(m)) for m in holders[id(p)]} != {k}:
                plan.resident_shared.append(param_names.get(id(p), "?"))
                continue
            if id(p) in in_optimizer:
                block.trainable.append(p)
                plan.partition[id(p)] = k + 1
            elif p.requires_grad:
                raise TrainstreamError(f"parameter '{param_names.get(id(p), '?')}' requires grad but is not in the "
                                       "optimizer: add it to the optimizer, or set requires_grad=False to freeze it")
            else:
                block.frozen.append(p)
                plan.frozen.append((param_names.get(id(p), "?"), p))
        plan.blocks.append(block)
    return plan


def _block_of_each_module(model: nn.Module, blocks: list[nn.Module]) -> dict[int, int]:
    """id(module) -> index of the block it lies in, for every module inside a block."""
    owner = {}
    for k, block in enumerate(blocks):
        for m in block.modules():
            owner[id(m)] = k
    return owner


def _holders(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) -> every module that holds it directly (tied weights have several)."""
    holders: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(m)
    return holders


def host_bytes_per_parameter(dtype: torch.dtype, moment_dtype: torch.dtype, trainable: bool, ranks: int = 1,
                             grads_in_upload: bool = False) -> int:
    """Host memory one element takes in the daemon: trainable, fp32 master weights, two moments, the
    upload copy of a 16-bit weight and each rank's gradient slot, or none where the gradients land in
    the upload copy (a paged 16-bit weight of a job with one rank, no accumulation and no speculative
    clipping: shm/job_layout.h); frozen, one copy in its dtype."""
    size = torch.empty(0, dtype=dtype).element_size()
    if not trainable:
        return size
    moments = torch.empty(0, dtype=moment_dtype).element_size()
    upload = size if dtype != torch.float32 else 0
    slots = 0 if grads_in_upload and upload else ranks * size
    return 4 + 2 * moments + upload + slots
