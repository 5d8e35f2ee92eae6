"""Weight paging (wrap(param_offload=...)) against real daemons, on the CPU: the planning (which
parameters page, which stay, host bytes per parameter), refusals at wrap, and the paging mechanism
itself (placeholders, a bounded pool of block slots, saved tensors packed as references, reads outside
a block's forward), which on the CPU runs the same code as on the GPU with synchronous copies.

The GPU runs (streams, pinned host copies, cuda-ipc) are in test_cuda.py."""

from __future__ import annotations

import copy
import gc
import glob
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainstream
from trainstream import TrainstreamError
from trainstream.paging import blocks as _blocks

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, WIDTH = 40, 16


class Block(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TinyGPT(nn.Module):
    """Embedding, a stack of blocks, a tied head. `twice`: block 1 runs twice; `peek`: the model reads
    block 2's weight directly, outside its forward; `ckpt`: None, or use_reentrant for checkpointed blocks;
    `autocast`: the forward runs under torch.autocast of that dtype."""

    def __init__(self, layers: int = 5, dtype=torch.float32, twice=False, peek=False, ckpt=None, autocast=None):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln = nn.LayerNorm(WIDTH)
        self.twice, self.peek, self.ckpt, self.autocast = twice, peek, ckpt, autocast
        self.to(dtype)

    def forward(self, tokens):
        with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            return self._loss(tokens)

    def _loss(self, tokens):
        x = self.wte(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x) if self.ckpt is None else checkpoint(block, x, use_reentrant=self.ckpt)
            if self.twice and i == 1:
                x = block(x)
        if self.peek:
            x = x + x @ self.blocks[2].down.weight[:, :WIDTH].t() * 0.1
        logits = F.linear(self.ln(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(step))


def train(client, make, steps=10, paged=None, accumulation_steps=1, **options):
    """Trains make() for `steps` and returns (losses, final parameters, the unwrapped model)."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    paging = {} if paged is None else {"device": "cpu", "param_offload": paged}
    model, opt = trainstream.wrap(model, opt, client=client, accumulation_steps=accumulation_steps, seed=1, **paging,
                                  **options)
    losses = []
    for step in range(steps):
        for micro in range(accumulation_steps):
            loss = model(tokens(step * accumulation_steps + micro))
            loss.backward()
            losses.append(loss.item())
        opt.step()
    trainstream.unwrap(model)
    return losses, [p.detach().clone() for p in model.parameters()], model


def assert_identical(a, b):
    assert a[0] == b[0], "losses differ"
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


# ----- paged equals unpaged, bit for bit -----

@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.3}, {"accumulation_steps": 4},
                                     {"moment_dtype": "bfloat16"}], ids=["plain", "clipping", "accumulation", "bf16m"])
def test_paged_training_equals_unpaged(client, options):
    unpaged = train(client, TinyGPT, **options)
    assert_identical(train(client, TinyGPT, paged=True, **options), unpaged)


def test_bf16_weights_and_moments_paged_equal_unpaged(client):
    make = lambda: TinyGPT(dtype=torch.bfloat16)  # noqa: E731
    unpaged = train(client, make, moment_dtype="bfloat16")
    assert_identical(train(client, make, paged=True, moment_dtype="bfloat16"), unpaged)


@pytest.mark.parametrize("share", [0.4, [1, 3], 1.0])
def test_a_share_of_the_blocks(client, share):
    assert_identical(train(client, TinyGPT, paged=share), train(client, TinyGPT))


@pytest.mark.parametrize("variant", [{"twice": True}, {"peek": True}, {"ckpt": False}, {"ckpt": True}],
                         ids=["block-called-twice", "weight-read-outside-its-block", "checkpoint",
                              "checkpoint-reentrant"])
def test_models_that_reuse_or_recompute_blocks(client, variant):
    make = lambda: TinyGPT(**variant)  # noqa: E731
    assert_identical(train(client, make, paged=True), train(client, make))


def test_a_small_pool_reloads_blocks_and_stays_exact(client):
    """Two slots for five blocks: every block is evicted and loaded again in backward."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = trainstream.wrap(model, opt, client=client, device="cpu", param_offload=True, page_prefetch=1)
    rank = trainstream._wrap._rank_of(model)
    assert len(rank.pager.in_slot) == 2
    model(tokens(0)).backward()
    assert rank.pager.loads == 5 + 3  # forward loads all five; backward reloads the three that left
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    reference(tokens(0)).backward()
    ref_opt.step()
    opt.step()
    trainstream.synchronize(model)
    sd, ref = model.state_dict(), reference.state_dict()
    for k in ref:
        torch.testing.assert_close(sd[k], ref[k], rtol=0, atol=1e-6)
    trainstream.unwrap(model)


def test_paged_fp32_training_matches_torch_adamw(client):
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(20):
        reference(tokens(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _, params, _ = train(client, TinyGPT, steps=20, paged=True)
    for p, q in zip(params, reference.parameters()):
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=1e-6)


def test_inference_under_no_grad(client):
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model).eval()
    model, _ = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, device="cpu",
                                param_offload=True)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens(3)), reference(tokens(3)))
    trainstream.unwrap(model)


