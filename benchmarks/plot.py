#!/usr/bin/env python3
"""Draws the committed benchmark results (benchmarks/results/*.json) into docs/images/*.png.

    python3 benchmarks/plot.py [--results benchmarks/results] [--out docs/images]

- train_gpt.png: per GPT size, the training step time and the GPU memory of trainstream against its
  peers (torchao's CPUOffloadOptimizer, DeepSpeed ZeRO-2/3 offload where a result file has them, and
  stock fused AdamW on the GPU), each from train_gpt_*.json. Several files measure the same model in
  different settings (VRAM cap, weight dtype, activation paging, clipping): a size's panel shows the
  setting with the most peers measured (and a further panel for a setting that measured a peer it
  lacks), and within it the run of the file that measured the most peers side by
  side (ties: the newest commit, then PREFERRED), other files of that setting filling in the peers it
  lacks (named under the figure). A peer that ran out of memory is marked so; one never run, "not run".
- adamw_<name>.png for each adamw_<name>.json: host AdamW throughput of every kernel variant against
  the memory-bandwidth roofline (the STREAM triad's GB/s over the variant's bytes per parameter).
Rerun after adding results; the PNGs are committed (docs/results.md and README show them).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Peers in drawing order: mode name in the JSON, legend label, colour.
PEERS = [
    ("trainstream", "trainstream", "#3949ab"),
    ("torchao", "torchao CPUOffloadOptimizer", "#ef6c00"),
    ("deepspeed-zero2", "DeepSpeed ZeRO-2 offload", "#2e7d32"),
    ("deepspeed-zero3", "DeepSpeed ZeRO-3 offload", "#66bb6a"),
    ("stock", "stock fused AdamW on the GPU", "#757575"),
]
PEER_MODES = [mode for mode, _, _ in PEERS]
# The same kernel has the same colour in every AdamW plot.
KERNEL_COLOURS = {"avx512bf16": "#3949ab", "avx512": "#00897b", "avx2": "#8e24aa", "portable": "#f9a825"}
# Where files tie on peers and commit time: the run README.md's Results section quotes.
PREFERRED = ["train_gpt_1.86b_cap24_vs_torchao.json"]
# Files whose stock and torchao runs did not clip although the file's max_grad_norm says so (train_gpt
# clips them since 2026-12-03): those runs are left out, not compared with clipped ones.
PEERS_UNCLIPPED = ["train_gpt_1.86b_cap24_bf16_clip1.0_peers_torchao-unclipped.json"]
# Files measured under a variant main did not keep: the plot shows what main does.
NOT_MAIN = ["train_gpt_124m_peers_h100_own-triad_run7_per-module-waits.json"]


@dataclass
class ResultFile:
    name: str
    meta: dict
    runs: dict[str, dict]
    committed: int  # commit time (s); uncommitted files count as newest

    @property
    def peers(self) -> list[str]:
        return [m for m in PEER_MODES if m in self.runs]


@dataclass
class Panel:
    """One model size in one setting: the runs drawn for it and where each came from."""
    config: str
    meta: dict
    runs: dict[str, dict] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    score: tuple = ()  # (peers measured, files of this setting): choose_panels keeps the highest


def commit_time(path: str) -> int:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", path], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out = ""
    return int(out) if out else 2**62


def load_train_gpt(results: str) -> list[ResultFile]:
    files = []
    for path in sorted(glob.glob(os.path.join(results, "train_gpt_*.json"))):
        if "_start" in os.path.basename(path):  # start-time runs: two steps, the first one's warm-up in them
            continue
        if os.path.basename(path) in NOT_MAIN:
            continue
        with open(path) as f:
            data = json.load(f)
        if data.get("probe_detached_lookup"):  # train_gpt's probe: not training, never a result to draw
            continue
        meta = {k: v for k, v in data.items() if k != "runs"}
        runs = {r["mode"]: r for r in data.get("runs", [])
                if not (os.path.basename(path) in PEERS_UNCLIPPED and r["mode"] in ("stock", "torchao"))}
        files.append(ResultFile(os.path.basename(path), meta, runs, commit_time(path)))
    return files


def setting(meta: dict) -> tuple:
    """What makes two files' runs comparable: the model, the batch and everything a mode runs under."""
    paging = bool(meta.get("activation_paging", False))
    return (meta["config"], meta.get("batch"), meta.get("seq"), meta.get("vram_cap_gib", 0),
            meta.get("bf16_weights", False), meta.get("moment_dtype", "float32"), paging,
            meta.get("paging_gib", 0) if paging else 0, meta.get("max_grad_norm") or 0)


