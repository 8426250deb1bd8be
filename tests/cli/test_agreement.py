"""Ranks that cannot agree, under the real launcher: a collective one rank has given up on
completes on no rank (the late rank's call fails too, naming the first failure); ranks that wait
for each other in different calls (a deadlock) all fail within about a second, naming every
rank's wait, and ranks that wait for one that computes are no deadlock."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import textwrap

import pytest

from .. import _leftovers as leftovers

SPMD_RUN = [sys.executable, "-m", "spmd.cli.run"]


def _run(script, nprocs, env):
    return subprocess.run([*SPMD_RUN, "-n", str(nprocs), sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})  # fmt: skip


def test_a_collective_a_rank_gave_up_on_fails_on_the_late_rank_too(tmp_path):
    """Rank 0 times out waiting for rank 1 in an allreduce (SPMD_TIMEOUT=2); rank 1 arrives a
    second later. It used to get the full sum from rank 0's staged values, so that the ranks
    disagreed on whether the step happened; now its call fails naming rank 0's timeout, and the
    group refuses later calls on both ranks."""
    script = tmp_path / "late.py"
    script.write_text(
        textwrap.dedent("""
        import time
        import jax.numpy as jnp
        import spmd
        comm = spmd.init()
        assert float(spmd.allreduce(jnp.ones(3))[0]) == 2.0
        if comm.rank == 1:
            time.sleep(3)
        for attempt in ("late", "after"):
            try:
                got = spmd.allreduce(jnp.ones(3) * (comm.rank + 1))
                print(comm.rank, attempt, "completed", float(got[0]), flush=True)
            except spmd.SpmdError as e:
                print(comm.rank, attempt, "error:", e, flush=True)
    """)
    )
    out = _run(script, 2, {"SPMD_TIMEOUT": "2", "SPMD_TRANSPORT": "shm"})
    lines = {tuple(line.split(" ", 2)[:2]): line for line in out.stdout.splitlines()}
    assert "completed" not in out.stdout, out.stdout
    timeout = ("timed out after 2 s waiting for ranks [1] of the group [0, 1] (collective #2): "
               "they never made the matching call")  # fmt: skip
    assert timeout in lines["0", "late"], out.stdout
    assert (
        "rank 1: allreduce: collective #2 of the group [0, 1] failed on rank 0 before this rank "
        f"could complete it (so no rank completes it): {timeout}"
    ) in lines["1", "late"], out.stdout
    assert "is unusable: an earlier collective timed out" in lines["0", "after"], out.stdout
    assert "is unusable: rank 0 failed an earlier collective" in lines["1", "after"], out.stdout


_DEADLOCK = """
import time
import jax.numpy as jnp
import spmd
comm = spmd.init()
spmd.barrier()
start = time.monotonic()
try:
    if comm.rank < 2:
        spmd.barrier()
    else:
        spmd.allreduce(jnp.ones(2), rank_list=[[0, 2], [1, 3]])
    print(comm.rank, "completed", flush=True)
except spmd.SpmdError as e:
    print(f"{comm.rank} after {time.monotonic() - start:.1f} s: {e}", flush=True)
"""


@pytest.mark.parametrize("transport, nodes", [("shm", 1), ("mpi", 1), ("mpi", 2)])
def test_ranks_that_wait_for_each_other_in_different_calls_fail_within_seconds(
    tmp_path, transport, nodes
):
    """The deadlock of the issue: ranks 0 and 1 in a world barrier, ranks 2 and 3 making the
    groups [0, 2] and [1, 3]. Nothing can move: every rank fails within about a second (it used
    to wait for SPMD_TIMEOUT, 300 s), naming what each rank waits for. On two (simulated) nodes
    no segment holds the board: rank 0's peer watch reads every rank's wait over TCP."""
    script = tmp_path / "deadlock.py"
    script.write_text(_DEADLOCK)
    out = _run(script, 4, {"SPMD_TRANSPORT": transport, "SPMD_SIMULATE_NODES": str(nodes)})
    over = " over MPI" if transport == "mpi" else ""
    waits = (
        f"rank 0 waits in barrier() of no arrays{over} (collective #2 of the group [0, 1, 2, "
        f"3]); rank 1 waits in barrier() of no arrays{over} (collective #2 of the group [0, 1, "
        "2, 3]); rank 2 waits in creating the communicator of ranks [0, 2]; rank 3 waits in "
        "creating the communicator of ranks [1, 3]"
    )
    lines = sorted(out.stdout.splitlines())
    assert len(lines) == 4, out.stdout + out.stderr
    for rank, line in enumerate(lines):
        assert line.startswith(f"{rank} after "), line
        took = float(line.split()[2])
        assert took < 5, f"rank {rank} waited {took} s"
        assert waits in line, line
        assert "deadlock: every rank of the job waits inside spmd" in line, line


@pytest.mark.parametrize("nodes", [1, 2])
def test_ranks_waiting_for_one_that_computes_are_no_deadlock(tmp_path, nodes):
    """Ranks 0 and 1 wait in a barrier for 2 s while rank 2 computes (a sleep), then joins: no
    error. Then ranks 0 and 1 wait in a group of their own while rank 2 waits alone in the
    group [2] of the same rank_list: every wait completes. Also on two (simulated) nodes, where
    rank 0's peer watch reads the waits."""
    script = tmp_path / "busy.py"
    script.write_text(
        textwrap.dedent("""
        import time
        import jax.numpy as jnp
        import spmd
        comm = spmd.init()
        spmd.barrier()
        if comm.rank == 2:
            time.sleep(2)
        spmd.barrier()
        got = spmd.allreduce(jnp.ones(2) * comm.rank, rank_list=[[0, 1], [2]])
        print(comm.rank, "completed", float(got[0]), flush=True)
    """)
    )
    out = _run(script, 3, {"SPMD_SIMULATE_NODES": str(nodes)})
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["0 completed 1.0", "1 completed 1.0",
                                               "2 completed 2.0"]  # fmt: skip