# ----- what lives where -----

def test_paged_parameters_leave_their_memory_and_state_dicts_hold_their_weights(client):
    torch.manual_seed(0)
    model = TinyGPT()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = trainstream.wrap(model, opt, client=client, device="cpu", param_offload=True, page_prefetch=1)
    for p in model.blocks[4].parameters():  # not loaded: one element, expanded to the parameter's shape
        assert p.untyped_storage().nbytes() == p.element_size() and p.shape == p.detach().shape
    for p in (model.wte.weight, model.ln.weight):  # outside the blocks: resident
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    sd = model.state_dict()
    assert sd.keys() == expected.keys()
    for k in expected:
        assert torch.equal(sd[k], expected[k]), k
    model(tokens(0)).backward()
    opt.step()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(expected)  # back to the start, paged weights included
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    model.load_state_dict(trained)
    model(tokens(1)).backward()  # trains on from the loaded weights
    opt.step()
    trainstream.unwrap(model)
    for p in model.parameters():  # unwrap brings the weights back, on the CPU
        assert p.device.type == "cpu" and p.untyped_storage().nbytes() == p.numel() * p.element_size()


@pytest.mark.parametrize("paged", [True, False])
def test_a_new_jobs_paged_master_weights_are_backed_as_the_trainer_seeds_them(client, monkeypatch, paged):
    """The daemon leaves the master weights of a new job's paged blocks unbacked, and the trainer's
    seeding backs them while it frees the paged parameters: a model near the host's memory never exists
    beside its whole job (the 10B under an 8 GiB cap on a 125 GiB host). Resident parameters' master
    weights are backed at once, on the daemon's threads."""
    model = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(16)))  # 16 MiB of master weights
    master_bytes = sum(p.numel() for p in model.parameters()) * 4
    before = set(glob.glob(f"/dev/shm/trainstream.{os.getuid()}.*.state"))
    backed = {}
    seed = trainstream._rank.Rank._seed_weights

    def seed_and_measure(rank, *args):
        (segment,) = set(glob.glob(f"/dev/shm/trainstream.{os.getuid()}.*.state")) - before
        backed["before"] = os.stat(segment).st_blocks * 512, os.stat(segment).st_size
        seed(rank, *args)
        backed["after"] = os.stat(segment).st_blocks * 512

    monkeypatch.setattr(trainstream._rank.Rank, "_seed_weights", seed_and_measure)
    paging = dict(device="cpu", param_offload=True, blocks=list(model)) if paged else {}
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, state_halves=1,
                                  **paging)
    allocated, size = backed["before"]
    edges = 2 * (2 << 20)  # the pages the master weights share with backed ranges (huge ones where allowed)
    if paged:
        assert allocated <= size - master_bytes + edges
        assert backed["after"] >= allocated + master_bytes - edges
    else:
        assert allocated >= size - 4096
    trainstream.unwrap(model)


def test_unwrap_releases_the_pool_at_once(client):
    """The pool of block slots (GPU memory on the GPU) goes when unwrap() returns, and the Rank with its
    transport's buffers, not when a garbage collection finds them: the pager's gate refers back to the
    Rank, a cycle that kept a 75 MB pool allocated into the next test on the GPU machine."""
    model = TinyGPT()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client, device="cpu",
                                  param_offload=True)
    model(tokens(0)).backward()
    opt.step()
    rank = weakref.ref(trainstream._wrap._rank_of(model))
    pool = weakref.ref(rank().pager.pool)
    gc.disable()
    try:
        trainstream.unwrap(model)
        assert pool() is None and rank() is None
    finally:
        gc.enable()


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, base.in_features, dtype=base.weight.dtype) * 0.1)
        self.b = nn.Parameter(torch.zeros(base.out_features, r, dtype=base.weight.dtype))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def lora_model():
    model = TinyGPT(dtype=torch.bfloat16).requires_grad_(False)
    for block in model.blocks:
        block.up = LoraLinear(block.up)
    return model


