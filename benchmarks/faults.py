"""How fast a job ends, and what it says, when one rank fails: each fault of the table below, in a
2-rank job under ``spmd-run`` (defaults, except where the row says), rank 0 waiting in a
collective while rank 1 fails. Per fault: the seconds from the fault to the end of ``spmd-run``
(the fault's moment is written by rank 1 just before it), the exit code, whether the error names
rank 1, and what the job left in ``/dev/shm`` and the temporary directory.

    python benchmarks/faults.py [--rounds 3]

Writes benchmarks/results/faults-<cores>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

PRE = "import os, signal, sys, time, ctypes\nimport jax.numpy as jnp\nimport spmd\n"
MARK = "open(os.environ['FAULT_MARK'], 'w').write(repr(time.time()))\n"
# name: (what rank 1 does after one collective with rank 0, extra environment, what names it)
FAULTS: dict[str, tuple[str, dict[str, str], str]] = {
    "raises": ("raise ValueError('rank 1 gives up')", {}, "rank 1 failed: ValueError"),
    "SIGKILL": ("os.kill(os.getpid(), signal.SIGKILL)", {}, "rank 1 failed: killed by SIGKILL"),
    "segfault": ("ctypes.string_at(0)", {}, "rank 1 failed: killed by SIGSEGV"),
    "sys.exit(0) early": ("sys.exit(0)", {}, "rank 1 is exiting"),
    "os._exit(0) early": ("os._exit(0)", {}, "rank 1 has ended"),
    "stalls (SPMD_STALL_WARN=2, SPMD_TIMEOUT=8)": (
        "time.sleep(60)",
        {"SPMD_STALL_WARN": "2", "SPMD_TIMEOUT": "8"},
        "for rank 1",
    ),
    "SIGSTOP (SPMD_STALL_WARN=2, SPMD_TIMEOUT=8)": (
        "os.kill(os.getpid(), signal.SIGSTOP)",
        {"SPMD_STALL_WARN": "2", "SPMD_TIMEOUT": "8"},
        "for rank 1",
    ),
}


def _script(action: str) -> str:
    return (
        PRE + "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        f"if comm.rank == 1:\n    {MARK.strip()}\n    {action}\n"
        "spmd.allreduce(jnp.ones(3))\n"
    )


def _leftovers() -> set[str]:
    tmp = tempfile.gettempdir()
    patterns = ["/dev/shm/mpich_shm_*", "/dev/shm/spmd-*"]
    patterns += [os.path.join(tmp, "hydra_hwloc_xmlfile_*"), os.path.join(tmp, "spmd-run-*")]
    return {path for pattern in patterns for path in glob.glob(pattern)}


def run_one(name: str, work: Path) -> dict[str, Any]:
    action, env, names = FAULTS[name]
    script = work / "fault.py"
    script.write_text(_script(action))
    mark = work / "mark"
    mark.unlink(missing_ok=True)
    before = _leftovers()
    cmd = [sys.executable, "-m", "spmd.cli.run", "-n", "2", sys.executable, str(script)]
    full = {**os.environ, **env, "FAULT_MARK": str(mark)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=120)
    end = time.time()
    time.sleep(0.5)  # what a dying process still had open
    left = sorted(_leftovers() - before)
    fault_at = float(mark.read_text()) if mark.exists() else float("nan")
    return {
        "fault": name,
        "seconds_to_end": round(end - fault_at, 2),
        "exit_code": out.returncode,
        "names_rank_1": names in out.stderr,
        "left_behind": left,
        "stall_report": "stalled" in out.stderr,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    from spmd.bench import cores_tag, host_info

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for name in FAULTS:
            runs = [run_one(name, Path(d)) for _ in range(args.rounds)]
            seconds = [r["seconds_to_end"] for r in runs]
            row = {**runs[-1], "seconds_to_end": statistics.median(seconds), "runs_s": seconds,
                   "names_rank_1": all(r["names_rank_1"] for r in runs),
                   "left_behind": sorted({p for r in runs for p in r["left_behind"]})}  # fmt: skip
            rows.append(row)
            print(f"{name:45s} {row['seconds_to_end']:6.2f} s  exit {row['exit_code']:3d}  "
                  f"names rank 1: {row['names_rank_1']}  left: {len(row['left_behind'])}",
                  flush=True)  # fmt: skip
    info = {**host_info(), "rounds": args.rounds,
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"faults-{cores_tag()}"
    (out / f"{tag}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    md = ["# Faults: how fast a 2-rank job ends, and what it says", "",
          "Produced by `python benchmarks/faults.py" +
          (f" --rounds {args.rounds}" if args.rounds != 3 else "") + "`.", "",
          "| machine | |", "|---|---|", *[f"| {k} | {v} |" for k, v in info.items()], "",
          "Seconds from the fault (rank 1 writes the time just before it) to the end of "
          "`spmd-run`, the median of the rounds; rank 0 waits in an allreduce meanwhile.", "",
          "| fault of rank 1 | seconds to the end | runs | exit code | error names rank 1 | "
          "stall report | left behind |", "|---|---:|---|---:|---|---|---:|"]  # fmt: skip
    for r in rows:
        yes = {k: "yes" if r[k] else "no" for k in ("names_rank_1", "stall_report")}
        md.append(f"| {r['fault']} | {r['seconds_to_end']:.2f} | "
                  f"{', '.join(f'{s:.2f}' for s in r['runs_s'])} | {r['exit_code']} | "
                  f"{yes['names_rank_1']} | {yes['stall_report']} | "
                  f"{len(r['left_behind'])} |")  # fmt: skip
    (out / f"{tag}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
