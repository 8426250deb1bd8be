"""The report: the console table as nccl-tests prints it, the Markdown report, and the JSON and
Markdown files written for benchmarks/results/."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._peers import SPMD
from ._timing import OPS, Result, busbw_factor, format_bytes


@dataclass(frozen=True)
class Files:
    """Where the report goes: ``collectives-<tag>.json`` and ``.md`` in ``out_dir``, and/or
    the JSON and Markdown files named (None: not written)."""

    out_dir: str | None = None
    json: str | None = None
    markdown: str | None = None


def _f(x: float, width: int, digits: int = 2) -> str:
    return f"{'n/a':>{width}}" if x != x else f"{x:{width}.{digits}f}"


def _ratio(spmd: Result | None, peer: Result) -> float:
    if spmd is None or not peer.busbw:
        return float("nan")
    return spmd.busbw / peer.busbw  # nan when either is n/a


def console_header(op: str, impls: Sequence[str], n: int, dtype: str) -> str:
    factor = busbw_factor(op, n)
    lines = [
        f"# {op}: {n} ranks, {dtype}; time = max over ranks of the median (us), "
        f"bandwidths in GB/s, busbw = algbw x {factor:.3g}; ratio = spmd busbw / peer busbw",
    ]
    top = f"#{'':>9} {'':>11} {'':>8}"
    sub = f"#{'size':>9} {'count':>11} {'dtype':>8}"
    for impl in impls:
        label = "spmd (jit)" if impl == SPMD else impl
        width = 30 if impl == SPMD else 37
        top += f" |{label:^{width}}"
        sub += f" |{'time':>10} {'algbw':>9} {'busbw':>9}"
        if impl != SPMD:
            sub += f" {'ratio':>6}"
    return "\n".join([*lines, top, sub])


def console_row(rows: dict[str, Result], impls: Sequence[str]) -> str:
    first = rows[impls[0]]
    line = f" {first.nbytes:>9} {first.count:>11} {first.dtype:>8}"
    spmd = rows.get(SPMD)
    for impl in impls:
        r = rows[impl]
        line += f" |{_f(r.time_s * 1e6, 10, 1)} {_f(r.algbw, 9)} {_f(r.busbw, 9)}"
        if impl != SPMD:
            line += f" {_f(_ratio(spmd, r), 6)}"
        if r.status == "WRONG RESULT":
            line += " WRONG"
    return line


def markdown(report: dict[str, Any], results: list[Result], impls: Sequence[str]) -> str:
    info = report["machine"]
    n = info["ranks"]
    out = [f"# Collectives benchmark: {n} ranks, {report['config']['dtype']}", ""]
    out += [f"Produced by `{report['command']}`.", ""]
    out += ["| machine | |", "|---|---|"]
    out += [f"| {k} | {v if v is not None else 'not installed'} |" for k, v in info.items()]
    out += [""]
    if report["skipped_peers"]:
        skipped = report["skipped_peers"].items()
        out += ["Peers skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped), ""]
    out += [
        f"Time: per rank the median of individually timed calls ({report['config']['rounds']} "
        "rounds over the implementations, each with its warm-up and one barrier), then the "
        "maximum over ranks, in microseconds. algbw = size / time, busbw = algbw x "
        "2(n-1)/n (allreduce), (n-1)/n (allgather, reduce_scatter, all_to_all), 1 (broadcast); "
        "GB/s are 1e9 bytes per second. ratio = spmd busbw / peer busbw: above 1, spmd is "
        "faster. spmd and mpi4jax run inside `jax.jit`; mpi4py on numpy buffers.",
        "",
    ]
    largest = _largest(results)
    if largest:
        out += ["## Largest size: spmd / peer (busbw ratio)", ""]
        peers = [i for i in impls if i != SPMD]
        out += ["| op | size | spmd busbw | " + " | ".join(peers) + " |"]
        out += ["|---" * (3 + len(peers)) + "|"]
        for op, rows in largest.items():
            spmd = rows.get(SPMD)
            cells = [_f(_ratio(spmd, rows[p]), 0).strip() if p in rows else "" for p in peers]
            busbw = _f(spmd.busbw, 0).strip() if spmd else "n/a"
            size = format_bytes(next(iter(rows.values())).nbytes)
            out += [f"| {op} | {size} | {busbw} | " + " | ".join(cells) + " |"]
        out += [""]
    for op in report["config"]["ops"]:
        op_rows = [r for r in results if r.op == op]
        if not op_rows:
            continue
        out += [f"## {op} (busbw = algbw x {busbw_factor(op, n):.3g})", ""]
        head = ["size (B)", "count", "dtype"]
        for impl in impls:
            label = "spmd" if impl == SPMD else impl
            head += [f"{label} us", f"{label} algbw", f"{label} busbw"]
            if impl != SPMD:
                head += [f"spmd/{label}"]
        out += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for nbytes in sorted({r.nbytes for r in op_rows}):
            rows = {r.impl: r for r in op_rows if r.nbytes == nbytes}
            first = rows[impls[0]]
            cells = [str(nbytes), str(first.count), first.dtype]
            for impl in impls:
                r = rows[impl]
                mark = " (wrong)" if r.status == "WRONG RESULT" else ""
                cells += [_f(r.time_s * 1e6, 0, 1).strip() + mark]
                cells += [_f(r.algbw, 0).strip(), _f(r.busbw, 0).strip()]
                if impl != SPMD:
                    cells += [_f(_ratio(rows.get(SPMD), r), 0).strip()]
            out += ["| " + " | ".join(cells) + " |"]
        na = not_run(op_rows)
        if na:
            out += ["", "n/a: " + "; ".join(na)]
        out += [""]
    if report.get("small_message"):
        out += ["## Small messages: one 4-byte float32 allreduce inside a jitted function", ""]
        out += ["| impl | with allreduce (us) | `x + 1` alone (us) | ratio | added (us) |"]
        out += ["|---|---:|---:|---:|---:|"]
        for row in report["small_message"]:
            cells = [row[k] for k in ("with_allreduce_us", "without_us", "ratio", "added_us")]
            out += [
                f"| {row['impl']} | "
                + " | ".join("-" if c is None else str(c) for c in cells)
                + " |"
            ]
        out += [""]
    if report.get("memcpy"):
        m = report["memcpy"]
        out += [
            "## Reference: numpy memcpy",
            "",
            f"`np.copyto` of {format_bytes(m['bytes'])}B on every rank at once: {m['time_us']} us, "
            f"{m['GBps']} GB/s (bytes copied / time; the memory moves twice that).",
            "",
        ]
    return "\n".join(out)


def not_run(results: Iterable[Result]) -> list[str]:
    """``impl: why`` for each implementation that did not run an op."""
    return sorted({f"{r.impl}: {r.status[5:]}" for r in results if r.status.startswith("n/a")})


def _largest(results: list[Result]) -> dict[str, dict[str, Result]]:
    out: dict[str, dict[str, Result]] = {}
    for op in OPS:
        rows = [r for r in results if r.op == op]
        if rows:
            top = max(r.nbytes for r in rows)
            out[op] = {r.impl: r for r in rows if r.nbytes == top}
    return out


def write_reports(
    files: Files,
    report: dict[str, Any],
    results: list[Result],
    impls: Sequence[str],
    tag: str,
) -> None:
    """Write the report where ``files`` asks, saying so for each file."""
    targets: list[tuple[str, str]] = []
    if files.out_dir:
        base = Path(files.out_dir) / f"collectives-{tag}"
        targets += [("json", f"{base}.json"), ("md", f"{base}.md")]
    if files.json:
        targets.append(("json", files.json))
    if files.markdown:
        targets.append(("md", files.markdown))
    for kind, path in targets:
        text = json.dumps(report, indent=1) if kind == "json" else markdown(report, results, impls)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
        shown = os.path.relpath(path) if os.path.isabs(path) else path
        print(f"wrote {shown}", flush=True)
