"""benchmarks/plot.py: which runs a model size's row shows, and that every result file draws,
including peers that ran out of memory or were never run."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_plot", os.path.join(ROOT, "benchmarks", "plot.py"))
plot = importlib.util.module_from_spec(_spec)
sys.modules["bench_plot"] = plot  # its dataclasses look their module up there
_spec.loader.exec_module(plot)

META = {"config": "1b", "batch": 8, "seq": 512, "vram_cap_gib": 24.0, "bf16_weights": False,
        "moment_dtype": "float32", "gpu": "GPU X", "host": "box", "threads": 4, "host_update_ms": 300.0}


def run(mode, **fields):
    return {"mode": mode, "params": 10**9, **fields}


def write(tmp_path, name, runs, **meta):
    (tmp_path / name).write_text(json.dumps({**META, **meta, "runs": runs}))


def test_a_size_shows_the_file_with_most_peers_filled_in_from_the_others(tmp_path):
    measured = dict(step_ms=500.0, torch_peak_gib=20.0, driver_peak_gib=22.0)
    write(tmp_path, "train_gpt_1b_peers.json", [run("trainstream", **measured), run("torchao", **measured),
                                                run("deepspeed-zero3", oom=True, error="CUDA out of memory")])
    write(tmp_path, "train_gpt_1b_stock.json", [run("trainstream", step_ms=999.0), run("stock", oom=True)])
    write(tmp_path, "train_gpt_1b_paged.json", [run("trainstream", step_ms=900.0)], activation_paging=True)
    panels = plot.choose_panels(plot.load_train_gpt(str(tmp_path)))
    assert len(panels) == 1 and not panels[0].meta.get("activation_paging")  # the setting with most peers
    panel = panels[0]
    assert panel.runs["trainstream"]["step_ms"] == 500.0  # from the file with three peers side by side
    assert panel.sources["stock"] == "train_gpt_1b_stock.json"
    assert plot.outcome(panel.runs["stock"]) == "out of memory"
    assert plot.outcome(panel.runs.get("deepspeed-zero2")) == "not run"
    out = tmp_path / "out"
    out.mkdir()
    assert os.path.getsize(plot.plot_train_gpt(plot.load_train_gpt(str(tmp_path)), str(out))) > 0


def test_a_second_setting_of_a_size_shows_only_when_it_measured_a_peer_the_first_lacks(tmp_path):
    measured = dict(step_ms=500.0, torch_peak_gib=20.0, driver_peak_gib=22.0)
    write(tmp_path, "train_gpt_1b_torchao.json", [run("trainstream", **measured), run("torchao", **measured),
                                                  run("stock", oom=True)])
    write(tmp_path, "train_gpt_1b_clipped.json", [run("trainstream", **measured), run("deepspeed-zero2", **measured)],
          max_grad_norm=1.0)
    write(tmp_path, "train_gpt_1b_paged.json", [run("trainstream", **measured), run("torchao", **measured)],
          activation_paging=True)
    panels = plot.choose_panels(plot.load_train_gpt(str(tmp_path)))
    assert [sorted(p.runs) for p in panels] == [["stock", "torchao", "trainstream"],
                                                ["deepspeed-zero2", "trainstream"]]
    assert "clipped at 1" in plot.panel_title(panels[1])


def test_a_run_that_ran_out_of_memory_after_its_timed_steps_counts_as_measured():
    assert plot.measured(run("trainstream", step_ms=1247.0, oom=True))
    assert not plot.measured(run("stock", oom=True))


def test_the_committed_results_draw(tmp_path):
    results = os.path.join(ROOT, "benchmarks", "results")
    panels = plot.choose_panels(plot.load_train_gpt(results))
    assert [p.config for p in panels][:2] == ["124m", "1.86b"]
    # the 1.86B's setting with the most peers measured: bf16, clipped, every peer in one invocation
    assert {"trainstream", "torchao", "deepspeed-zero2", "deepspeed-zero3"} <= set(panels[1].runs)
    assert panels[1].sources["torchao"] == "train_gpt_1.86b_cap24_bf16_clip1.0_vs_torchao-clipped.json"
    assert os.path.getsize(plot.plot_train_gpt(plot.load_train_gpt(results), str(tmp_path))) > 0
    for path in glob.glob(os.path.join(results, "adamw_*.json")):
        assert os.path.getsize(plot.plot_adamw(path, str(tmp_path))) > 0
