"""wrap's automatic modes and the TrainStream 0.2 option values, on the CPU against real daemons:
offload="auto" switching to stock AdamW (and not, under a budget, with paging, with 16-bit weights), with
parity against torch.optim.AdamW across the switch; offload=False; the decisions of param_offload="auto"
and activation_offload="auto" from given figures; refusals of unknown option values.

The memory budget the decisions read is injected through $TRAINSTREAM_MEMORY_BUDGET_MB (_budget.py). The
GPU side (fused CUDA AdamW, torch's peak counter) is in test_cuda_auto.py."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from test_parity import STEPS, adamw, max_difference, mlp, train_both
from test_parity import mse_step as loss_of

import trainstream
from trainstream import TrainstreamError, _connect
from trainstream._budget import Budget
from trainstream.activations import offload as _activation_offload
from trainstream.fallback import offload_auto as _offload_auto
from trainstream.paging import blocks as _blocks


def schedule(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)


def train_against_torch(client, ranks=None, **options):
    """test_parity's training of a wrapped model and a torch.optim.AdamW copy, with an LR schedule made
    after wrap; `ranks`: a list that gets a weak reference to the wrapped model's Rank."""
    def note_rank(model, step):
        if step == 0 and ranks is not None and model in trainstream._wrap._wrapped:
            ranks.append(weakref.ref(trainstream._wrap._rank_of(model)))

    return train_both(client, mlp, adamw, scheduler=schedule, before_step=note_rank, **options)


# ----- offload="auto" -----

@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.05}, {"accumulation_steps": 2}],
                         ids=["plain", "clipping", "accumulation"])
def test_auto_switches_to_stock_adamw_when_it_fits_and_keeps_parity(client, memory_budget, caplog, options):
    memory_budget(1 << 20)
    caplog.set_level(logging.INFO, logger="trainstream")
    ranks = []
    model, opt, reference, ref_opt = train_against_torch(client, offload="auto", ranks=ranks, **options)
    gc.collect()
    assert ranks[0]() is None  # nothing holds on to the job's Rank
    assert not opt.offloaded and isinstance(opt.stock, torch.optim.AdamW)
    assert all(g["fused"] for g in opt.param_groups)  # torch's fused CPU kernels
    assert max_difference(model, reference) <= 1e-6
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]  # the scheduler made before the switch
    assert client.stats()["jobs"] == []  # the daemon's job is dropped
    switched = [r.getMessage() for r in caplog.records if "switches to torch.optim.AdamW(fused=True)" in r.getMessage()]
    assert len(switched) == 1 and "after 2 offloaded steps" in switched[0] and "budget 1024.00 GiB" in switched[0]
    loss_of(model, 99).backward()
    assert all(p.grad is not None for p in model.parameters())  # the hooks are gone: torch's gradients
    opt.step()
    assert all(p.grad is None for p in model.parameters())  # cleared by step(), as the offloaded optimizer does
    trainstream.unwrap(model)