def panel_for(files: list[ResultFile]) -> Panel:
    """The runs of one setting: the best file's, then the peers it lacks from the others."""
    ranked = sorted(files, key=lambda f: (len(f.peers), f.committed, f.name in PREFERRED, f.name), reverse=True)
    panel = Panel(ranked[0].meta["config"], ranked[0].meta)
    for f in ranked:
        for mode, run in f.runs.items():
            if mode not in panel.runs:
                panel.runs[mode] = run
                panel.sources[mode] = f.name
    return panel


def choose_panels(files: list[ResultFile]) -> list[Panel]:
    """Per config, the setting with the most peers measured (ties: the most files), then any other
    setting that measured a peer the config's panels lack (DeepSpeed beside a clipped run); smallest
    model first."""
    by_setting: dict[tuple, list[ResultFile]] = {}
    for f in files:
        by_setting.setdefault(setting(f.meta), []).append(f)
    candidates: dict[str, list[Panel]] = {}
    for group in by_setting.values():
        panel = panel_for(group)
        if not any(measured(run) for run in panel.runs.values()):
            continue  # only failures (DeepSpeed's 5b killed for host memory): results.md says so
        panel.score = (len([m for m in PEER_MODES if m in panel.runs]), len(group))
        candidates.setdefault(panel.config, []).append(panel)
    chosen = []
    for panels in candidates.values():
        best, *others = sorted(panels, key=lambda p: p.score, reverse=True)
        chosen.append(best)
        shown = set(best.runs)
        for panel in others:
            if set(panel.runs) & set(PEER_MODES) - shown:
                chosen.append(panel)
                shown |= set(panel.runs)
    return sorted(chosen, key=lambda p: params_of(p) or 0)


def params_of(panel: Panel) -> int | None:
    return next((r["params"] for r in panel.runs.values() if r.get("params")), None)


def fmt_params(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def measured(run: dict | None) -> bool:
    # A run can carry an out-of-memory error from after its timed steps (unwrap() under the cap, in
    # train_gpt_7b_bf16_cap24_paging.json) and still have measured its steps: step_ms decides.
    return run is not None and run.get("step_ms") is not None


def outcome(run: dict | None) -> str:
    if run is None:
        return "not run"
    return "out of memory" if run.get("oom") else "failed"


def panel_title(panel: Panel) -> str:
    m = panel.meta
    weights = "bf16 weights" if m.get("bf16_weights") else "fp32 weights + bf16 autocast"
    moments = ", bf16 moments" if m.get("moment_dtype") == "bfloat16" else ""
    cap = f"{m['vram_cap_gib']:g} GiB VRAM cap" if m.get("vram_cap_gib") else "no VRAM cap"
    paging = ""
    if m.get("activation_paging"):
        paging = f", activation paging {m['paging_gib']:g} GiB" if m.get("paging_gib") else ", activations paged"
    clipped = f", clipped at {m['max_grad_norm']:g}" if m.get("max_grad_norm") else ""
    return (f"GPT {m['config']} ({fmt_params(params_of(panel))} params): {weights}{moments}, "
            f"batch {m.get('batch')}x{m.get('seq')}, {cap}{paging}{clipped}")


def _machine_field(key: str, value) -> str:
    return {"gpu": f"{value}", "cpu": f"{value}", "threads": f"{value} threads"}.get(key, f"{key} {value}")


def machine(metas: list[dict], keys: tuple[str, ...]) -> str:
    names = []
    for m in metas:
        name = ", ".join(_machine_field(k, m[k]) for k in keys if m.get(k) is not None)
        if name not in names:
            names.append(name)
    return "; ".join(names)


_LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 1.0}  # reference lines pass behind the labels


def _not_measured(ax, y: int, run: dict | None, top: float) -> None:
    ax.text(top * 0.01, y, outcome(run), ha="left", va="center", fontsize=9,
            color="#c62828" if run else "#9e9e9e", style="normal" if run else "italic", bbox=_LABEL_BOX)


def draw_step(ax, panel: Panel, modes: list[str], colours: dict[str, str]) -> None:
    runs = panel.runs
    gpu_only = runs.get("gpu-only")
    top = max([runs[m]["step_ms"] for m in modes if measured(runs.get(m))] +
              [panel.meta.get("host_update_ms") or 0, gpu_only["step_ms"] if measured(gpu_only) else 0])
    for y, mode in enumerate(modes):
        run = runs.get(mode)
        if not measured(run):
            _not_measured(ax, y, run, top)
            continue
        ax.barh(y, run["step_ms"], color=colours[mode], height=0.7)
        ax.text(run["step_ms"] + top * 0.015, y, f"{run['step_ms']:.0f} ms", va="center", fontsize=9, bbox=_LABEL_BOX)
    if measured(gpu_only):
        ax.axvline(gpu_only["step_ms"], color="black", linestyle=":", linewidth=1.2)
    if panel.meta.get("host_update_ms"):
        ax.axvline(panel.meta["host_update_ms"], color="black", linestyle="--", linewidth=1.0)
    ax.set_xlim(0, top * 1.22)


