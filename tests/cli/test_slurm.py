"""spmd under Slurm: a private single-node cluster (tests/_slurm.py), jobs of 2 ranks started by
srun with the MPICH wheel. Skipped, with the reason, where Slurm's daemons are missing or cannot
start (not root, no packages)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .. import _slurm
from ..test_readme import _first_block
from .test_run import spmd_run

REASON = _slurm.unavailable()
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "Slurm available")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "slurm.md"


def _cluster(nodes: int) -> Iterator[_slurm.Slurm]:
    cluster = _slurm.Slurm(nodes)
    # The job's `python` is this one, as in a shell with the virtual environment active.
    bindir = os.path.dirname(sys.executable)
    cluster.env["PATH"] = os.pathsep.join([bindir, cluster.env.get("PATH", "")])
    if nodes > 1:  # test hosts share one kernel: UCX over TCP, as spmd-run --hosts sets it
        cluster.env["UCX_TLS"] = "tcp,self"
    try:
        cluster.start()
    except _slurm.SlurmUnavailable as e:
        cluster.stop()
        pytest.skip(f"a private Slurm did not start: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def slurm() -> Iterator[_slurm.Slurm]:
    yield from _cluster(1)


def _batch_script(index: int) -> str:
    """The docs' batch scripts, in order (0: one node, 1: two nodes)."""
    return re.findall(r"```bash\n(#!/bin/bash\n.*?)```", DOCS.read_text(), re.S)[index]


def _job_output(path: Path) -> str:
    return path.read_text() if path.exists() else "(no output file)"


def test_the_docs_batch_script_runs_the_first_example_as_spmd_run_does(slurm, tmp_path):
    (tmp_path / "first.py").write_text(_first_block())
    script = tmp_path / "first.sh"
    script.write_text(_batch_script(0))
    job = slurm.sbatch(script)
    expected, _ = spmd_run("-n", "2", sys.executable, str(tmp_path / "first.py"))
    assert expected.returncode == 0, expected.stderr
    slurm.wait_gone(job, timeout=120)
    output = _job_output(tmp_path / f"first-{job}.out")
    assert output == expected.stdout, _slurm.node_state_reason(slurm)
    assert "rank 0 of 2: loss" in output and "allreduce" in output


_TRAIN = """\
import socket
import jax.numpy as jnp
import spmd
comm = spmd.init()
total = spmd.allreduce(jnp.arange(4.0) * (comm.rank + 1))
print(f"rank {comm.rank} of {comm.size} on {socket.gethostname()}: nodes {list(comm.node_ids)}, "
      f"sum {total.tolist()}", flush=True)
"""


def test_the_docs_two_node_batch_script_runs_a_rank_on_each_node(tmp_path):
    """The docs' two-node script on a two-node cluster (test hosts h0 and h1): one rank on
    each node, spmd sees two nodes, and the allreduce between them is right."""
    clusters = _cluster(2)
    cluster = next(clusters)
    try:
        (tmp_path / "train.py").write_text(_TRAIN)
        script = tmp_path / "train.sh"
        script.write_text(_batch_script(1))
        job = cluster.sbatch(script)
        cluster.wait_gone(job, timeout=120)
        output = _job_output(tmp_path / f"train-{job}.out")
    finally:
        clusters.close()
    nodes = "nodes ['h0', 'h1'], sum [0.0, 3.0, 6.0, 9.0]"
    assert f"rank 0 of 2 on h0: {nodes}" in output, output
    assert f"rank 1 of 2 on h1: {nodes}" in output, output


_FAIL = """\
import os
import jax.numpy as jnp
import spmd
comm = spmd.init()
print(f"pid {comm.rank} {os.getpid()}", flush=True)
if comm.rank == 1:
    raise ValueError("rank 1 got a bad batch")
spmd.allreduce(jnp.ones(3)).block_until_ready()  # waits for rank 1 for ever, unless stopped
print("rank 0 passed the allreduce", flush=True)
"""


def test_a_failing_rank_is_named_and_ends_the_step(slurm, tmp_path):
    (tmp_path / "fail.py").write_text(_FAIL)
    start = time.monotonic()
    out = slurm.run("srun", "-n", "2", "--mpi=pmi2", sys.executable, "fail.py", check=False,
                    timeout=90, cwd=tmp_path)  # fmt: skip
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout + out.stderr
    assert took < 45, f"srun took {took:.1f} s after a rank failed: {out.stderr}"
    assert "[rank 1] ValueError: rank 1 got a bad batch" in out.stderr, out.stderr
    assert "[rank 0]" not in out.stderr, out.stderr
    assert "passed the allreduce" not in out.stdout, out.stdout
    pids = [int(line.split()[2]) for line in out.stdout.splitlines() if line.startswith("pid ")]
    assert len(pids) == 2, out.stdout
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "a rank outlived the step"


