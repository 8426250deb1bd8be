"""spmd-bench under the real launcher: its numbers, its result check, the files it writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.bench import cores_tag, job_cores

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all")
BUS_FACTOR = {"allreduce": 1.0, "broadcast": 1.0}  # 2 ranks: 2(n-1)/n = 1; the rest (n-1)/n


def _bench(out: Path, *extra: str) -> tuple[dict, str]:
    cmd = [
        sys.executable, "-m", "spmd.cli.bench", "-n", "2", "--ops", ",".join(OPS),
        "--sizes", "4,64K", "--iters", "3", "--warmup", "1", "--rounds", "2",
        "--peers", "mpi4py", "--out-dir", str(out), "--timeout", "150", *extra,
    ]  # fmt: skip
    env = {**os.environ, "SPMD_TIMEOUT": "60"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(out.glob("collectives-*.json"))
    assert [f.name for f in files] == [f"collectives-{cores_tag()}-n2.json"]
    report = json.loads(files[0].read_text())
    report["markdown"] = files[0].with_suffix(".md").read_text()
    return report, run.stdout


def test_spmd_bench_measures_every_op_and_checks_every_result(tmp_path: Path) -> None:
    report, console = _bench(tmp_path)
    rows = {(r["op"], r["impl"], r["bytes"]): r for r in report["results"]}
    impls = ("spmd", "mpi4py", "mpi4py-inplace")
    assert report["config"]["implementations"] == list(impls)
    assert report["config"]["check"] is True
    # 4 bytes of float32 is one element: rounded up to one per rank where the op splits it.
    sizes = {op: (4 if op in ("allreduce", "broadcast") else 8, 65536) for op in OPS}
    assert set(rows) == {(op, impl, b) for op in OPS for impl in impls for b in sizes[op]}
    for (op, _impl, nbytes), r in rows.items():
        assert r["status"] == "ok", r  # every result was compared with the expected values
        assert r["count"] * 4 == nbytes and r["dtype"] == "float32"
        assert r["iters"] == 3 * 2  # iters x rounds
        assert len(r["rank_median_us"]) == 2
        # the slowest rank sets the time; the bandwidths follow from it
        assert r["time_us"] == max(r["rank_median_us"]) > 0
        algbw = nbytes / (r["time_us"] * 1e-6) / 1e9
        assert r["algbw_GBps"] == pytest.approx(algbw, rel=1e-3, abs=1e-4)
        busbw = algbw * BUS_FACTOR.get(op, 0.5)
        assert r["busbw_GBps"] == pytest.approx(busbw, rel=1e-3, abs=1e-4)
    small = {row["impl"]: row for row in report["small_message"]}
    assert small["spmd"]["with_allreduce_us"] > 0 and small["spmd"]["without_us"] > 0
    machine = report["machine"]
    assert machine["ranks"] == 2 and machine["spmd_transport"] == "shm"
    assert machine["spmd_shm_staging"] == "auto"
    for when in ("start", "end"):  # a real timing: positive, and under a millisecond per hop
        assert 0 < machine[f"shm_hop_ns_at_{when}"] < 1e6
    assert machine["job_cores"] == job_cores() and machine["cores"] == os.cpu_count()
    # what the console and the Markdown show
    for op in OPS:
        assert f"## {op} " in report["markdown"]
        assert f"# {op}: 2 ranks, float32" in console
    assert "WRONG" not in console + report["markdown"]
    # a record to commit: no host name, no absolute path
    text = json.dumps(report) + report["markdown"]
    assert socket.gethostname() not in text
    assert str(tmp_path) not in text and str(Path.cwd()) not in text


def test_results_are_tagged_with_the_cores_the_job_was_given() -> None:
    total = os.cpu_count() or 1

    def tag(env: dict[str, str], cpus: set[int] | None = None) -> str:
        env = {**{k: v for k, v in os.environ.items() if k != "SPMD_BIND_CPUS"}, **env}
        # the child narrows its own affinity first (a preexec_fn would make subprocess fork a
        # process in which JAX runs threads)
        code = (f"import os; os.sched_setaffinity(0, {sorted(cpus)})\n" if cpus else "") + (
            "from spmd.bench import cores_tag, job_cores; print(job_cores(), cores_tag())"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        return out.stdout.strip()

    mine = sorted(os.sched_getaffinity(0))
    whole = len(mine)
    assert tag({}) == f"{whole} cpu{whole}" + ("" if whole >= total else f"of{total}")
    # spmd-run records the job's cores before it pins each rank to its share
    assert tag({"SPMD_BIND_CPUS": ",".join(map(str, mine))}, {mine[0]}) == tag({})
    if total > 1:
        # a job given one core of several (taskset, a cpuset) must not overwrite a whole
        # machine's results
        assert tag({}, {mine[0]}) == f"1 cpu1of{total}"
        assert tag({"SPMD_BIND_CPUS": str(mine[0])}) == f"1 cpu1of{total}"


def test_quick_is_allreduce_at_three_sizes_against_mpi4py(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "spmd.cli.bench", "--quick", "--out-dir", str(tmp_path),
           "--timeout", "150"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = tmp_path.glob("collectives-*.json")
    report = json.loads(path.read_text())
    rows = {(r["op"], r["impl"], r["bytes"]) for r in report["results"]}
    impls = ("spmd", "mpi4py", "mpi4py-inplace")
    assert rows == {("allreduce", i, b) for i in impls for b in (4, 65536, 4 << 20)}
    assert all(r["status"] == "ok" and r["iters"] == 20 for r in report["results"])
    assert not report["small_message"]  # the small-message section is skipped


def test_several_transports_are_measured_side_by_side(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "spmd.cli.bench", "-n", "2", "--ops", "allreduce,all_to_all",
           "--sizes", "4,1M", "--iters", "3", "--rounds", "1", "--peers", "none", "--no-small",
           "--transport", "shm,mpi", "--out-dir", str(tmp_path), "--timeout", "150"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = tmp_path.glob("collectives-*.json")
    assert path.name == f"collectives-{cores_tag()}-n2-shm+mpi.json"
    report = json.loads(path.read_text())
    assert report["config"]["implementations"] == ["spmd-shm", "spmd-mpi"]
    assert report["machine"]["spmd_transport"] == "shm+mpi"
    rows = {(r["op"], r["impl"], r["bytes"]): r["status"] for r in report["results"]}
    assert rows == {
        (op, impl, b): "ok"
        for op in ("allreduce", "all_to_all")
        for impl in ("spmd-shm", "spmd-mpi")
        for b in ((4 if op == "allreduce" else 8), 1 << 20)
    }


def test_transport_lists_that_cannot_be_compared() -> None:
    from spmd import SpmdError
    from spmd.cli.bench import parser, resolve_args

    with pytest.raises(SpmdError, match="unknown transport gloo; expected some of auto, shm"):
        resolve_args(parser().parse_args(["--transport", "shm,gloo"]))
    with pytest.raises(SpmdError, match="name the transports to compare"):
        resolve_args(parser().parse_args(["--transport", "auto,mpi"]))
    assert resolve_args(parser().parse_args(["--transport", "hier, mpi"])).transport == "hier,mpi"
