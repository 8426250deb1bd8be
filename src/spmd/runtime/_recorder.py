"""The flight recorder and the collective timeline: the Python side of native/cpu/recorder.h.

Every CPU collective and point-to-point call of a process is recorded in a ring (its group, its
number on the group, its signature hash, its bytes, its start and end time). Under ``spmd-run``
the ring is a file in the job's status directory, so that ``spmd-run`` can read what each rank
was doing when the job failed, also of a rank that was killed, and print where the ranks of a
group diverged (:func:`flight_report`). With ``SPMD_TIMELINE=dir`` each rank writes its calls as
Chrome trace events to ``dir/rank<N>.trace.json`` at exit, and ``spmd-run`` merges them into
``dir/timeline.json``, one track per rank (:func:`merge_timeline`), for Perfetto or
chrome://tracing. The GPU handlers are recorded from their start to the end of their enqueueing
on the stream (state "enqueued"); with ``SPMD_TIMELINE`` a pair of CUDA events gives each GPU
call the GPU's own start and end instead (state "done").
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

RECORD = np.dtype(
    [("seq", "<u8"), ("group", "<i8"), ("call", "<u8"), ("hash", "<u8"), ("start_ns", "<i8"),
     ("end_ns", "<i8"), ("bytes", "<u8"), ("code", "<i4"), ("state", "i1"),
     ("transport", "i1"), ("unused", "<i2")]
)  # fmt: skip
_HEADER = 64
_MAGIC = 0x3130434552444D53
CAPACITY = 4096  # the flight recorder's last calls
TIMELINE_CAPACITY = 1 << 18  # with SPMD_TIMELINE: the last 262144 calls (16 MiB)
_STATES = ("running", "done", "failed", "enqueued")
_ENDED = (1, 3)  # done, enqueued (a GPU call: its host side ended)
_P2P = "sendrecv"
_GPU = -2  # Record::transport of a GPU call (spmd/record.h)
_GPU_WAIT_S = 5.0  # at exit, how long the timeline waits for the GPU to finish its calls

_groups: dict[int, list[int]] = {}  # this process's native groups: id -> world ranks
_rank = -1


def timeline_dir(env: Any = os.environ) -> str:
    """Where ``SPMD_TIMELINE`` asks for the timeline ("" if it does not)."""
    return str(env.get("SPMD_TIMELINE", "") or "")


def start(rank: int) -> None:
    """Record this process's calls from now on (at ``spmd.init``): in the status directory of
    ``spmd-run`` if there is one, else in memory."""
    from .._native_lib import native

    global _rank
    _rank = rank
    status = os.environ.get("SPMD_RUN_STATUS_DIR", "")
    timeline = timeline_dir()
    path = os.path.join(status, f"rank{rank}.ring") if status else ""
    try:
        native.recorder_open(path, TIMELINE_CAPACITY if timeline else CAPACITY)
    except RuntimeError:
        native.recorder_open("", CAPACITY)  # the status directory is gone: keep recording
    if timeline:
        atexit.register(write_trace, timeline, rank)


def note_group(gid: int, ranks: list[int]) -> None:
    """Remember which world ranks native group ``gid`` has, for the reports (and ``spmd-run``)."""
    _groups[gid] = list(ranks)
    status = os.environ.get("SPMD_RUN_STATUS_DIR", "")
    if status and _rank >= 0:
        try:
            with open(os.path.join(status, f"rank{_rank}.groups"), "a") as f:
                f.write(json.dumps([gid, list(ranks)]) + "\n")
        except OSError:
            pass  # reporting must never fail a collective


def parse(data: bytes) -> np.ndarray:
    """The records of a ring's bytes (header and slots), oldest first."""
    if len(data) < _HEADER:
        return np.zeros(0, RECORD)
    magic, capacity, count = np.frombuffer(data, "<u8", 3)
    if int(magic) != _MAGIC:
        return np.zeros(0, RECORD)
    slots = np.frombuffer(data, RECORD, int(capacity), _HEADER)
    slots = slots[(slots["seq"] > 0) & (slots["seq"] <= count)]
    return np.sort(slots, order="seq")


def records() -> np.ndarray:
    """This process's records, oldest first."""
    from .._native_lib import native

    return parse(native.recorder_snapshot())


def _names() -> dict[int, str]:
    from .._native_lib import tables

    return {code: name for name, code in tables()["call_codes"].items()}


def _transports() -> dict[int, str]:
    from .._native_lib import tables

    codes = {code: name for name, code in tables()["transports"].items()}
    return codes | {-1: "mpi p2p", -2: "gpu"}


def trace_events(recs: np.ndarray, rank: int, groups: dict[int, list[int]]) -> list[dict[str, Any]]:
    """Chrome trace events of one rank's records: one complete event per call (calls still
    running end at the last record's time), on a track per group."""
    names, transports = _names(), _transports()
    last = int(max(recs["end_ns"].max(initial=0), recs["start_ns"].max(initial=0)))
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    for r in recs:
        end = int(r["end_ns"]) or last
        events.append({
            "name": names.get(int(r["code"]), "?"), "ph": "X", "pid": rank,
            "tid": f"group {groups.get(int(r['group']), int(r['group']))}",
            "ts": int(r["start_ns"]) / 1e3, "dur": max(end - int(r["start_ns"]), 0) / 1e3,
            "args": {"call": int(r["call"]), "bytes": int(r["bytes"]),
                     "transport": transports.get(int(r["transport"]), "?"),
                     "state": _STATES[int(r["state"])] if 0 <= r["state"] < 4 else "?"},
        })  # fmt: skip
    return events


