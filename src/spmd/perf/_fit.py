"""Fitting the link parameters to measured calls, and reading ``spmd-bench`` reports.

A measurement is one call's op, size, group layout, algorithm and median time. Each one gives a
linear equation ``collective_cost(...) . params = seconds``; :func:`fit` solves them for
non-negative parameters, weighting each by 1 / seconds so that a 4-byte call counts as much as a
64 MiB one (the error minimised is the relative one)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import SpmdError
from ._collectives import PARAMS, Links, collective_cost


@dataclass(frozen=True)
class Measurement:
    """One measured call: ``seconds`` for ``op`` of ``nbytes`` on ``nodes`` x ``per_node`` ranks
    by ``algorithm`` (``shm``, ``hier`` or ``mpi``)."""

    op: str
    nbytes: int
    nodes: int
    per_node: int
    algorithm: str
    seconds: float

    def predicted(self, links: Links) -> float:
        return links.time(self.op, self.nbytes, self.nodes, self.per_node, self.algorithm)


# spmd-bench's implementations that are spmd under a transport it names.
_IMPLS = {"spmd-shm": "shm", "spmd-hier": "hier", "spmd-mpi": "mpi"}


def read_bench(path: str | Path, nodes: int, per_node: int) -> list[Measurement]:
    """spmd's rows of an ``spmd-bench --json`` report of a job on ``nodes`` x ``per_node`` ranks
    (the report does not know the nodes: spmd-run's ``--hosts``/``--nodes`` do). A plain
    ``spmd`` column counts under the transport the report names."""
    report: dict[str, Any] = json.loads(Path(path).read_text())
    chosen = str(report["machine"].get("spmd_transport", ""))
    out = []
    for row in report["results"]:
        algorithm = _IMPLS.get(row["impl"], chosen if row["impl"] == "spmd" else None)
        if algorithm not in ("shm", "hier", "mpi") or row["status"] != "ok":
            continue
        out.append(Measurement(row["op"], int(row["bytes"]), nodes, per_node, algorithm,
                               row["time_us"] * 1e-6))  # fmt: skip
    if not out:
        raise SpmdError(f"{path}: no spmd rows measured under shm, hier or mpi", rank=None)
    return out


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares (Lawson and Hanson's active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        candidates = np.where(~passive & (w > 1e-12 * max(1.0, float(np.abs(w).max()))))[0]
        if candidates.size == 0:
            break
        passive[candidates[np.argmax(w[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > 1e-18
    return x


def fit(measurements: Iterable[Measurement], fixed: dict[str, float] | None = None) -> Links:
    """The parameters that best explain ``measurements`` (relative least squares, all >= 0).

    ``fixed`` holds parameters known already (e.g. a shaped link's ``net_beta``); a parameter
    that no measurement involves must be fixed, else it is an error naming it."""
    rows = list(measurements)
    fixed = dict(fixed or {})
    free = [p for p in PARAMS if p not in fixed]
    a = np.zeros((len(rows), len(free)))
    b = np.zeros(len(rows))
    for i, m in enumerate(rows):
        cost = collective_cost(m.op, m.nbytes, m.nodes, m.per_node, m.algorithm)
        known = sum(c * fixed[k] for k, c in cost.items() if k in fixed)
        a[i] = [cost.get(p, 0.0) / m.seconds for p in free]
        b[i] = (m.seconds - known) / m.seconds
    unused = [p for j, p in enumerate(free) if not a[:, j].any()]
    if unused:
        raise SpmdError(
            f"no measurement involves {', '.join(unused)}: measure a layout that uses it, or "
            "pass its value in fixed",
            rank=None,
        )
    scale = np.abs(a).max(0)
    x = _nnls(a / scale, b) / scale
    return Links.of({**fixed, **dict(zip(free, x, strict=True))})


def compare(measurements: Sequence[Measurement], links: Links) -> list[dict[str, Any]]:
    """Predicted against measured, row by row (``error``: predicted / measured - 1)."""
    out = []
    for m in measurements:
        p = m.predicted(links)
        out.append({"op": m.op, "bytes": m.nbytes, "nodes": m.nodes, "per_node": m.per_node,
                    "algorithm": m.algorithm, "measured_us": m.seconds * 1e6,
                    "predicted_us": p * 1e6, "error": p / m.seconds - 1})  # fmt: skip
    return out
