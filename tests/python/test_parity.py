"""trainstream's updates against torch.optim.AdamW / Adam (foreach=False), through a real daemon.

Each case trains a wrapped model and a plain copy on the same data for 20 steps and requires every
parameter to agree within 1e-6 (parameters are unit scale)."""

from __future__ import annotations

import copy

import torch

import trainstream

STEPS = 20
TOLERANCE = 1e-6


class TiedModel(torch.nn.Module):
    """Embedding and output projection share one weight, like GPT's wte/lm_head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.hidden = torch.nn.Linear(16, 16)

    def forward(self, tokens):
        h = torch.tanh(self.hidden(self.embed(tokens)))
        return h @ self.embed.weight.t()


class SometimesUnused(torch.nn.Module):
    """`extra` gets a gradient only on even steps."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.use_extra = True

    def forward(self, x):
        h = self.body(x)
        return self.extra(h) if self.use_extra else h


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def mse_step(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), torch.randn(16, 8, generator=g))


def token_step(model, step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 32, (4, 6), generator=g)
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens.reshape(-1))


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def train_both(client, make_model, make_optimizer, loss_fn=mse_step, *, accumulation_steps=1, max_grad_norm=None,
               scheduler=None, before_step=None, **wrap_args):
    model = make_model()
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer(reference, foreach=False)
    model, opt = trainstream.wrap(model, make_optimizer(model), client=client, max_grad_norm=max_grad_norm,
                                  accumulation_steps=accumulation_steps, **wrap_args)
    schedulers = [scheduler(o) for o in (opt, ref_opt)] if scheduler else []
    for step in range(STEPS):
        for m, o in ((model, opt), (reference, ref_opt)):
            if before_step:
                before_step(m, step)
            for micro in range(accumulation_steps):
                loss_fn(m, step * accumulation_steps + micro).backward()
            if o is ref_opt and max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm)
            o.step()
            o.zero_grad()
        for s in schedulers:
            s.step()
    trainstream.synchronize(model)
    return model, opt, reference, ref_opt


def adamw(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, **kw)


def test_plain(client):
    model, _, ref, _ = train_both(client, mlp, adamw)
    assert max_difference(model, ref) <= TOLERANCE
    assert max_difference(model, mlp()) > 1e-3  # it did train


def test_two_param_groups(client):
    def groups(model, **kw):
        return torch.optim.AdamW([
            {"params": model[0].parameters(), "lr": 3e-2, "weight_decay": 0.1},
            {"params": model[2].parameters(), "lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
        ], lr=1e-2, **kw)

    model, _, ref, _ = train_both(client, mlp, groups)
    assert max_difference(model, ref) <= TOLERANCE


def test_lr_scheduler(client):
    def schedule(optimizer):
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-2, total_steps=STEPS)

    model, opt, ref, ref_opt = train_both(client, mlp, adamw, scheduler=schedule)
    assert max_difference(model, ref) <= TOLERANCE
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_max_grad_norm(client):
    model, _, ref, _ = train_both(client, mlp, adamw, max_grad_norm=0.05)
    assert max_difference(model, ref) <= TOLERANCE


def test_accumulation_steps(client):
    model, _, ref, _ = train_both(client, mlp, adamw, accumulation_steps=4)
    assert max_difference(model, ref) <= TOLERANCE


def test_accumulation_with_clipping(client):
    model, _, ref, _ = train_both(client, mlp, adamw, accumulation_steps=3, max_grad_norm=0.05)
    assert max_difference(model, ref) <= TOLERANCE


def test_parameter_without_gradient_in_some_steps(client):
    def toggle(model, step):
        model.use_extra = step % 2 == 0

    model, opt, ref, ref_opt = train_both(client, SometimesUnused, adamw, before_step=toggle)
    assert max_difference(model, ref) <= TOLERANCE
    # torch counts steps per parameter: `extra` took half of them
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert [float(ours[i]["step"]) for i in sorted(ours)] == [float(theirs[i]["step"]) for i in sorted(theirs)]


