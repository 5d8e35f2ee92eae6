"""This process's rank of a job: the hooks and the step protocol (docs/architecture.md, "Step protocol"). The
parameters' places in shared memory are _regions.py's, _transport.py moves the bytes, _weight_reads.py
brings the daemon's new weights in before the model reads them, and _guards.py keeps the model's reads
and conversions in line.

Per backward pass (a micro-batch): each parameter's gradient is copied into this rank's slot of its
bucket as soon as autograd has accumulated it, and `p.grad` is freed; a bucket whose parameters are
all in is sent (GRAD_READY) at once, the rest at the end of the backward pass. optimizer.step() sends
the step's terms (how many backward passes it summed, the loss scale a GradScaler left) and tells the
Rank's WeightReads which step's weights are due: it takes them in before the model reads them (at the
forward's start, in the modules' pre-hooks, at a torch function's first read of a stale parameter;
outside the forward the parameters are watched, _watched.py: the Rank's Watch). At a forward's start
and at optimizer.step() the Rank first takes the weights the user changed in place (WeightEdits),
publishing them as the master weights, or refuses.

Accumulation is counted, as p.grad sums backward passes in torch (`accumulation_steps="auto"`): each
GRAD_READY says whether this rank expects the micro-batch to be the step's last (from the most backward
passes a step has had), or cannot tell (the first step: the daemon holds it); a backward pass that comes
after all tells the daemon first (MORE_MICRO), and zero_grad() before optimizer.step() drops the step's
gradients (DISCARD). clip_grad_norm_ on the wrapped parameters (_clipping.py) and a GradScaler
(_amp.py) add to the step's terms: the norm they ask for and the multipliers they apply.

With weight paging (`paging`, a PagingPlan of paging/blocks.py), the paged blocks' weights stay in the job's host
memory and a BlockPager (paging/pager.py) brings them to the GPU block by block: for their buckets the Rank
only waits for PARAMS_READY, and the pager copies (through the WeightReads' gate).

Invariants: a bucket's slot is written only after the daemon released it (SLOT_FREE / PARAMS_READY);
every bucket collects the gradients of the same step (current_step); a user's in-place edit of the
weights is published, or refused, before a forward or a step uses it.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import torch

from trainstream import _job_options, _layout
from trainstream._C import MAX_ACCUMULATION_STEPS, LayoutSpec, TrainstreamError
from trainstream._edits import WeightEdits
from trainstream._guards import ApplyGuard, StaleReadGuard
from trainstream._kept_grads import KeptGradients
from trainstream._regions import Regions
from trainstream._staged_copy import copy_to_host
from trainstream._step_terms import StepTerms
from trainstream._transport import Transport, describe_device, transport_for, transport_name
from trainstream._watched import Watch, internal
from trainstream._weight_reads import WeightReads, report_warnings
from trainstream.paging.paged_weights import PagedWeights
from trainstream.paging.pager import BlockPager

NOT_LAST, LAST, UNKNOWN = 0, 1, 2  # what a GRAD_READY says of its micro-batch (send_grad_ready's `last`)

_live: "weakref.WeakSet[Rank]" = weakref.WeakSet()  # attached ranks, for the takeovers (_clipping, _amp)


def rank_of(param: torch.Tensor) -> "Rank | None":
    """The attached Rank whose job trains `param`, if one does."""
    for rank in list(_live):
        if id(param) in rank.param_index:
            return rank
    return None


class Rank:
    def __init__(self, client, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, job: str, rank: int,
                 world_size: int, max_grad_norm: float | None, accumulation_steps, bucket_mb: float,
                 moment_dtype: str, seed: int, peers: list[str] | None = None, node_rank: int = 0,
                 paging=None, device: torch.device | None = None, page_prefetch: int = 2,
                 page_pool_mb: float | None = None, wait_timeout: float | None = None, state_halves="auto",
                 speculative_clipping="auto"):
        # accumulation_steps (None: counted) and max_grad_norm come checked by wrap(); the rest is checked here,
        # in wrap()'s words, before any work.
        if len(peers or []) > 1 and accumulation_steps is None:
            accumulation_steps = 1  # a job spanning nodes all-reduces from its last micro-batch on: said up front
        _job_options.check_rank_options(rank=rank, world_size=world_size, moment_dtype=moment_dtype,
                                        bucket_mb=bucket_mb)
        halves, speculation = _job_options.state_options(state_halves, speculative_clipping)
        self.client = client
        self.model = model
        self.kind = _layout.optimizer_kind(optimizer)
        self.paging = paging
        paged = paging.paged_ids if paging else set()
        self.params = _layout.parameters_of(optimizer, paged)
        resident = [p for p in self.params if id(p) not in paged]
        device = device or (resident[0].device if resident else self.params[0].device)
        self.device = device
        self.groups = optimizer.param_groups
        self.accumulation_steps = accumulation_steps  # None: counted
        self.max_grad_norm = max_grad_norm
        self.nodes = max(1, len(peers or []))
        self.job = job
        frozen = paging.frozen if paging else []
        # float32 weights the job keeps in autocast's dtype (page_dtype): they show as such on the GPU
        self.paged_as = paging.paged_as if paging else {}
        dtypes = [paging.job_dtype(p) if paging else p.dtype for p in self.params]
        self.timings: dict[str, float] = {}  # seconds each phase of wrap() took (benchmarks report them)
        self.region_wait_s = 0.0  # time backward waited for a bucket's gradient region to be released (ditto)
        started = time.perf_counter()
        spec = LayoutSpec(
            params=_layout.layout_entries(model, optimizer, self.params, dtypes, paging.partition if paging else None),
            frozen=_layout.frozen_entries(frozen), num_groups=len(optimizer.param_groups),
            bucket_bytes=int(bucket_mb * (1 << 20)), moment_dtype=_layout.MOMENT_DTYPES[moment_dtype],
            optimizer=self.kind, accumulation_steps=accumulation_steps or 0, world_size=world_size,
            max_grad_norm=float(max_grad_norm or 0.0), peers=list(peers or []), node_rank=node_rank,
            state_halves=halves, speculative_clipping=speculation, step_terms=True)
        self.session = client.attach(job, rank, spec, seed, transport_name(device), describe_device(device),
                                     wait_timeout_s=wait_timeout)
        self.resume_step = self.session.resume_step  # the optimizer steps the job had completed
        moments = torch.float32 if moment_dtype == "float32" else torch.bfloat16
        self.regions = Regions(self.session, self.params, dtypes, moments, [p for _, p in frozen])
        self.buckets = self.regions.buckets  # the step protocol runs per bucket
        started = self._timed("attach", started)
        self.transport: Transport = transport_for(self.regions, self.session, device)
        started = self._timed("transport", started)
        self._bucket_step = [1] * len(self.buckets)  # the step each bucket is collecting
        self._lock = threading.RLock()  # hooks may run on autograd threads
        self._micro = 0                 # micro-batches finished in this step
        self._step_pending = False      # all micro-batches in; optimizer.step() is due
        self._stepped = False           # optimizer.step() ran since the last backward
        self._most_micros = 0           # the most backward passes a step had: what the next ones expect
        self.terms = StepTerms(self.session, max_grad_norm, self.groups)  # hyperparameters, scaling, clipping
        self.last_grad_norm: torch.Tensor | None = None  # the last clipped step's total norm
        self.compiled_forward = 0  # compiled forwards running with every weight taken in (_compile.py)
        self._in_backward = False
        self._opened: set[int] = set()  # buckets whose slot this micro-batch writes
        self._arrived = [0] * len(self.buckets)
        self._sent = [False] * len(self.buckets)
        self._final_sent: set[int] = set()  # buckets whose gradients of the step's last micro-batch went out
        self._zeroed = False  # zero_grad(set_to_none=True) since the last step: a step without backward does nothing
        self.grads = KeptGradients()  # the p.grad torch would keep: zero gradients to send
        self._zero_fill: set[int] = set()  # at the step's first backward pass: those it must send
        self._handles = []
        self.relayout = None  # wrap's: re-attaches the job around a conversion of the model (ApplyGuard)
        self.edits = WeightEdits(self.params, [i for i, p in enumerate(self.params) if id(p) not in paged])
        self.param_index = {id(p): i for i, p in enumerate(self.params)}
        # How errors name parameter i: not a bound method, which would make the WeightReads refer back to this
        # Rank (a cycle: only a garbage collection would free the Rank and its transport's buffers).
        self.param_name = functools.partial(_layout.param_name, model, self.params)
        self.reads = WeightReads(self.session, self.regions, self.transport, self.edits, self._lock, self.param_index,
                                 self.param_name)  # the forward's side: stale buckets, new weights taken in
        self._seed_weights(rank)
        started = self._timed("seed", started)
        if paging:
            gate = self.reads.gate(lambda: self._final_sent)
            self.reads.paged = PagedWeights(paging, self.regions, self.params, model, device, gate, page_prefetch,
                                            page_pool_mb, self.transport.pins_job_regions)
            started = self._timed("pager", started)
        self.synchronize()
        started = self._timed("first weights", started)
        self._install_hooks()
        _live.add(self)

    def _timed(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        self.timings[phase] = now - started
        return now

    # ----- weights -----

    def _seed_weights(self, rank: int) -> None:
        """Rank 0 of a new job seeds the master weights (and paged frozen weights) from its parameters;
        every rank then takes the job's weights (those of rank 0, or the state a restarted process
        resumes from), once synchronize() has waited for them."""
        s = self.session
        if not s.initialized and rank == 0:
            paged = self.paging.paged_ids if self.paging else set()
            with torch.no_grad():  # into a new job's committed half
                copy_to_host([(self.regions.master_view(i), p.detach()) for i, p in enumerate(self.params)
                              if p.device.type == "cuda"], self.device)
                for i, p in enumerate(self.params):
                    if p.device.type != "cuda":
                        self.regions.master_view(i).copy_(p.detach())
                    if id(p) in paged:  # its own memory goes now: the model never exists twice in host RAM
                        p.data = self.regions.upload_view(i)
                for view, (_, p) in zip(self.regions.frozen_views, self.paging.frozen if self.paging else []):
                    view.copy_(p.detach())
                    p.data = view
            s.send_load_state(0)
            self._loaded(0, weights_on_gpu=True)
        elif s.initialized:
            # Every bucket resumes after the job's completed step (the daemon rolled back, or with one
            # state half skips, any bucket a step ahead): the trainer replays from there.
            self._bucket_step = [self.resume_step + 1] * len(self.buckets)
            self.reads.due(self.resume_step)
        else:
            self._loaded(0)

    @property
    def paged(self) -> PagedWeights | None:
        """The paged weights (weight paging), else None: the WeightReads' (its gate's pager reads them)."""
        return self.reads.paged

    @property
    def watch(self) -> Watch | None:
        """The parameters' watching (_watched.py), from _install_hooks on: the WeightReads' (it tells it of
        each bucket taken in)."""
        return self.reads.watch

    @property
    def pager(self) -> BlockPager | None:
        """The paged weights' pager (weight paging), else None."""
        return self.reads.pager

    def model_dtype(self, p: torch.nn.Parameter) -> torch.dtype:
        """The dtype parameter p has for the user (its state dicts' and optimizer state's), which a weight
        paged in autocast's dtype shows only on the GPU."""
        return torch.float32 if id(p) in self.paged_as else p.dtype

    def _before_load(self) -> None:
        """model.load_state_dict(), before torch copies into the parameters: the last step's weights are in
        first (taken in later, they would overwrite what loads), and the paged parameters become their host
        copies while torch writes into them; push_weights() publishes them and puts the placeholders back."""
        self.require_idle("load weights")
        if self.paged is not None:
            self.paged.show_host_copies()

    def _loaded(self, step: int, weights_on_gpu: bool = False) -> None:
        """The job's weights were loaded at `step` (seeded, published): the buckets collect the next step's
        gradients and show these weights once taken in (WeightReads.loaded); `weights_on_gpu`: loaded from
        this rank's parameters."""
        self._bucket_step = [step + 1] * len(self.buckets)
        self.reads.loaded(step, weights_on_gpu)

    def take_edits(self) -> None:
        """At a forward's start and at optimizer.step(): weights the user changed in place since trainstream
        wrote them (WeightEdits) become the master weights, as torch trains what the parameters hold (the
        moments stay); where that cannot be (a step's gradients are out), refuses."""
        with internal():
            edited = self.edits.edited()
        if not edited:
            return
        self.reads.refuse_stale_edits(edited)
        if self.mid_step:
            self.edits.note(edited)  # refused: not kept, and not refused again
            raise TrainstreamError(
                f"parameter {self.param_name(edited[0])} was changed in place between backward() and optimizer.step(): "
                "the daemon updates the weights it holds with this step's gradients, so torch's update of the "
                "changed weights cannot be had, and the change is not kept; change weights after "
                "optimizer.step() or before the step's first backward()")
        self.push_weights()

    def take_published(self) -> None:
        """At a forward's start: the user's edits, then the weights the daemon published already."""
        self.take_edits()
        self.reads.take_published()

    def take_all(self) -> None:
        """Before a compiled forward (_compile.py): the daemon's health checked, the user's edits taken,
        every weight in place."""
        self.session.check_healthy()
        self.take_edits()
        self.reads.take_all()

    def synchronize(self) -> None:
        """Every parameter shows the latest weights (waits for the daemon's)."""
        self.reads.synchronize()

    def push_weights(self) -> None:
        """Publishes the parameters' current values as the master weights (after model.load_state_dict)."""
        with self._lock, internal():
            self.require_idle("load weights")
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    self.regions.master_view(i).copy_(p.detach())
            self.edits.note_all()  # published
            if self.pager is not None:
                self.pager.release_all()
            self.publish()

    def publish(self) -> None:
        step = self.session.completed_step
        self.session.send_load_state(step)
        self._loaded(step, weights_on_gpu=True)
        self.synchronize()

    def require_idle(self, what: str) -> None:
        if self.mid_step:
            raise TrainstreamError(f"cannot {what} in the middle of a step (after backward, before optimizer.step())")
        self.synchronize()

    # ----- hooks -----

    def _install_hooks(self) -> None:
        for i, p in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(lambda param, i=i: self._on_grad(i, param)))
        index = self.param_index
        paged = self.paging.paged_ids if self.paging else set()
        self.reads.watch = Watch(self, {i: p for i, p in enumerate(self.params) if id(p) not in paged})
        self._handles += self.watch.handles
        guard = StaleReadGuard(self)  # kept by the handles only: it refers back to this Rank
        for module in self.model.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            buckets = tuple(sorted({self.regions.bucket_of[i] for i in own}))
            if buckets:
                self._handles.append(module.register_forward_pre_hook(
                    lambda m, args, b=buckets: self.reads.before_module(b, guard)))
        self._handles.append(self.model.register_state_dict_pre_hook(lambda *args, **kwargs: self.synchronize()))
        if self.pager is not None:
            self._handles.append(self.model.register_state_dict_post_hook(
                lambda module, state_dict, prefix, metadata: self.paged.fill_state_dict(state_dict, prefix)))
        self._handles.append(self.model.register_load_state_dict_pre_hook(lambda *args: self._before_load()))
        self._handles.append(self.model.register_load_state_dict_post_hook(lambda module, keys: self.push_weights()))
        self._handles += [ApplyGuard(self, module) for module in self.model.modules()]
        self._handles.append(guard)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _begin_backward(self) -> None:
        if self._step_pending:
            raise TrainstreamError(
                "backward() ran again before optimizer.step(): with accumulation_steps="
                f"{self.accumulation_steps}, call optimizer.step() after every {self.accumulation_steps} "
                "backward pass(es), or wrap with accumulation_steps='auto' (the default), which counts them")
        if self._micro and self.terms.norm is not None:
            raise TrainstreamError(
                "backward() after clip_grad_norm_ (or a GradScaler's unscale_) and before optimizer.step(): "
                "trainstream clips the sum of every backward pass of a step; clip (and unscale) after the last one")
        if self._micro == 0:
            self._zero_fill = self.grads.to_zero_fill()
        self._in_backward = True
        self._stepped = False
        self.watch.awaiting_backward = False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._micro == 0:
            self.terms.write_hparams(set(self._bucket_step))
        elif self.accumulation_steps is None:
            self.session.send_more_micro(self.current_step, self._micro - 1)  # that one was not the last

    def _check_no_hand_made_gradients(self) -> None:
        """Gradients reach the daemon from backward()'s hooks only; one put into p.grad by hand (from
        torch.autograd.grad, say) would be ignored."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                raise TrainstreamError(
                    f"optimizer.step(): parameter {i} has a gradient in p.grad that no backward() of a wrapped model "
                    "produced (set by hand, from torch.autograd.grad?): trainstream takes gradients from "
                    "loss.backward() only, as they are produced; compute them with backward()")

    def _open(self, b: int) -> None:
        """Before the first gradient of bucket b in this micro-batch: its slot must be free."""
        self.transport.open_bucket(b)  # the slot's previous contents must have been sent...
        started = time.perf_counter()
        self.session.wait_slot_free(b)  # ...and consumed
        self.region_wait_s += time.perf_counter() - started
        for i in self.regions.bucket_params[b]:
            self.regions.presence[i] = 0
        self._opened.add(b)

    def _on_grad(self, i: int, p: torch.nn.Parameter) -> None:
        with self._lock, internal():
            if not self._in_backward:
                self._begin_backward()
            grad = p.grad
            if grad.is_sparse:
                raise TrainstreamError("sparse gradients are not supported")
            self._deliver(i, grad)
            p.grad = None
            self.grads.got(i)

    def _deliver(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's gradient of this micro-batch into its bucket's slot; a full bucket is sent."""
        b = self.regions.bucket_of[i]
        if b not in self._opened:
            self._open(b)
        if self.regions.presence[i]:
            raise TrainstreamError(f"parameter {i} received two gradients in one backward pass")
        self.transport.grad_out(i, grad)
        self.regions.presence[i] = 1
        self._arrived[b] += 1
        if self._arrived[b] == len(self.regions.bucket_params[b]):
            self._send(b)

    def _send(self, b: int) -> None:
        step, micro = self._bucket_step[b], self._micro
        last = self._expects_last(micro)
        self.transport.bucket_done(
            b, lambda slot=0, piece=0: self.session.send_grad_ready(b, step, micro, last, slot, piece))
        self._sent[b] = True
        if last == LAST:  # the daemon may update it now (not one it holds: it waits for the step's terms)
            self._final_sent.add(b)

    def _expects_last(self, micro: int) -> int:
        """Whether micro-batch `micro` is the step's last: as accumulation_steps says, else as the steps
        before had it (the most backward passes one had), else not known (the first step, or more than ever)."""
        if self.accumulation_steps is not None:
            return LAST if micro + 1 == self.accumulation_steps else NOT_LAST
        if micro + 1 > self._most_micros:
            return UNKNOWN
        return LAST if micro + 1 == self._most_micros else NOT_LAST

    @property
    def mid_step(self) -> bool:
        """Between a step's first backward() and its optimizer.step() (or a zero_grad() that drops it): the
        step's gradients are in the daemon or on their way (a pending step has had a backward too)."""
        return bool(self._micro or self._in_backward)

    @property
    def current_step(self) -> int:
        """The step the buckets collect (the one optimizer.step() completes next)."""
        return self._bucket_step[0] if self._bucket_step else 1

    def _end_backward(self) -> None:
        with self._lock:
            for i in sorted(self._zero_fill):  # p.grad zeroed, not set to None, and no gradient this time
                if self.regions.bucket_of[i] not in self._opened or not self.regions.presence[i]:
                    self._deliver(i, torch.zeros_like(self.regions.grad_views[i], device=self.device))
            self._zero_fill = set()
            for b in range(len(self.buckets)):
                if not self._sent[b]:
                    if b not in self._opened:
                        self._open(b)
                    self._send(b)
            self._micro += 1
            self._in_backward = False
            self._opened.clear()
            self._arrived = [0] * len(self.buckets)
            self._sent = [False] * len(self.buckets)
            if self._micro == self.accumulation_steps:
                self._step_pending = True
            if self._micro == MAX_ACCUMULATION_STEPS and self.accumulation_steps is None:
                self._step_pending = True  # the daemon's bound: refused at the next backward

    # ----- optimizer.step() -----

    def step(self) -> None:
        """The step's terms to the daemon, and its weights from now on."""
        self.session.check_healthy()
        with self._lock, internal():
            if self._in_backward:
                raise TrainstreamError("optimizer.step() called during backward()")
            self._check_no_hand_made_gradients()
            self.take_edits()
            if self._micro == 0:
                if self._stepped and not self._zeroed:
                    raise TrainstreamError(
                        "optimizer.step() ran again with no backward() since the last one: torch would apply the same "
                        "gradients twice (or, after zero_grad(set_to_none=False), zeros), but they left for the "
                        "daemon during backward and are gone; call backward() before every optimizer.step()")
                return  # no gradients (yet, or zero_grad() dropped them): torch's step() does nothing either
            self.terms.check_hparams_unchanged()
            if self.accumulation_steps is not None and not self._step_pending:
                raise TrainstreamError(
                    f"optimizer.step() after {self._micro} of accumulation_steps={self.accumulation_steps} "
                    "micro-batches (wrap with accumulation_steps='auto', the default, to count them)")
            step = self.current_step
            self.terms.commit(step, self._micro)
            self._most_micros = max(self._most_micros, self._micro)
            self._bucket_step = [step + 1] * len(self.buckets)
            self._micro = 0
            self._step_pending = False
            self._final_sent.clear()
            self._stepped = True
            self._zeroed = False
            self.watch.awaiting_backward = False
            self.grads.stepped()
            self.reads.due(step)  # the weights of the step the daemon now runs
        report_warnings(self.session)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """zero_grad() between backward() and optimizer.step(): the step's gradients so far are dropped, as
        torch drops p.grad (then the next backward pass starts the step again)."""
        with self._lock:
            if self._in_backward:
                raise TrainstreamError("zero_grad() called during backward()")
            self._zeroed = set_to_none
            if self._micro == 0:
                self.grads.zero_grad(set_to_none)
                return
            if self.nodes > 1:
                raise TrainstreamError(
                    "zero_grad() between backward() and optimizer.step() drops the step's gradients, which a job "
                    "spanning nodes cannot (they were all-reduced): call zero_grad() before backward() or after "
                    "optimizer.step()")
            self.terms.discard(self.current_step)
            self._micro = 0
            self._step_pending = False
            self._final_sent.clear()
            self.grads.zero_grad(set_to_none)

    def request_norm(self, max_norm: float) -> tuple[int, int]:
        """clip_grad_norm_ (or a GradScaler's inf check, max_norm 0) of this step's gradients: the daemon
        clips them to `max_norm` and sends their norm; returns what to wait on (terms.wait)."""
        with self._lock:
            if self._in_backward or self._micro == 0:
                raise TrainstreamError(
                    "the gradient norm is asked for before any backward() of this step (or during one): trainstream "
                    "takes the norm of the step's gradients after its last backward pass")
            return self.terms.request_norm(self.current_step, self._micro, max_norm)

    def unscale(self, inv_scale: float) -> None:
        """A GradScaler's unscale_: the step's gradients are multiplied by `inv_scale` from now on."""
        with self._lock:
            self.terms.unscale(inv_scale)

    def close(self, drop: bool = False, device: torch.device | None = None) -> None:
        """Detaches. Paged parameters get their current weights from the job's host copy: on the CPU,
        or on `device`."""
        _live.discard(self)
        self.watch.close()
        self.remove_hooks()
        if self.paged is not None:
            self.paged.close(device)
            # The pager and its hooks go now, and with them the pool's GPU memory: the pager's gate
            # refers back to the WeightReads (and this Rank), so while they kept either, the pool lasted until
            # a garbage collection found the cycle (the next test on the GPU machine found a 75 MB pool still
            # allocated).
            self.reads.paged = None
        self.transport.close()
        self.session.close()
        if drop:
            try:
                self.client.drop_job(self.job)
            except TrainstreamError:
                pass