def draw_memory(ax, panel: Panel, modes: list[str], colours: dict[str, str]) -> None:
    runs, cap = panel.runs, panel.meta.get("vram_cap_gib") or 0
    top = max([runs[m].get("driver_peak_gib") or runs[m].get("torch_peak_gib") or 0
               for m in modes if measured(runs.get(m))] + [cap])
    for y, mode in enumerate(modes):
        run = runs.get(mode)
        if not measured(run):
            _not_measured(ax, y, run, top)
            continue
        torch_peak = run.get("torch_peak_gib") or 0
        buffers = run.get("gpu_buffers_gib") or 0
        ax.barh(y, torch_peak, color=colours[mode], height=0.7)
        if buffers:
            ax.barh(y, buffers, left=torch_peak, color=colours[mode], alpha=0.4, hatch="///", height=0.7,
                    edgecolor="white", linewidth=0)
        driver = run.get("driver_peak_gib") or 0
        if driver:
            ax.plot([driver, driver], [y - 0.42, y + 0.42], color="black", linewidth=2.2)
        label = f"{torch_peak:.1f} + {buffers:.1f} GiB" if buffers else f"{torch_peak:.1f} GiB"
        ax.text(max(torch_peak + buffers, driver) + top * 0.015, y, label, va="center", fontsize=9, bbox=_LABEL_BOX)
    if cap:
        ax.axvline(cap, color="#c62828", linestyle="--", linewidth=1.0)
    ax.set_xlim(0, top * 1.42)