_WAIT = """\
import os, time
import jax.numpy as jnp
import spmd
comm = spmd.init()
spmd.allreduce(jnp.ones(1 << 16)).block_until_ready()
maps = [line.split(None, 5)[-1].strip() for line in open("/proc/self/maps")]
shm = sorted({m.removesuffix(" (deleted)") for m in maps if m.startswith("/dev/shm/")})
print("ready", comm.rank, os.getpid(), *shm, flush=True)
while True:
    spmd.allreduce(jnp.ones(4)).block_until_ready()
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def cancelled(slurm, tmp_path_factory) -> Iterator[dict]:
    """A job of 2 ranks in a collective loop, cancelled with scancel once both are running:
    the ranks' pids, the /dev/shm segments they had mapped, and how long the job took to go."""
    tmp = tmp_path_factory.mktemp("scancel")
    (tmp / "wait.py").write_text(_WAIT)
    script = tmp / "wait.sh"
    script.write_text(_batch_script(0).replace("first", "wait"))
    job = slurm.sbatch(script)
    output = tmp / f"wait-{job}.out"
    ready: list[list[str]] = []
    deadline = time.monotonic() + 120
    while len(ready) < 2:
        assert time.monotonic() < deadline, _job_output(output)
        assert job in slurm.jobs(), f"the job ended before it was cancelled: {_job_output(output)}"
        text = output.read_text() if output.exists() else ""
        ready = [line.split()[1:] for line in text.splitlines() if line.startswith("ready ")]
        time.sleep(0.2)
    slurm.run("scancel", str(job))
    gone_s = slurm.wait_gone(job, timeout=30)
    pids = [int(r[1]) for r in ready]
    segments = sorted({s for r in ready for s in r[2:]})
    left = [s for s in segments if os.path.exists(s)]  # at once: other jobs' spmd-run may clean
    yield {"pids": pids, "segments": segments, "left": left, "gone_s": gone_s,
           "output": _job_output(output)}  # fmt: skip
    for path in segments:  # what the killed ranks left (MPICH's segment), once the tests saw it
        if os.path.exists(path) and "(deleted)" not in path:
            os.unlink(path)


def test_scancel_ends_a_running_job_and_its_ranks(cancelled):
    assert cancelled["gone_s"] < 15, cancelled["output"]
    assert "CANCELLED" in cancelled["output"]
    assert not [p for p in cancelled["pids"] if os.path.exists(f"/proc/{p}")], "a rank lives on"
    # The ranks had spmd's segment and MPICH's mapped (both already unlinked).
    assert any("/spmd-" in s for s in cancelled["segments"]), cancelled["segments"]
    assert any("/mpich_shm_" in s for s in cancelled["segments"]), cancelled["segments"]
    assert not [s for s in cancelled["left"] if "/spmd-" in s]


def test_scancel_leaves_nothing_in_dev_shm(cancelled):
    """Nothing of MPICH runs after scancel kills the ranks to remove its segment: spmd.init
    unlinked it (and spmd's own) once every rank had mapped it."""
    assert cancelled["left"] == []


_INIT = "import spmd\nspmd.init()\nprint('started', flush=True)\n"


@pytest.mark.parametrize("mpi", ["--mpi=pmix", None], ids=["pmix", "no-mpi-option"])
def test_srun_routes_mpich_cannot_use_get_the_advice_on_every_rank(slurm, tmp_path, mpi):
    (tmp_path / "init.py").write_text(_INIT)
    option = [mpi] if mpi else []
    out = slurm.run("srun", "-n", "2", *option, sys.executable, "init.py", check=False,
                    timeout=90, cwd=tmp_path)  # fmt: skip
    if mpi == "--mpi=pmix" and "plugin" in out.stderr and "SpmdError" not in out.stderr:
        pytest.skip(f"this Slurm has no usable PMIx plugin: {out.stderr.strip()}")
    assert out.returncode != 0 and "started" not in out.stdout, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("spmd._errors.")]
    assert sorted(e.split(":")[1] for e in errors) == [" rank 0", " rank 1"], out.stderr
    for error in errors:
        assert "Add --mpi=pmi2 to srun" in error, error
    if mpi == "--mpi=pmix":
        assert all("srun started this task with PMIx (SLURM_MPI_TYPE=pmix" in e for e in errors)
        assert "unsupported PMI version" not in out.stderr  # refused before MPI_Init
    else:
        assert all("srun started 2 tasks" in e and "world of 1" in e for e in errors), errors


_VOID = (
    "import spmd\ncomm = spmd.init()\n"
    "print(comm.backend, comm.rank, comm.size, sum(comm.allgather_object(comm.rank + 1)), "
    "flush=True)\nspmd.finalize()\n"
)


def test_void_communicator_takes_rank_and_size_from_srun(slurm, tmp_path):
    (tmp_path / "void.py").write_text(_VOID)
    store = tmp_path / "store"
    env = {"SPMD_COMMUNICATOR": "void", "SPMD_FILE_STORE_PATH": str(store)}
    slurm.env.update(env)
    try:  # both routes at once (each step's tasks share their own namespace in the store)
        runs = [
            subprocess.Popen(
                [slurm.which("srun"), "-n", "2", *option, sys.executable, "void.py"],
                env=slurm.env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for option in ([], ["--mpi=pmix"])
        ]
        results = [run.communicate(timeout=90) for run in runs]
    finally:
        for name in env:
            del slurm.env[name]
    for (stdout, stderr), run, route in zip(
        results, runs, ["srun", "srun --mpi=pmix"], strict=True
    ):
        if route.endswith("pmix") and "plugin" in stderr and run.returncode != 0:
            continue  # no PMIx plugin in this Slurm: the first route still counts
        assert run.returncode == 0, f"{route}: {stderr}"
        assert sorted(stdout.splitlines()) == ["void 0 2 3", "void 1 2 3"], f"{route}: {stdout}"
    assert list(store.iterdir()) == []  # finalize removed the bootstrap files