def test_a_job_killed_under_plain_mpiexec_leaves_no_segment():
    """Under MPICH's own mpiexec (no spmd-run to clean up after it), rank 1 is killed by
    SIGKILL after a collective and mpiexec ends the job: MPICH's segment (mpich_shm_*, 2 MiB,
    removed by MPICH only in MPI_Finalize) and spmd's are gone, since spmd unlinks them once
    every rank has mapped them."""
    import shutil

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                           + os.environ.get("PATH", ""))  # fmt: skip
    assert mpiexec is not None
    patterns = ["/dev/shm/mpich_shm_*", "/dev/shm/spmd-*"]
    before = leftovers.files(patterns)
    code = (
        "import os, signal, time, spmd, jax.numpy as jnp\n"
        "comm = spmd.init()\n"
        "spmd.allreduce(jnp.ones(2))\n"
        "if comm.rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_", "PMI"))}
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode != 0, out.stderr
    assert leftovers.new_files(patterns, before) == set()


def test_a_job_aborted_under_plain_mpiexec_leaves_no_topology_file():
    """Rank 1 raises under MPICH's own mpiexec: spmd stops the job with MPI_Abort, and MPICH's
    launcher, killed, used to leave its topology file (/tmp/hydra_hwloc_xmlfile_*, written for
    the ranks' MPI_Init) each time. The job's own ranks now remove it once every rank has passed
    MPI_Init. The job runs in a PID and mount namespace of its own with a private /tmp, so that
    the launchers of the tests running meanwhile are neither seen nor counted."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private /tmp and PID namespace")
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                           + os.environ.get("PATH", ""))  # fmt: skip
    assert mpiexec is not None
    code = (
        "import jax.numpy as jnp, spmd\n"
        "comm = spmd.init()\n"
        "if comm.rank == 1:\n    raise RuntimeError('rank 1 fails')\n"
        "spmd.allreduce(jnp.ones(2))\n"
    )
    job = f"{shlex.quote(mpiexec)} -n 2 {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    # The environment and spmd itself stay visible where they live under /tmp (a clone and its
    # virtual environment there): bound back into the private /tmp from a view of the real one.
    import spmd

    shown = sorted({p for p in (os.path.realpath(sys.prefix),
                                os.path.dirname(os.path.dirname(os.path.realpath(spmd.__file__))))
                    if p.startswith("/tmp/")})  # fmt: skip
    keep = tempfile.mkdtemp(dir="/var/tmp") if shown else ""
    steps = [f"mount --bind /tmp {keep}"] if shown else []
    steps.append("mount -t tmpfs -o mode=1777 spmd-test /tmp")
    for p in shown:
        q = shlex.quote(p)
        steps.append(f"mkdir -p {q} && mount --bind {shlex.quote(keep + p[4:])} {q}")
    shell = " && ".join(steps) + f" && {job}; echo rc=$?; ls -a /tmp"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_", "PMI"))}
    try:
        out = subprocess.run(["unshare", "-m", "-p", "-f", "--mount-proc", "sh", "-c", shell],
                             capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    finally:
        if keep:
            os.rmdir(keep)
    assert "RuntimeError: rank 1 fails" in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    rc = next(line for line in lines if line.startswith("rc="))
    assert rc != "rc=0", out.stdout
    ours = {p.split("/")[2] for p in shown}  # the directories made to bind them into
    left = [n for n in lines[lines.index(rc) + 1 :] if n not in (".", "..", *ours)]
    assert left == [], out.stdout