def _gpu_times() -> None:
    """The GPU's own times of the GPU calls still waiting for them, into their records."""
    import sys

    if "spmd._native_cuda" not in sys.modules:  # no GPU group was set up
        return
    from .._native_lib import native_cuda

    mod = native_cuda()
    if mod is not None:
        mod.gpu_timing_flush(_GPU_WAIT_S)


def write_trace(directory: str, rank: int) -> None:
    """This rank's calls as ``directory/rank<rank>.trace.json`` (at exit, with SPMD_TIMELINE)."""
    try:
        _gpu_times()
        Path(directory).mkdir(parents=True, exist_ok=True)
        events = trace_events(records(), rank, _groups)
        path = Path(directory) / f"rank{rank}.trace.json"
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    except Exception:  # at exit, a report must never replace the program's end
        pass


def merge_timeline(directory: str) -> Path | None:
    """Merge the ranks' ``rank<N>.trace.json`` of ``directory`` into ``timeline.json`` (one
    track per rank, times shifted so that the first call starts at 0); None if there are none."""
    files = sorted(Path(directory).glob("rank*.trace.json"))
    if not files:
        return None
    events = []
    for f in files:
        try:
            events += json.loads(f.read_text())["traceEvents"]
        except (OSError, ValueError, KeyError):
            continue
    start = min((e["ts"] for e in events if e.get("ph") == "X"), default=0)
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - start, 3)
    out = Path(directory) / "timeline.json"
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


def _read_status_dir(directory: Path) -> dict[int, tuple[np.ndarray, dict[int, list[int]]]]:
    """Per rank: its records and its groups, from spmd-run's status directory."""
    out = {}
    for ring in directory.glob("rank*.ring"):
        try:
            rank = int(ring.name[4:-5])
            recs = parse(ring.read_bytes())
        except (OSError, ValueError):
            continue
        groups: dict[int, list[int]] = {}
        try:
            for line in (directory / f"rank{rank}.groups").read_text().splitlines():
                gid, ranks = json.loads(line)
                groups[int(gid)] = list(ranks)
        except (OSError, ValueError):
            pass
        out[rank] = (recs, groups)
    return out


def flight_report(directory: str | Path) -> list[str]:
    """Where the ranks of each group stood when the job ended, for the groups whose ranks had
    not all finished the same collectives: each rank's last collective on the group (its
    number, op, bytes and state, and how long a running one had been waiting), and the first
    collective whose signature differs between them, if any. Read from spmd-run's status
    directory; [] when every group's ranks agree."""
    names = _names()
    data = _read_status_dir(Path(directory))
    if not data:
        return []
    now = time.monotonic_ns()  # the ranks' clock (CLOCK_MONOTONIC, one machine)
    # (group's world ranks, GPU calls) -> rank -> {call number: record}; a group's GPU calls
    # are numbered apart from its CPU calls
    by_group: dict[tuple[tuple[int, ...], bool], dict[int, dict[int, Any]]] = {}
    for rank, (recs, groups) in data.items():
        for r in recs:
            if names.get(int(r["code"])) == _P2P:
                continue
            members = tuple(groups.get(int(r["group"]), ()))
            if rank not in members:
                continue
            key = (members, int(r["transport"]) == _GPU)
            by_group.setdefault(key, {}).setdefault(rank, {})[int(r["call"])] = r
    lines = []
    for (members, gpu), per_rank in sorted(by_group.items()):
        if not all(m in data for m in members):
            continue  # a rank whose records are missing (it never started recording)
        calls = {m: per_rank.get(m, {}) for m in members}
        last = {m: max(c) if c else 0 for m, c in calls.items()}
        running = any(int(r["state"]) not in _ENDED for c in calls.values() for r in c.values())
        common = set.intersection(*(set(c) for c in calls.values())) if calls else set()
        differ = sorted(k for k in common if len({int(calls[m][k]["hash"]) for m in members}) > 1)
        if len(set(last.values())) == 1 and not running and not differ:
            continue
        what = " (its GPU calls)" if gpu else ""
        lines.append(f"flight recorder: the group {list(members)}{what} when the job ended:")
        for m in members:
            if not last[m]:
                lines.append(f"  rank {m}: no collective on this group")
                continue
            r = calls[m][last[m]]
            state = _STATES[int(r["state"])] if 0 <= r["state"] < 4 else "?"
            if state == "enqueued":
                state = "enqueued on the GPU"
            elif state == "running":
                state = f"still running after {(now - int(r['start_ns'])) / 1e9:.1f} s"
            op = names.get(int(r["code"]), "?")
            lines.append(f"  rank {m}: collective #{last[m]} {op} of {int(r['bytes'])} bytes, "
                         f"{state}")  # fmt: skip
        if differ:
            k = differ[0]
            ops = ", ".join(f"rank {m} {names.get(int(calls[m][k]['code']), '?')}"
                            for m in members)  # fmt: skip
            lines.append(f"  first collective whose signature differs: #{k} ({ops})")
    return lines
