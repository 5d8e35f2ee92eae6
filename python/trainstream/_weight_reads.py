"""The forward side of a Rank (_rank.py): which buckets are stale, and taking the daemon's new weights
in before the model reads them.

optimizer.step(), a load of the weights and an attach make every bucket stale (`due`): its parameters
show the weights before the step until they take in those the daemon publishes for it (PARAMS_READY).
They are taken in at a forward's start where that costs no wait (take_published), by each module's
forward pre-hook (before_module), by the first torch function that gets a stale parameter
(refresh_read: the StaleReadGuard inside the forward, _guards.py, the watched parameters outside it,
_watched.py), at synchronize(), and, with weight paging, by the pager as it loads a block (the gate).

Invariants: a parameter is read by the model only after its bucket's weights of the last step are in
place; an in-place edit of a parameter that still shows the weights before the step is refused, never
lost silently; a paged bucket's host copy is not read while the daemon may be updating it (after its
last gradients of a step went out, before optimizer.step()).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Callable, Iterable

import torch

from trainstream._C import TrainstreamError
from trainstream._edits import WeightEdits
from trainstream._guards import StaleReadGuard
from trainstream._regions import Regions
from trainstream._transport import Transport
from trainstream._watched import Watch, internal
from trainstream.paging.paged_weights import PagedWeights
from trainstream.paging.pager import BlockPager, WeightGate


def report_warnings(session) -> None:
    """The daemon's warnings so far, as RuntimeWarnings at the caller of this function's caller."""
    for message in session.take_warnings():
        warnings.warn(f"trainstreamd: {message}", RuntimeWarning, stacklevel=3)


class WeightReads:
    """`lock`: the Rank's (hooks may run on autograd threads); `param_index`: a trained parameter's id ->
    its index; `param_name(i)`: parameter i as errors name it."""

    def __init__(self, session, regions: Regions, transport: Transport, edits: WeightEdits, lock,
                 param_index: dict[int, int], param_name: Callable[[int], str]):
        self.session = session
        self.regions = regions
        self.transport = transport
        self.edits = edits
        self._lock = lock
        self.param_index = param_index
        self.param_name = param_name
        self.ready_step = [0] * len(regions.buckets)  # the step whose weights the model must show
        self.stale: set[int] = set()                  # buckets whose new weights are not yet copied in
        self.loads = 0  # state loads published (they change the weights at the same step)
        self.weights_wait_s = 0.0  # time the model waited for the daemon's new weights (benchmarks read it)
        self.paged: PagedWeights | None = None  # weight paging's (the Rank's): its pager copies the paged buckets
        self.watch: Watch | None = None  # the Rank's, told of each bucket taken in; None while attaching
        self._refreshing = None  # the thread whose refresh() runs (its own copies read stale parameters)

    @property
    def pager(self) -> BlockPager | None:
        return self.paged.pager if self.paged is not None else None

    # ----- what the model must show -----

    def due(self, step: int, weights_on_gpu: bool = False) -> None:
        """The weights of `step` are due in every bucket (optimizer.step(), a resumed job): all of them
        stale until taken in; `weights_on_gpu`: the parameters hold them already (this rank just loaded
        them from there)."""
        self.ready_step = [step] * len(self.ready_step)
        self.stale = set(range(len(self.ready_step)))
        self.transport.step_done(step, weights_on_gpu)

    def loaded(self, step: int, weights_on_gpu: bool = False) -> None:
        """The job's weights were loaded at `step` (seeded, published): due, and, though the step is the
        same, not the weights a paged block holds (generation)."""
        self.due(step, weights_on_gpu)
        self.loads += 1

    def published(self, b: int) -> bool:
        """Whether bucket b's due weights are in, or can be taken in without waiting."""
        return b not in self.stale or self.session.params_ready(b, self.ready_step[b])

    def generation(self, buckets: tuple[int, ...]) -> int:
        """Which weights `buckets` are due to show: a paged block loaded for another one is loaded again."""
        return hash((self.loads, *(self.ready_step[b] for b in buckets)))

    def needs_read_guard(self) -> bool:
        """Whether a forward may read a weight that is not in place: a stale bucket, or any paged block."""
        return bool(self.stale) or self.pager is not None

    # ----- taking them in -----

    def refresh(self, buckets: Iterable[int], on_gpu: bool = False) -> None:
        """Makes the parameters of `buckets` show their latest weights (waits for the daemon); `on_gpu`:
        to the kernels queued from now on the current stream, which may wait for them on the GPU
        (the transport's wait_weights_on_gpu), while this thread goes on."""
        self.session.check_healthy()  # a dead daemon is reported here even when nothing needs waiting for
        with self._lock, internal():
            self._refreshing = threading.get_ident()
            try:
                for b in buckets:
                    if b in self.stale:
                        self._take_in(b, on_gpu)
                self.transport.weights_done()
            finally:
                self._refreshing = None
        report_warnings(self.session)

    def _take_in(self, b: int, on_gpu: bool) -> None:
        started = time.perf_counter()
        if not (on_gpu and self.transport.wait_weights_on_gpu(b, self.ready_step[b])):
            self.session.wait_params_ready(b, self.ready_step[b])
        self.weights_wait_s += time.perf_counter() - started
        if b not in self.regions.paged_buckets:  # the pager copies paged ones when it loads them
            params = self.regions.bucket_params[b]
            self.refuse_stale_edits(self.edits.edited(params))
            with torch.no_grad():
                for i in params:
                    self.transport.weights_in(i)
            self.edits.note(params)
        self.stale.discard(b)
        if self.watch is not None:
            self.watch.refreshed(b)

    def refuse_stale_edits(self, edited: list[int]) -> None:
        """Of the parameters `edited` (WeightEdits.edited), one changed while it still showed the weights
        before the last step (after optimizer.step(), before a forward or synchronize() took the new ones
        in): the change cannot be applied to the new ones."""
        stale = [i for i in edited if self.regions.bucket_of[i] in self.stale]
        if stale:
            self.edits.note(stale)  # refused: the new weights replace it, and it is not refused again
            raise TrainstreamError(
                f"parameter {self.param_name(stale[0])} was changed in place while it still showed the weights before "
                "the last optimizer.step() (trainstream brings the new ones in at the next read), so the change is not "
                "kept: call trainstream.synchronize(model) after optimizer.step(), then change the weights")

    def take_published(self) -> None:
        """At a forward's start (after the Rank took the user's edits), takes in what it can without
        waiting, so that the forward runs without the StaleReadGuard's mode (about 1 us of Python per
        torch function) where nothing is left stale: where the transport waits on the GPU, every stale
        bucket (its kernels wait for it, this thread goes on), elsewhere the buckets published already.
        Not with paging (the guard is always needed) nor where taking weights in early would delay the
        forward (the transport's `weights_in_early`)."""
        if not self.stale or self.pager is not None or not self.transport.weights_in_early:
            return
        if self.transport.waits_on_gpu:
            # Nothing is lost by the first kernel waiting for every bucket: backward sends the first
            # module's gradients last (a tied embedding's too), so its bucket is the last to be updated.
            # The 124M GPT's forward ran 182 torch functions a step in the guard's mode before (one H100,
            # 2026-12-05, benchmarks/results/train_gpt.md); queued module by module its step was no
            # faster (41.6 against 40.7 ms, medians of 8 runs each on two H100s, 2026-12-06). Waits module
            # by module pay only with the tied embedding's gradient in early: 2-3 ms of its 31-38 ms step
            # in a probe that drops the lookup's gradient (train_gpt --probe-detached-lookup, 2026-12-06).
            self.refresh(sorted(self.stale), on_gpu=True)
            return
        published = [b for b in sorted(self.stale) if self.published(b)]
        if published:
            self.refresh(published)

    def take_all(self) -> None:
        """Before a compiled forward (after the Rank took the user's edits): every weight in place, waited
        for where it must be (on the GPU where the transport can)."""
        if self.pager is not None:
            raise TrainstreamError("torch.compile of a model whose weights page (param_offload): the pager loads "
                                   "blocks from the forward's hooks, which Dynamo cannot trace; compile the blocks' "
                                   "own modules instead, or train without compile")
        if self.stale:
            self.refresh(sorted(self.stale), on_gpu=True)

    def before_module(self, buckets: tuple[int, ...], guard: StaleReadGuard) -> None:
        """A module's forward pre-hook: its buckets' weights in place, outside the guard's mode, which
        the forward leaves for good once nothing is stale. Outside that mode, where none of them is stale
        (every module of a forward whose start took every weight in), only the daemon's health is
        checked. Traced by Dynamo (a compiled forward), nothing: the forward's start took every weight in."""
        if torch.compiler.is_compiling():
            return
        if not guard.entered and self.stale.isdisjoint(buckets):
            self.session.check_healthy()
            return
        paused = guard.pause()
        try:
            self.refresh(buckets, on_gpu=True)
        finally:
            guard.resume(paused)

    def refresh_read(self, args: tuple, kwargs: dict) -> None:
        """Refreshes the stale buckets of the wrapped parameters among a torch function's arguments
        (and in lists and tuples among them, as torch.cat's), unless this thread's refresh is running already."""
        if self._refreshing == threading.get_ident():  # another thread's read waits for that refresh
            return
        buckets, blocks, bucket_of = set(), set(), self.regions.bucket_of
        paged = self.paged.block_of if self.paged is not None else {}
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                k = paged.get(id(t))
                if k is not None:
                    blocks.add(k)
                    continue
                i = self.param_index.get(id(t))
                if i is not None and bucket_of[i] in self.stale:
                    buckets.add(bucket_of[i])
        if buckets:
            self.refresh(sorted(buckets))
        for k in sorted(blocks):  # a paged weight read outside its block's forward
            self.pager.use(k)

    def synchronize(self) -> None:
        """Every parameter shows the latest weights: the stale buckets taken in (waiting for the daemon),
        the paged blocks in slots reloaded where theirs changed."""
        self.refresh(sorted(self.stale, reverse=True))
        if self.pager is not None:
            self.pager.refresh_loaded()

    def gate(self, updating: Callable[[], set[int]]) -> WeightGate:
        """The pager's gate (weight paging); `updating()`: the buckets the daemon may be updating now (their
        last gradients of the step went out, before optimizer.step())."""
        return _WeightGate(self, updating)


class _WeightGate(WeightGate):
    """The pager's view of the step protocol: a paged block's host copy may be read once its buckets'
    weights of the step the model must show are published, and not while the daemon may be updating
    them."""

    def __init__(self, reads: WeightReads, updating: Callable[[], set[int]]):
        self.reads = reads
        self.updating = updating

    def wait(self, buckets: tuple[int, ...]) -> None:
        updating = sorted(set(buckets) & self.updating())
        if updating:
            raise TrainstreamError(
                f"a forward reads the weights of paged bucket(s) {updating} after their last gradients of the step "
                "went out and before optimizer.step(): the daemon may be updating their host copy; call "
                "optimizer.step() first")
        self.reads.refresh(buckets)

    def ready(self, buckets: tuple[int, ...]) -> bool:
        return all(self.reads.published(b) for b in buckets) and not set(buckets) & self.updating()

    def generation(self, buckets: tuple[int, ...]) -> int:
        return self.reads.generation(buckets)
