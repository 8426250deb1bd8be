"""Ranks that cannot agree, under the real launcher: a collective one rank has given up on
completes on no rank (the late rank's call fails too, naming the first failure)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