def test_tied_weights(client):
    model, _, ref, _ = train_both(client, TiedModel, adamw, token_step)
    assert max_difference(model, ref) <= TOLERANCE


def test_adam(client):
    def adam(model, **kw):
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.05, **kw)

    model, _, ref, _ = train_both(client, mlp, adam)
    assert max_difference(model, ref) <= TOLERANCE


def test_small_buckets_many_buckets(client):
    def wide():
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])

    def loss(model, step):
        g = torch.Generator().manual_seed(step)
        return model(torch.randn(4, 64, generator=g)).pow(2).mean()

    model, _, ref, _ = train_both(client, wide, adamw, loss, bucket_mb=0.02)
    assert max_difference(model, ref) <= TOLERANCE


def test_state_dict_matches_torch_format_and_values(client):
    model, opt, ref, ref_opt = train_both(client, mlp, adamw)
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    def without_foreach(groups):  # the reference was built with foreach=False on purpose
        return [{k: v for k, v in g.items() if k != "foreach"} for g in groups]

    assert without_foreach(ours["param_groups"]) == without_foreach(theirs["param_groups"])
    assert ours["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert float(ours["state"][i]["step"]) == float(s["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours["state"][i][key].dtype == s[key].dtype
            torch.testing.assert_close(ours["state"][i][key], s[key], rtol=1e-5, atol=1e-7)


def _continue(model, opt, ref, ref_opt, steps=5):
    for step in range(100, 100 + steps):
        for m, o in ((model, opt), (ref, ref_opt)):
            mse_step(m, step).backward()
            o.step()
            o.zero_grad()
    trainstream.synchronize(model)
    return max_difference(model, ref)


def plain_torch_steps(model, opt, steps):
    for step in range(steps):
        mse_step(model, step).backward()
        opt.step()
        opt.zero_grad()


def test_torch_state_dict_loads_into_trainstream(client):
    reference = mlp()
    ref_opt = adamw(reference, foreach=False)
    plain_torch_steps(reference, ref_opt, 5)
    model = mlp()
    model.load_state_dict(reference.state_dict())
    model, opt = trainstream.wrap(model, adamw(model), client=client)
    opt.load_state_dict(ref_opt.state_dict())
    assert _continue(model, opt, reference, ref_opt) <= TOLERANCE


def test_trainstream_state_dict_loads_into_torch(client):
    model, opt, _, _ = train_both(client, mlp, adamw)
    plain = mlp()
    plain.load_state_dict(model.state_dict())
    plain_opt = adamw(plain, foreach=False)
    plain_opt.load_state_dict(opt.state_dict())
    assert _continue(model, opt, plain, plain_opt) <= TOLERANCE


def test_wrapping_an_optimizer_that_already_stepped_keeps_its_state(client):
    model = mlp()
    opt = adamw(model, foreach=False)
    plain_torch_steps(model, opt, 3)
    reference = copy.deepcopy(model)
    ref_opt = adamw(reference, foreach=False)
    ref_opt.load_state_dict(opt.state_dict())
    model, opt = trainstream.wrap(model, opt, client=client)
    assert _continue(model, opt, reference, ref_opt) <= TOLERANCE


def test_model_load_state_dict_reaches_the_master_weights(client):
    model, opt, ref, ref_opt = train_both(client, mlp, adamw)
    fresh = mlp()
    model.load_state_dict(fresh.state_dict())
    ref.load_state_dict(fresh.state_dict())
    assert _continue(model, opt, ref, ref_opt) <= TOLERANCE


class UsesWeightsDirectly(torch.nn.Module):
    """The root's forward reads `proj`'s parameters without calling `proj`, and `late`'s weight before
    `late` runs: no forward pre-hook of their modules precedes those reads."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.late = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(x @ self.proj.weight.t() + self.proj.bias)
        h = h * self.late.weight.sum(dim=0)
        return self.late(h)


def test_parameters_read_outside_their_modules_forward(client):
    model, _, ref, _ = train_both(client, UsesWeightsDirectly, adamw)
    assert max_difference(model, ref) <= TOLERANCE