def test_frozen_base_weights_page_once_in_their_dtype_and_never_change(client):
    torch.manual_seed(0)
    model = lora_model()
    base_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = _blocks.plan_paging(model, trainable, True)
    frozen_elements = sum(p.numel() for _, p in plan.frozen)
    assert frozen_elements == sum(p.numel() for b in model.blocks for p in b.parameters() if not p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    model, opt = trainstream.wrap(model, opt, client=client, device="cpu", param_offload=True, job="lora-host-bytes")
    for step in range(3):
        model(tokens(step)).backward()
        opt.step()
    job = next(j for j in client.stats()["jobs"] if j["name"] == "lora-host-bytes")
    trainable_elements = sum(p.numel() for p in trainable)
    # The base costs its 2 bytes per element, once; only the LoRA parameters have master weights and moments.
    assert job["elements"] < 2 * trainable_elements
    assert job["state_bytes"] >= 2 * frozen_elements
    assert job["state_bytes"] < 2 * frozen_elements + 64 * trainable_elements + (1 << 20)
    assert len(opt.state_dict()["state"]) == len(trainable)
    trainstream.unwrap(model)
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n
    assert any(not torch.equal(b.up.b, torch.zeros_like(b.up.b)) for b in model.blocks)


# ----- planning -----

class Nested(nn.Module):  # Hugging Face's shape: model.model.layers
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(10, 4)
        self.model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        self.model.norms = nn.ModuleList([nn.LayerNorm(4), nn.LayerNorm(4)])
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)])  # mixed classes: not a stack


def test_the_longest_stack_of_one_class_is_found():
    name, blocks = _blocks.find_blocks(Nested())
    assert name == "model.layers" and len(blocks) == 6


def test_shares_and_indices_select_blocks():
    assert _blocks.select_blocks(True, 6) == list(range(6))
    assert _blocks.select_blocks(0.5, 6) == [0, 1, 2]
    assert _blocks.select_blocks(0.4, 6) == [0, 1, 2]  # rounded up
    assert _blocks.select_blocks([4, 1], 6) == [1, 4]
    assert _blocks.select_blocks(False, 6) == []


def shared_down_weight() -> TinyGPT:
    model = TinyGPT()
    model.blocks[3].down.weight = model.blocks[1].down.weight  # shared by two blocks
    return model


def test_shared_weights_stay_resident(client):
    model = shared_down_weight()
    plan = _blocks.plan_paging(model, list(model.parameters()), True)
    paged = plan.paged_ids
    assert id(model.blocks[1].down.weight) not in paged
    assert id(model.blocks[1].up.weight) in paged and id(model.wte.weight) not in paged
    assert "blocks.1.down.weight" in plan.resident_shared
    assert_identical(train(client, shared_down_weight, paged=True), train(client, shared_down_weight))


def test_host_bytes_per_parameter():
    assert _blocks.host_bytes_per_parameter(torch.float32, torch.float32, trainable=True) == 4 + 8 + 0 + 4
    assert _blocks.host_bytes_per_parameter(torch.bfloat16, torch.bfloat16, trainable=True) == 4 + 4 + 2 + 2
    assert _blocks.host_bytes_per_parameter(torch.bfloat16, torch.bfloat16, trainable=True, ranks=2) == 14
    assert _blocks.host_bytes_per_parameter(torch.bfloat16, torch.float32, trainable=False) == 2
    assert _blocks.host_bytes_per_parameter(torch.bfloat16, torch.bfloat16, trainable=True, grads_in_upload=True) == 10
    assert _blocks.host_bytes_per_parameter(torch.float32, torch.bfloat16, trainable=True, grads_in_upload=True) == 12