def test_auto_stops_the_private_daemon_it_started_once_it_switched(memory_budget, monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("TRAINSTREAM_ADDRESS", raising=False)
    monkeypatch.setattr(_connect, "SERVICE_SOCKET", str(tmp_path / "no-service.sock"))
    monkeypatch.setattr(_connect, "_private_daemon", None)
    memory_budget(1 << 20)
    caplog.set_level(logging.INFO, logger="trainstream")
    model, opt, reference, _ = train_against_torch(None, offload="auto")  # wrap() starts a private daemon
    first = _connect._private_daemon
    assert not opt.offloaded and first.process.poll() is not None  # switched, and the daemon has exited
    assert any("private trainstreamd stopped" in r.getMessage() for r in caplog.records)
    assert max_difference(model, reference) <= 1e-6
    trainstream.unwrap(model)
    again = mlp()
    model, opt = trainstream.wrap(again, torch.optim.AdamW(again.parameters()))  # another private daemon starts
    assert _connect._private_daemon is not first and opt.offloaded
    loss_of(model, 0).backward()
    opt.step()
    trainstream.unwrap(model)
    _connect._private_daemon.stop()


def test_auto_keeps_a_private_daemon_another_wrapped_model_uses(memory_budget, monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINSTREAM_ADDRESS", raising=False)
    monkeypatch.setattr(_connect, "SERVICE_SOCKET", str(tmp_path / "no-service.sock"))
    monkeypatch.setattr(_connect, "_private_daemon", None)
    memory_budget(1 << 20)
    other = mlp()
    other, other_opt = trainstream.wrap(other, torch.optim.AdamW(other.parameters()))  # starts the daemon
    daemon = _connect._private_daemon
    model, opt, _, _ = train_against_torch(None, offload="auto")
    assert not opt.offloaded and daemon.process.poll() is None  # switched; the other model's job keeps it
    loss_of(other, 0).backward()
    other_opt.step()
    trainstream.unwrap(other)
    trainstream.unwrap(model)
    daemon.stop()


def test_state_dict_across_the_switch_is_torchs(client, memory_budget):
    memory_budget(1 << 20)
    model, opt, reference, ref_opt = train_against_torch(client, offload="auto")
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert float(ours["state"][i]["step"]) == float(s["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours["state"][i][key], s[key], rtol=1e-5, atol=1e-7)
    plain = mlp()
    plain_opt = adamw(plain, foreach=False)
    plain.load_state_dict(model.state_dict())
    plain_opt.load_state_dict(ours)  # loads into torch
    opt.load_state_dict(theirs)      # and torch's into the switched optimizer
    for step in range(50, 53):
        for m, o in ((model, opt), (plain, plain_opt)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
    assert max_difference(model, plain) <= 1e-6
    trainstream.unwrap(model)


def test_auto_keeps_offloading_when_stock_would_not_fit(client, memory_budget, caplog):
    memory_budget(1)  # 1 MiB: less than the reserve alone
    caplog.set_level(logging.INFO, logger="trainstream")
    model, opt, reference, _ = train_against_torch(client, offload="auto")
    assert opt.offloaded and max_difference(model, reference) <= 1e-6
    kept = [r.getMessage() for r in caplog.records if "offload='auto': keeps offloading" in r.getMessage()]
    assert len(kept) == 1 and "budget 0.00 GiB ($TRAINSTREAM_MEMORY_BUDGET_MB)" in kept[0]
    assert len(client.stats()["jobs"]) == 1
    trainstream.unwrap(model)


def test_auto_never_switches_with_16_bit_parameters_or_weight_paging(client, memory_budget, caplog):
    memory_budget(1 << 20)
    caplog.set_level(logging.INFO, logger="trainstream")
    model = mlp().to(torch.bfloat16)
    model, opt = trainstream.wrap(model, adamw(model), client=client, offload="auto")
    for step in range(3):
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
    assert opt.offloaded
    assert any("torch.bfloat16 parameters: stock AdamW would update them without the fp32 master weights"
               in r.getMessage() for r in caplog.records)
    trainstream.unwrap(model)
    caplog.clear()
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model), client=client, offload="auto", device="cpu",
                                  param_offload=True, blocks=[model[0], model[2]])
    for step in range(3):
        loss_of(model, step).backward()
        opt.step()
    assert opt.offloaded
    assert any("weight paging (param_offload) keeps the paged blocks' weights" in r.getMessage()
               for r in caplog.records)
    trainstream.unwrap(model)


def test_the_fit_counts_state_gradients_peak_and_parameters_outside_torch():
    params = [torch.zeros(1000), torch.zeros(24, dtype=torch.float32)]
    fit = _offload_auto.stock_fit(params, peak=10_000, outside=4096, budget=Budget(1 << 30, "test"))
    assert fit.state == 8 * 1024 + 2 * _offload_auto.STEP_TENSOR_BYTES and fit.grads == 4 * 1024
    assert fit.need == int((fit.state + fit.grads + 10_000 + 4096) * _offload_auto.MARGIN) + _offload_auto.RESERVE
    assert fit.fits
    assert not _offload_auto.stock_fit(params, 10_000, 4096, Budget(fit.need - 1, "test")).fits


# ----- offload=False -----

def test_offload_false_runs_stock_adamw_without_a_daemon(client):
    model, opt, reference, _ = train_against_torch(client, offload=False, max_grad_norm=0.05)
    assert not opt.offloaded and client.stats()["jobs"] == []
    assert max_difference(model, reference) <= 1e-6
    trainstream.unwrap(model)


def test_offload_false_refuses_weight_paging(client):
    model = mlp()
    with pytest.raises(TrainstreamError, match="param_offload=True needs offload=True or 'auto'"):
        trainstream.wrap(model, adamw(model), client=client, offload=False, param_offload=True)


# ----- param_offload="auto" -----

def test_param_offload_auto_pages_the_fewest_first_blocks_that_leave_the_rest_within_half_the_budget():
    mib = 1 << 20
    assert _blocks.select_blocks("auto", 4, [10 * mib] * 4, budget=100 * mib) == []  # 40 MiB <= 50
    assert _blocks.select_blocks("auto", 4, [10 * mib] * 4, budget=60 * mib) == [0]  # 30 <= 30
    assert _blocks.select_blocks("auto", 4, [10 * mib] * 4, budget=30 * mib) == [0, 1, 2]
    assert _blocks.select_blocks("auto", 4, [10 * mib] * 4, budget=1 * mib) == [0, 1, 2, 3]


def test_param_offload_auto_plans_from_the_model_and_logs_its_figures(caplog):
    caplog.set_level(logging.INFO, logger="trainstream")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    params = list(model.parameters())
    block = sum(p.numel() * 4 for p in model.layers[0].parameters())
    plan = _blocks.plan_paging(model, params, "auto", device=torch.device("cuda", 0), budget=5 * block)
    assert [b.index for b in plan.blocks] == [0, 1]  # 2 resident blocks within 2.5
    assert "pages the first 2 of 4 blocks" in caplog.text
    assert _blocks.plan_paging(model, params, "auto", device=torch.device("cuda", 0), budget=8 * block) is None
    assert "nothing pages: the 4 blocks'" in caplog.text
    assert _blocks.plan_paging(model, params, "auto", device=torch.device("cpu")) is None  # the CPU: never
    assert "param_offload='auto' on cpu: nothing pages" in caplog.text


def test_param_offload_auto_on_the_cpu_trains_unpaged(client):
    model = mlp()
    model, opt = trainstream.wrap(model, adamw(model), client=client, param_offload="auto")
    assert trainstream._wrap._rank_of(model).pager is None
    trainstream.unwrap(model)


# ----- activation_offload -----

def test_activation_offload_auto_pages_the_smallest_share_that_fits():
    gib = 1 << 30
    margin, reserve = _activation_offload.MARGIN, _activation_offload.RESERVE
    budget = int((4 * gib + 3 * gib) * margin) + reserve  # peak 4 GiB with all paged, room for 3 of 5 GiB saved
    assert abs(_activation_offload.bytes_to_page(5 * gib, 4 * gib, budget) - 2 * gib) <= 2
    assert _activation_offload.bytes_to_page(5 * gib, 4 * gib, 100 * gib) == 0  # everything fits: none
    assert _activation_offload.bytes_to_page(5 * gib, 4 * gib, 1 * gib) == 5 * gib  # nothing fits: all


class SeesPaging(torch.nn.Module):
    """Records whether saved-tensor hooks are in force during its forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.hooked = []

    def forward(self, x):
        self.hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return self.lin(x)


@pytest.mark.parametrize("mode, hooked", [(True, True), (0.5, True), ("auto", False), (False, False)])
def test_activation_offload_runs_the_forward_inside_activation_paging(client, mode, hooked):
    model = SeesPaging()
    model, opt = trainstream.wrap(model, adamw(model), client=client, activation_offload=mode)
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    assert model.hooked == [hooked, hooked and mode is True]  # a fraction of 0 bytes saved on the CPU: none
    trainstream.unwrap(model)
    model(torch.randn(2, 8))
    assert model.hooked[-1] is False  # unwrap removes it


# ----- bad option values -----

@pytest.mark.parametrize("option, value, message", [
    ("offload", "sometimes", r"offload must be 'auto', True or False, not 'sometimes'"),
    ("offload", 1, r"offload must be 'auto', True or False, not 1"),
    ("activation_offload", "always", r"activation_offload='always': use 'auto', True, False or a fraction in \(0, 1\]"),
    ("activation_offload", 1.5, r"activation_offload=1.5: use 'auto', True, False or a fraction"),
    ("distributed", "yes", r"distributed='yes': use 'auto' .*, True \(require one\) or False"),
    ("param_offload", "sometimes", r"param_offload='sometimes': use False, True, 'auto', a fraction"),
])
def test_unknown_option_values_name_the_option_and_the_allowed_values(client, option, value, message):
    model = mlp()
    with pytest.raises(TrainstreamError, match=message):
        trainstream.wrap(model, adamw(model), client=client, **{option: value})
    assert client.stats()["jobs"] == []


def test_distributed_true_without_a_process_group_is_refused(client):
    model = mlp()
    with pytest.raises(TrainstreamError, match="distributed=True, but there is no initialized torch.distributed"):
        trainstream.wrap(model, adamw(model), client=client, distributed=True)
