"""Turn summaries into a table on stdout, a JSON file and a PNG of latency against load."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# (header, decimals or None for text); latencies in seconds; GB/s and "of-probe": the workers' roofline
# meter over the level (llmserve/loadgen/roofline.py), "-" where no worker metrics were scraped.
COLUMNS = (
    ("load", None), ("ok/req", None), ("req/s", 2), ("tok/s", 1), ("GB/s", 2), ("of-probe", 2),
    ("ttft p50", 3), ("ttft p99", 3),
    ("itl p50", 4), ("itl p99", 4), ("e2e p50", 3), ("e2e p90", 3), ("e2e p99", 3), ("good/s", 2),
    ("jain", 3), ("errors", None),
)


def _row(level: dict) -> list:
    s = level["summary"]
    errors = {c: n for c, n in s["codes"].items() if c != "OK"}
    meter = level.get("roofline") or {}
    return [level["label"], f"{s['ok']}/{s['requests']}", s["throughput"]["requests_per_s"],
            s["throughput"]["output_tokens_per_s"], meter.get("achieved_gbps"), meter.get("fraction"),
            s["ttft_s"]["p50"], s["ttft_s"]["p99"],
            s["inter_token_s"]["p50"], s["inter_token_s"]["p99"], s["e2e_s"]["p50"], s["e2e_s"]["p90"],
            s["e2e_s"]["p99"], s.get("goodput", {}).get("goodput_per_s"), s.get("goodput", {}).get("jain_tokens"),
            ",".join(f"{c}={n}" for c, n in errors.items()) or "-"]


def _cell(value, decimals: int | None) -> str:
    if value is None:
        return "-"
    return f"{value:.{decimals}f}" if decimals is not None else str(value)


def format_table(levels: Sequence[dict]) -> str:
    """A fixed-width table, one row per load level; latencies in seconds."""
    cells = [[name for name, _ in COLUMNS]]
    cells += [[_cell(v, d) for (_, d), v in zip(COLUMNS, _row(level))] for level in levels]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def plot_latency(path: Path, levels: Sequence[dict], mode: str) -> None:
    """TTFT, inter-token and e2e latency percentiles (log scale) and throughput against load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [level["load"] for level in levels]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, metric, title in zip(axes, ("ttft_s", "inter_token_s", "e2e_s"),
                                 ("time to first token", "inter-token latency", "end-to-end latency")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(loads, [_nan(level["summary"][metric][q]) for level in levels], style, label=q)
        ax.set(title=title, xlabel=_xlabel(mode), ylabel="seconds", yscale="log")
        ax.legend()
        ax.grid(True, alpha=0.3)
    axes[3].plot(loads, [_nan(level["summary"]["throughput"]["output_tokens_per_s"]) for level in levels], "o-")
    axes[3].set(title="throughput", xlabel=_xlabel(mode), ylabel="output tokens / s")
    axes[3].grid(True, alpha=0.3)
    for ax in axes:
        if len(loads) > 1 and min(loads) > 0 and max(loads) / min(loads) >= 8:
            ax.set_xscale("log", base=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _xlabel(mode: str) -> str:
    return "concurrent clients" if mode == "closed" else "offered rate (requests / s)"