def test_paged_bf16_blocks_of_one_rank_take_their_gradients_in_the_upload_copy(client):
    """Their gradient slots leave the rank segment: 2 bytes per paged parameter (its bytes, padding aside)."""
    def rank_bytes(job, **paging):
        torch.manual_seed(0)
        model = TinyGPT(dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = trainstream.wrap(model, opt, client=client, job=job, **paging)
        found = next(j for j in client.stats()["jobs"] if j["name"] == job)
        trainstream.unwrap(model)
        client.drop_job(job)
        return found["rank_bytes"], [p.numel() * 2 for p in model.blocks.parameters()]

    # A fixed count (counted accumulation may need the upload copy's weights for another backward pass) and
    # no speculation (a redo reads the gradients again).
    fixed = {"accumulation_steps": 1, "speculative_clipping": False}
    unpaged, block_bytes = rank_bytes("slots-for-all", **fixed)
    paged, _ = rank_bytes("slots-outside-blocks", device="cpu", param_offload=True, **fixed)
    assert sum(block_bytes) <= unpaged - paged <= sum(block_bytes) + 64 * len(block_bytes)


@pytest.mark.parametrize("bad, message", [
    ({"param_offload": 1.5}, r"fraction must lie in \(0, 1\]"),
    ({"param_offload": 0.0}, r"fraction must lie in \(0, 1\]"),
    ({"param_offload": [7]}, "block index 7 out of range: the model has 5 blocks"),
    ({"param_offload": [1, 1]}, "name a block twice"),
    ({"param_offload": "sometimes"}, "use False, True, 'auto'"),
    ({"param_offload": True, "blocks": [nn.Linear(2, 2)]}, "is not a submodule of the model"),
    ({"blocks": "wte"}, "is a str, not an nn.Module"),
    ({"param_offload": True, "page_pool_mb": 0.001}, r"needs .* MiB on the GPU, but the paging pool holds"),
])
def test_bad_paging_options_are_refused_at_wrap(client, bad, message):
    model = TinyGPT()
    options = {"device": "cpu", **bad}
    if "param_offload" not in bad:
        options["param_offload"] = True
    with pytest.raises(TrainstreamError, match=message):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, **options)


def test_paging_parameters_on_the_cpu_needs_device(client):
    model = TinyGPT()
    with pytest.raises(TrainstreamError, match="pass device="):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, param_offload=True)


def test_blocks_without_param_offload_are_refused(client):
    model = TinyGPT()
    with pytest.raises(TrainstreamError, match="param_offload is off"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, blocks=list(model.blocks))


