"""Render docs/performance.md's end-to-end tables from the committed results of bench/openai_standard.py.

    .venv/bin/python bench/report.py            # rewrite the generated region of docs/performance.md
    .venv/bin/python bench/report.py --check    # exit 1 if the region is not what the results render

The region lies between the BEGIN and END markers below; everything in it is generated from
bench/results/openai_standard/*.json (oldest run first), so the tables are never edited by hand.
A run gets a heading (date, CPU, workload), a line saying where it ran and on what, and one row a
pass and concurrency level: each server's output tok/s, llmserve's ratio to llama-server where both
ran, and each server's TTFT and ITL p50 / p95.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "bench" / "results" / "openai_standard"
DOC = REPO / "docs" / "performance.md"
BEGIN = "<!-- BEGIN bench/report.py: generated from bench/results/openai_standard/*.json; do not edit -->"
END = "<!-- END bench/report.py -->"
EMPTY = ("No run is committed yet. `bench/openai_standard.py` writes one JSON file a run under "
         "`bench/results/openai_standard/`; commit it and run `python bench/report.py`.")


def load_runs(directory: Path = RUNS) -> list[tuple[str, dict]]:
    """(file name, record) of every committed run, oldest first."""
    runs = [(path.name, json.loads(path.read_text())) for path in directory.glob("*.json")]
    return sorted(runs, key=lambda run: (run[1]["date"], run[0]))


def _heading(record: dict) -> str:
    machine, work = record["machine"], record["workload"]
    prompts = "distinct raw-text prompts" if work["prompts"] == "distinct" else "chat prompts"
    temperature = work.get("temperature")   # runs before 2026-12-06 sent none
    sampling = "" if temperature is None or isinstance(temperature, str) else \
        (", greedy" if temperature == 0 else f", temperature {temperature:g}")
    return (f"### {record['date'].replace('T', ' ').rstrip('Z')} UTC: {machine['cpu_model']}, "
            f"{work['prompt_tokens']}-token {prompts}, {work['output_tokens']} output tokens{sampling}")


def _provenance(name: str, record: dict) -> list[str]:
    machine, model, work, llama = record["machine"], record["model"], record["workload"], record["llama_server"]
    lines = [
        f"- machine: {machine['cpu_model']}, {machine['usable_cpus']} of {machine['logical_cpus']} CPUs usable, "
        f"flags {' '.join(machine['cpu_flags']) or 'none of avx2/avx512/amx'}",
        f"- model: `{model['file']}` (sha256 {model['sha256_prefix']}…); {work['requests']} requests a level, "
        f"{work['warmup_requests']} warm-up requests a server; llmserve: {work['target']}",
        f"- command: `{record['command']}`; result: `bench/results/openai_standard/{name}`",
    ]
    if llama:
        lines.append(f"- llama-server: {llama['version'].splitlines()[0] if llama['version'] else 'unknown version'}; "
                     f"build: {llama['build_options']}; run as `{llama.get('command', 'unknown')}`")
    return lines


def _cells(row: dict) -> tuple[str, str, str]:
    return (f"{row['output_tok_s']:.1f}", f"{row['ttft_ms_p50']:.0f} / {row['ttft_ms_p95']:.0f}",
            f"{row['itl_ms_p50']:.0f} / {row['itl_ms_p95']:.0f}")


def _ratio(servers: dict, level: int) -> str:
    """llmserve's output tok/s over llama-server's at one level of one pass."""
    return f"{servers['llmserve'][level]['output_tok_s'] / servers['llama-server'][level]['output_tok_s']:.2f}"


def _table(passes: list[dict]) -> list[str]:
    servers = list(passes[0]["servers"])
    paired = {"llama-server", "llmserve"} <= set(servers)
    header = ["pass (order)", "streams", *(f"{s} tok/s" for s in servers), *(["ratio"] if paired else []),
              *(f"{s} TTFT p50 / p95 ms" for s in servers), *(f"{s} ITL p50 / p95 ms" for s in servers)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for number, done in enumerate(passes, 1):
        order = " first" if len(done["order"]) > 1 else ""
        label = f"{number} ({done['order'][0]}{order})"
        for i, level in enumerate(done["servers"][servers[0]]):
            cells = {s: _cells(done["servers"][s][i]) for s in servers}
            ratio = [_ratio(done["servers"], i)] if paired else []
            row = [label, str(level["concurrency"]), *(cells[s][0] for s in servers), *ratio,
                   *(cells[s][1] for s in servers), *(cells[s][2] for s in servers)]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def render_run(name: str, record: dict) -> str:
    """One run as markdown: heading, provenance, one table row a pass and level."""
    return "\n".join([_heading(record), "", *_provenance(name, record), "", *_table(record["passes"])])


def render(runs: list[tuple[str, dict]]) -> str:
    """The whole generated region's body."""
    return "\n\n".join(render_run(name, record) for name, record in runs) if runs else EMPTY


def replace_region(text: str, body: str) -> str:
    """`text` with what lies between BEGIN and END replaced by `body`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no region between {BEGIN!r} and {END!r}")
    return f"{text[:start + len(BEGIN)]}\n{body}\n{text[end:]}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RUNS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc's region is stale")
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    updated = replace_region(text, render(load_runs(args.results)))
    if args.check:
        if updated != text:
            print(f"{args.doc} is stale: run python bench/report.py", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
