"""How long an elastic restart takes: a 2-rank data-parallel run (``tests/cli/_elastic_train.py``,
checkpointing every 3 steps) whose rank 1 SIGKILLs itself before step 7, under
``spmd-run --max-restarts 1``; the seconds from the kill (rank 1 prints the time just before it)
to the resumed run's first step (rank 0 prints the time once it has loaded the checkpoint), for
a restart on 2 ranks and on 1 (``--ranks-after-failure 1``). The time covers noticing the
death, stopping the job, starting the ranks again (Python, JAX, ``spmd.init``) and loading the
checkpoint.

    python benchmarks/elastic_restart.py [--rounds 5]

Writes benchmarks/results/elastic_restart-<cores>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRAIN = ROOT / "tests" / "cli" / "_elastic_train.py"


def run_one(work: Path, after: int) -> float:
    """Seconds from the kill to the resumed step, one run."""
    ckpt = tempfile.mkdtemp(dir=work)
    job = [sys.executable, str(TRAIN), ckpt, str(work / "out.npz"), "7"]
    cmd = [sys.executable, "-m", "spmd.cli.run", "--max-restarts", "1", "--ranks-after-failure",
           str(after), "-n", "2", *job]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"the run failed ({out.returncode}):\n{out.stderr}")
    killed = float(re.search(r"killed at ([\d.]+)", out.stdout).group(1))
    resumed = float(re.search(r"resumed at step 6 on \d+ ranks at ([\d.]+)", out.stdout).group(1))
    return resumed - killed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    from spmd.bench import cores_tag, host_info

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for after in (2, 1):
            runs = [run_one(Path(d), after) for _ in range(args.rounds)]
            rows.append({"ranks_after": after, "median_s": statistics.median(runs), "runs_s": runs})
            print(f"restart on {after} ranks: {statistics.median(runs):.2f} s "
                  f"(runs {', '.join(f'{s:.2f}' for s in runs)})", flush=True)  # fmt: skip
    info = {**host_info(), "rounds": args.rounds,
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"elastic_restart-{cores_tag()}"
    (out / f"{tag}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    md = ["# Elastic restart: from a rank's death to the resumed step", "",
          "Produced by `python benchmarks/elastic_restart.py" +
          (f" --rounds {args.rounds}" if args.rounds != 5 else "") + "`.", "",
          "| machine | |", "|---|---|", *[f"| {k} | {v} |" for k, v in info.items()], "",
          "A 2-rank job, rank 1 SIGKILLed before step 7, restarted by `spmd-run --max-restarts 1` "
          "and resumed by `spmd.elastic` from the checkpoint of step 6; seconds from the kill to "
          "the resumed run's first step, the median of the rounds.", "",
          "| restarted on | seconds (median) | runs |", "|---|---:|---|"]  # fmt: skip
    for r in rows:
        md.append(f"| {r['ranks_after']} ranks | {r['median_s']:.2f} | "
                  f"{', '.join(f'{s:.2f}' for s in r['runs_s'])} |")  # fmt: skip
    (out / f"{tag}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