def test_paged_micro_batches_are_counted_and_train_as_torch(client):
    """The forward of a second micro-batch reads the step's weights from the paged blocks, and its
    gradients are summed with the first's, as p.grad sums them."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client,
                                  device="cpu", param_offload=True, page_prefetch=1)
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            for micro in range(2):
                (m(tokens(2 * step + micro)) / 2).backward()
            o.step()
            o.zero_grad()
    trainstream.synchronize(model)
    sd, ref = model.state_dict(), reference.state_dict()
    for k in ref:
        torch.testing.assert_close(sd[k], ref[k], rtol=0, atol=1e-6, msg=k)


def test_a_forward_between_the_last_backward_and_step_is_refused_with_a_fixed_count(client):
    model = TinyGPT()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, device="cpu",
                                  param_offload=True, page_prefetch=1, accumulation_steps=1)
    model(tokens(0)).backward()
    with pytest.raises(TrainstreamError, match="call optimizer.step\\(\\) first"):
        model(tokens(1))
    opt.step()
    model(tokens(1)).backward()  # and after step() it goes on
    opt.step()
    trainstream.unwrap(model)


# ----- two ranks of one node share one host copy -----

def run_ranks(daemon, tmp_path, paged: bool):
    job = f"paged-ranks-{paged}-{os.getpid()}"
    outs = [str(tmp_path / f"{job}-rank{r}.pt") for r in range(2)]
    extra = ["--param-offload"] if paged else []
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "rank_process.py"), "--socket", daemon.socket,
                               "--job", job, "--rank", str(r), "--world-size", "2", "--steps", "10", "--out", outs[r],
                               *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    return [torch.load(o) for o in outs]


def test_two_ranks_of_one_node_paged_equal_unpaged(daemon, tmp_path):
    paged, unpaged = run_ranks(daemon, tmp_path, True), run_ranks(daemon, tmp_path, False)
    for replica in (*paged, unpaged[1]):
        assert all(torch.equal(a, b) for a, b in zip(unpaged[0], replica))


def test_optimizer_state_dict_round_trip_keeps_paged_master_weights(client):
    """optimizer.load_state_dict() writes the moments, not the placeholders of paged weights over their
    master weights."""
    def run(paged):
        torch.manual_seed(0)
        model = TinyGPT()
        paging = {"device": "cpu", "param_offload": True} if paged else {}
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), client=client, seed=1,
                                      **paging)
        for step in range(4):
            model(tokens(step)).backward()
            opt.step()
            if step == 1:
                opt.load_state_dict(opt.state_dict())
        trainstream.unwrap(model)
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


# ----- float32 weights paged in autocast's dtype (page_dtype) -----

def autocast_gpt(**variant):
    return TinyGPT(autocast=torch.bfloat16, **variant)


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.3}, {"accumulation_steps": 2}],
                         ids=["plain", "clipping", "accumulation"])
def test_fp32_linears_paged_in_autocasts_dtype_equal_unpaged_fp32(client, options):
    """Autocast casts a float32 Linear weight to bf16 before it computes, and its bf16 gradient back: a
    weight paged in bf16 from the fp32 master weights computes the same bits."""
    unpaged = train(client, autocast_gpt, **options)
    paged = train(client, autocast_gpt, paged=True, page_dtype="bfloat16", **options)
    assert_identical(paged, unpaged)
    assert all(p.dtype == torch.float32 for p in paged[1])  # unwrap brings back the master weights


def test_checkpointed_blocks_page_in_autocasts_dtype(client):
    make = lambda: autocast_gpt(ckpt=False)  # noqa: E731
    assert_identical(train(client, make, paged=True, page_dtype="bfloat16"), train(client, make))


def test_only_plain_linears_page_in_autocasts_dtype():
    class OwnLinear(nn.Linear):
        def forward(self, x):  # reads its weight in an op autocast does not cast
            return super().forward(x) + self.weight.sum()

    model = TinyGPT()
    model.blocks[0].down = OwnLinear(3 * WIDTH, WIDTH)
    model.blocks[1].up.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = _blocks.plan_paging(model, trainable, True, page_dtype="bfloat16")
    as_bf16 = {n for n, p in model.named_parameters() if plan.job_dtype(p) == torch.bfloat16}
    linears = {f"blocks.{k}.{n}" for k in range(5) for n in ("up.weight", "up.bias", "down.weight")}
    assert as_bf16 == linears - {"blocks.0.down.weight", "blocks.1.up.weight", "blocks.1.up.bias"}
    assert plan.page_dtype == torch.bfloat16


def test_weights_paged_in_autocasts_dtype_show_so_and_state_dicts_keep_fp32(client):
    torch.manual_seed(0)
    model = autocast_gpt()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = trainstream.wrap(model, opt, client=client, device="cpu", param_offload=True,
                                  page_dtype="bfloat16")
    up, ln = model.blocks[0].up, model.blocks[0].ln
    assert (up.weight.dtype, up.bias.dtype, ln.weight.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) and sd[k].dtype == v.dtype for k, v in expected.items())
    model(tokens(0)).backward()
    opt.step()
    moments = opt.state_dict()["state"]
    index = [i for i, p in enumerate(model.parameters()) if p is up.weight][0]
    assert moments[index]["exp_avg"].dtype == torch.float32
    trained = model.state_dict()
    model.load_state_dict(expected)  # fp32 values reach the master weights unrounded
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    model.load_state_dict(trained)
    trainstream.unwrap(model)


@pytest.mark.parametrize("autocast", [None, torch.float16], ids=["no-autocast", "float16-autocast"])
def test_a_forward_outside_the_page_dtypes_autocast_is_refused(client, autocast):
    model = TinyGPT(autocast=autocast)
    model, _ = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, device="cpu",
                                param_offload=True, page_dtype="bfloat16")
    with pytest.raises(TrainstreamError, match=r"block 0 \(blocks.0\) runs .*page_dtype='bfloat16' pages its Linear"):
        model(tokens(0))
    trainstream.unwrap(model)


@pytest.mark.parametrize("options, message", [
    ({"param_offload": True, "page_dtype": "int8"}, "page_dtype='int8': use None"),
    ({"page_dtype": "bfloat16"}, "page_dtype= given but param_offload is off"),
    ({"page_dtype": "bfloat16", "offload": False}, "page_dtype= given but param_offload is off"),
])
def test_bad_page_dtypes_are_refused_at_wrap(client, options, message):
    model = TinyGPT()
    with pytest.raises(TrainstreamError, match=message):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), client=client, device="cpu", **options)