def plot_train_gpt(files: list[ResultFile], out: str) -> str:
    panels = choose_panels(files)
    modes = [m for m in PEER_MODES if any(m in p.runs for p in panels)]
    colours = {mode: colour for mode, _, colour in PEERS}
    labels = {mode: label for mode, label, _ in PEERS}
    row_in, head_in, foot_in = 0.36 * len(modes) + 0.95, 1.25, 0.85  # inches
    height = row_in * len(panels) + head_in + foot_in
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, height), sharey=True, squeeze=False)
    fig.subplots_adjust(left=0.22, right=0.98, top=1 - head_in / height, bottom=foot_in / height,
                        hspace=0.85, wspace=0.06)
    for row, panel in enumerate(panels):
        step_ax, memory_ax = axes[row]
        draw_step(step_ax, panel, modes, colours)
        draw_memory(memory_ax, panel, modes, colours)
        step_ax.set_title(panel_title(panel), fontsize=10, loc="left", x=-0.02, pad=7)
        for ax in (step_ax, memory_ax):
            ax.tick_params(axis="x", labelsize=8.5)
            ax.tick_params(axis="y", length=0)
            ax.spines[["top", "right"]].set_visible(False)
    step_ax = axes[0][0]
    step_ax.set_yticks(range(len(modes)))
    step_ax.set_yticklabels([labels[m] for m in modes], fontsize=9)
    step_ax.set_ylim(len(modes) - 0.5, -0.5)  # first mode on top
    axes[-1][0].set_xlabel("step time (ms, median of the timed steps)", fontsize=9.5)
    axes[-1][1].set_xlabel("GPU memory peak (GiB)", fontsize=9.5)
    handles = [plt.Line2D([], [], color="black", linestyle=":", label="GPU-only forward+backward (no optimizer)"),
               plt.Line2D([], [], color="black", linestyle="--", label="host bound: update bytes / STREAM triad"),
               Patch(facecolor=colours["trainstream"], alpha=0.4, hatch="///", edgecolor="white",
                     label="trainstream's GPU buffers (outside torch's allocator)"),
               plt.Line2D([], [], color="black", linewidth=2.2, label="driver's peak for the whole process"),
               plt.Line2D([], [], color="#c62828", linestyle="--", label="VRAM cap")]
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=8.5, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.42 / height))
    fig.suptitle(f"GPT training: trainstream and its peers on "
                 f"{machine([p.meta for p in panels], ('gpu', 'host', 'threads'))}", fontsize=12,
                 y=1 - 0.1 / height, va="top")
    notes = []
    for panel in panels:
        main = max(set(panel.sources.values()), key=list(panel.sources.values()).count)
        extra = [f"{m} from {s}" for m, s in panel.sources.items() if s != main and m in modes]
        notes.append(f"{panel.config}: {main}" + (f" ({'; '.join(extra)})" if extra else ""))
    fig.text(0.01, 0.08 / height, "Sources in benchmarks/results/: " + "; ".join(notes),
             fontsize=7, color="#555555", wrap=True, va="bottom")
    path = os.path.join(out, "train_gpt.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_adamw(path: str, out: str) -> str:
    with open(path) as f:
        data = json.load(f)
    triad = data["triad"]["gb_per_s"]
    kernels = []
    for v in data["variants"]:
        if v["kernel"] not in kernels:
            kernels.append(v["kernel"])
    others = iter(["#6d4c41", "#c2185b", "#0097a7"])  # kernels this script does not know yet
    colours = {k: KERNEL_COLOURS.get(k) or next(others, "#000000") for k in kernels} | {"torch": "#757575"}
    rows = [(v["name"], v["kernel"], v["bytes_per_param"], v["params_per_s"]) for v in data["variants"]]
    torch = data.get("torch_fused")
    if torch:
        rows.append((torch["name"], "torch", torch["bytes_per_param"], torch["params_per_s"]))
    update = [r for r in rows if not r[0].startswith("norm:")]
    norm = [r for r in rows if r[0].startswith("norm:")]
    groups = [("AdamW update", update)] + ([("gradient norm pass (for clipping)", norm)] if norm else [])
    height = 0.3 * (len(rows) + len(groups)) + 2.3  # inches: a row per variant, the titles, the legend
    fig, axes = plt.subplots(len(groups), 1, figsize=(10.5, height), squeeze=False,
                             gridspec_kw={"height_ratios": [len(g[1]) + 1 for g in groups]})
    fig.subplots_adjust(left=0.37, right=0.98, top=1 - 1.5 / height, bottom=0.6 / height, hspace=0.2)
    for ax, (title, group) in zip(axes[:, 0], groups):
        draw_roofline_rows(ax, group, triad, colours)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1][0].set_xlabel(f"Gparam/s: parameters per second, best of {data.get('reps', '?')} repetitions "
                           "(in brackets: measured / roofline)", fontsize=10)
    handles = [Patch(color=colours[k], label=f"trainstream kernel {k}" + (" (active)" if
                     k == data.get("active_kernel") else "")) for k in kernels]
    if torch:
        handles.append(Patch(color=colours["torch"], label=f"{torch['name']}, torch {torch.get('torch', '')}"))
    handles.append(plt.Line2D([], [], color="black", linewidth=2,
                              label=f"roofline: STREAM triad {triad:.1f} GB/s / bytes moved per param"))
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=8.5, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.68 / height))
    fig.suptitle(f"Host AdamW against the memory-bandwidth roofline: {data['params'] / 1e6:.0f}M params, "
                 f"{data['threads']} threads\n{machine([data], ('cpu', 'host'))}, "
                 f"benchmarks/results/{os.path.basename(path)}", fontsize=11, y=1 - 0.1 / height,
                 va="top")
    name = os.path.splitext(os.path.basename(path))[0]
    out_path = os.path.join(out, f"{name}.png")
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def draw_roofline_rows(ax, rows: list[tuple], triad_gbs: float, colours: dict[str, str]) -> None:
    """One bar per variant (measured Gparam/s) with its roofline (triad GB/s over its bytes/param)."""
    top = max(max(r[3] / 1e9 for r in rows), max(triad_gbs / r[2] for r in rows))
    for y, (name, kernel, bytes_per_param, params_per_s) in enumerate(rows):
        rate, roof = params_per_s / 1e9, triad_gbs / bytes_per_param
        ax.barh(y, rate, color=colours[kernel], height=0.7)
        ax.plot([roof, roof], [y - 0.42, y + 0.42], color="black", linewidth=2)
        ax.text(max(rate, roof) + top * 0.01, y, f"{rate:.2f} ({100 * rate / roof:.0f}%)",
                va="center", fontsize=8.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{name.replace('norm: ', '')} ({b:g} B/param)" for name, _, b, _ in rows], fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.2)
    ax.tick_params(axis="x", labelsize=9)
    ax.spines[["top", "right"]].set_visible(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    written = []
    files = load_train_gpt(args.results)
    if files:
        written.append(plot_train_gpt(files, args.out))
    for path in sorted(glob.glob(os.path.join(args.results, "adamw_*.json"))):
        written.append(plot_adamw(path, args.out))
    for path in written:
        print(f"plot: wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
