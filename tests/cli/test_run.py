"""spmd-run under the real mpiexec: output, exit codes, failing and hanging ranks, pinning."""

import ast
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from spmd.launch import wrap_command

from .. import _leftovers as leftovers

SPMD_RUN = [sys.executable, "-m", "spmd.cli.run"]


def spmd_run(*args, timeout=120, env=None):
    start = time.monotonic()
    out = subprocess.run([*SPMD_RUN, *args], capture_output=True, text=True, timeout=timeout,
                         env=None if env is None else {**os.environ, **env})  # fmt: skip
    return out, time.monotonic() - start


def test_four_ranks_print_rank_and_size():
    out, _ = spmd_run(
        "-n", "4", sys.executable, "-c", "import spmd; c = spmd.init(); print(c.rank, c.size)"
    )
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["0 4", "1 4", "2 4", "3 4"]


@pytest.mark.parametrize("uses_mpi", [True, False])
def test_failing_rank_stops_the_job_and_is_named(tmp_path, uses_mpi):
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, time
        if {uses_mpi}:
            import spmd
            comm = spmd.init()
            rank = comm.rank
        else:
            rank = int(os.environ["PMI_RANK"])
        if rank == 1:
            raise ValueError("rank one cannot go on")
        if {uses_mpi}:
            comm.barrier()   # would wait forever for rank 1
        time.sleep(60)
    """)
    )
    out, elapsed = spmd_run("-n", "3", sys.executable, str(script))
    assert out.returncode == 1
    assert elapsed < 30, f"the job took {elapsed:.1f} s to stop"  # not the 60 s of a hang
    assert "[rank 1] ValueError: rank one cannot go on" in out.stderr
    assert f'[rank 1]   File "{script}", line 10, in <module>' in out.stderr
    assert "spmd-run: rank 1 failed: ValueError: rank one cannot go on" in out.stderr
    assert "_rank.py" not in out.stderr  # the wrapper's frames are not the user's problem


def test_a_peer_failing_within_the_grace_period_prints_its_traceback_too(tmp_path):
    """A failing rank used to call MPI_Abort at once, killing its peers within milliseconds: a
    peer failing on its own a moment later never printed its traceback, and --grace was not
    honoured. Under spmd-run the failing rank only exits; the others get --grace seconds."""
    script = tmp_path / "both.py"
    script.write_text(
        "import time\nimport spmd\ncomm = spmd.init()\n"
        "if comm.rank == 1:\n    raise ValueError('rank 1 first')\n"
        "time.sleep(0.5)\nraise KeyError('rank 0 a moment later')\n"
    )
    out, took = spmd_run("-n", "2", "--grace", "5", sys.executable, str(script))
    assert out.returncode == 1, out.stderr
    assert "[rank 1] ValueError: rank 1 first" in out.stderr, out.stderr
    assert "[rank 0] KeyError: 'rank 0 a moment later'" in out.stderr, out.stderr
    assert "spmd-run: rank 0 failed: KeyError" in out.stderr
    assert took < 15, f"the job took {took:.1f} s"


def test_exit_code_of_a_failing_program_is_returned():
    out, _ = spmd_run("-n", "2", "sh", "-c", 'if [ "$PMI_RANK" = 1 ]; then exit 3; fi')
    assert out.returncode == 3
    assert "spmd-run: rank 1 failed: exit 3" in out.stderr


def test_a_program_that_is_not_python_code_can_start_mpi(tmp_path):
    """A console script or a shell wrapper (spmd-bench, say) reaches the launcher's PMI
    connection: the wrapper passes its descriptor on."""
    program = tmp_path / "mpi_hello.py"
    program.write_text(  # one write per line: the ranks' output is not buffered
        "import os\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
        "os.write(1, f'{c.Get_rank()} {c.Get_size()}\\n'.encode())\n"
    )
    out, _ = spmd_run("-n", "2", "sh", "-c", f'exec "{sys.executable}" "{program}"')
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["0 2", "1 2"]


def test_sys_exit_nonzero_is_a_failure():
    out, _ = spmd_run(
        "-n",
        "2",
        sys.executable,
        "-c",
        "import os, sys; sys.exit(4 if os.environ['PMI_RANK'] == '0' else 0)",
    )
    assert out.returncode == 4
    assert "spmd-run: rank 0 failed: exit 4" in out.stderr


def test_timeout_names_the_ranks_that_did_not_finish():
    out, elapsed = spmd_run(
        "-n",
        "2",
        "--timeout",
        "3",
        sys.executable,
        "-c",
        "import os, time; time.sleep(0 if os.environ['PMI_RANK'] == '0' else 60)",
    )
    assert out.returncode == 124
    assert "spmd-run: timed out after 3 s; ranks that had not finished: [1]" in out.stderr
    assert elapsed < 30


def test_script_arguments_module_mode_and_simulated_nodes(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        "import sys, spmd\nc = spmd.init()\n"
        "print(c.rank, c.local_rank, c.local_size, sys.argv[1:])\n"
    )
    out, _ = spmd_run("-n", "4", "--nodes", "2", sys.executable, "-u", str(script), "a", "-b")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        "0 0 2 ['a', '-b']",
        "1 1 2 ['a', '-b']",
        "2 0 2 ['a', '-b']",
        "3 1 2 ['a', '-b']",
    ]
    out, _ = spmd_run("-n", "2", sys.executable, "-m", "json.tool", "--help")
    assert out.returncode == 0 and out.stdout.count("usage:") == 2


def test_a_rank_killed_by_a_signal_exits_as_a_shell_would():
    out, _ = spmd_run("-n", "2", "sh", "-c", 'if [ "$PMI_RANK" = 1 ]; then kill -9 $$; fi')
    assert out.returncode == 137, out.stderr
    assert "spmd-run: rank 1 failed: killed by SIGKILL" in out.stderr


# MPICH's shared memory and the launcher's topology files.
_MPICH = sorted(
    {"/dev/shm/mpich_shm_*"}
    | {os.path.join(d, "hydra_hwloc_xmlfile_*") for d in (tempfile.gettempdir(), "/tmp")}
)


def _mpich_files() -> set[str]:
    return leftovers.files(_MPICH)


def _left_behind(before: set[str]) -> set[str]:
    """MPICH's files that appeared since ``before`` and stay, unused, now that the job ended."""
    return leftovers.new_files(_MPICH, before)


_FAULTS = {
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "SIGSEGV": "def crash():\n        ctypes.string_at(0)\n    crash()",
    "raise": "raise ValueError('rank 1 gives up')",
}


@pytest.mark.parametrize("fault", list(_FAULTS))
def test_a_python_rank_that_dies_is_named_fast_and_leaves_nothing(tmp_path, fault):
    """A Python rank killed by a signal could not report anything: spmd-run said only "the
    launcher exited with code 9; ranks without a clean end: [0, 1]", a segfault printed no
    Python stack, and MPICH's shared memory and topology files stayed behind."""
    script = tmp_path / "fault.py"
    script.write_text(
        "import ctypes, os, signal, time\nimport spmd\n"
        "comm = spmd.init()\nspmd.barrier()\n"
        f"if comm.rank == 1:\n    {_FAULTS[fault]}\n"
        "time.sleep(60)\n"
    )
    before = _mpich_files()
    out, took = spmd_run("-n", "2", sys.executable, str(script))
    if fault == "raise":
        assert out.returncode == 1, out.stderr
        assert "spmd-run: rank 1 failed: ValueError: rank 1 gives up" in out.stderr
    else:
        sig = getattr(signal, fault)
        assert out.returncode == 128 + sig, out.stderr
        assert f"spmd-run: rank 1 failed: killed by {fault}" in out.stderr, out.stderr
        assert f"[rank 1] killed by {fault}" in out.stderr
    if fault == "SIGSEGV":  # faulthandler's stack, prefixed like a traceback
        assert "[rank 1] Fatal Python error: Segmentation fault" in out.stderr, out.stderr
        assert 'fault.py", line 7 in crash' in out.stderr, out.stderr
    assert took < 15, f"the job took {took:.1f} s"
    assert _left_behind(before) == set(), "MPICH's files were left behind"


def test_the_job_exits_with_the_code_of_the_rank_killed_not_of_its_waiting_peer(tmp_path):
    """Rank 0, waiting in a collective, fails at once naming rank 1, which a SIGKILL ended: the
    job's code is rank 1's 137, not rank 0's 1."""
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal\nimport jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        "if comm.rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "spmd.allreduce(jnp.ones(3))\n"
    )
    out, took = spmd_run("-n", "2", sys.executable, str(script))
    assert out.returncode == 137, out.stderr
    assert "spmd-run: rank 1 failed: killed by SIGKILL" in out.stderr
    assert "rank 0: allreduce: rank 1 has ended" in out.stderr
    assert took < 15, f"the job took {took:.1f} s"


def test_a_group_segment_whose_creator_was_killed_is_removed(tmp_path):
    """spmd's creator of a group's shared memory unlinks it once every rank mapped it; killed in
    that window (a peer's MPI_Abort right after spmd.init), it left 16 MiB in /dev/shm. The
    window is reproduced here: each rank makes an unmapped segment named as spmd names them, then
    rank 1 is killed and the launcher ends rank 0."""
    script = tmp_path / "window.py"
    script.write_text(
        "import os, signal, time\nimport spmd\n"
        "comm = spmd.init()\n"
        "with open(f'/dev/shm/spmd-{os.getpid()}-window', 'wb') as f:\n"
        "    f.write(bytes(4096))\n"
        "spmd.barrier()\n"
        "if comm.rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    before = set(glob.glob("/dev/shm/spmd-*"))
    out, took = spmd_run("-n", "2", sys.executable, str(script))
    assert out.returncode == 137, out.stderr
    assert took < 15, f"the job took {took:.1f} s"
    assert leftovers.new_files(["/dev/shm/spmd-*"], before) == set(), (
        "a group segment was left behind"
    )


def test_a_rank_that_ends_right_after_dispatching_its_last_steps_waits_for_them(tmp_path):
    """jit runs asynchronously: a rank whose script ends right after its last step (the usual
    `if rank == 0: print(...)`) still had collectives in flight, and marking it as leaving at
    exit failed its peers' last steps. Exit now waits for what the process dispatched first."""
    script = tmp_path / "async.py"
    script.write_text(
        "import jax, jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nstep = jax.jit(lambda x: spmd.allreduce(x) / comm.size + 1)\n"
        "x = jnp.zeros(1000)\n"
        "for _ in range(200):\n    x = step(x)\n"
        "if comm.rank == 0:\n    print('done', float(x[0]))\n"
    )
    out, _ = spmd_run("-n", "2", sys.executable, str(script))
    assert out.returncode == 0, out.stderr
    assert "done 200.0" in out.stdout, out.stdout


def _placement(transport):
    """spmd-run arguments and environment: both ranks on one node over shared memory or MPI,
    or each rank on a simulated node of its own (MPI, the peer watch between them)."""
    if transport == "nodes":
        return ["--nodes", "2"], {}
    return [], {"SPMD_TRANSPORT": transport}


@pytest.mark.parametrize("transport", ["shm", "mpi", "nodes"])
@pytest.mark.parametrize("leave", ["sys.exit(0)", "os._exit(0)"])
def test_a_rank_that_leaves_early_is_named_at_once_not_after_the_timeout(
    tmp_path, leave, transport
):
    """A rank that makes one collective fewer and exits cleanly left its peers waiting for
    SPMD_TIMEOUT (300 s). sys.exit runs Python's exit handlers, which mark the rank as leaving
    in shared memory; os._exit runs none, and the waiting peer sees its process gone. The MPI
    transport's waits ask the group's shared-memory segment too, and between nodes the peer
    watch. A rank gone with os._exit between nodes makes MPICH end the job first: spmd-run
    names it from its supervisor."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import os, sys\nimport jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        f"if comm.rank == 1:\n    {leave}\n"
        "spmd.allreduce(jnp.ones(3))\n"
    )
    args, env = _placement(transport)
    out, took = spmd_run(*args, "-n", "2", sys.executable, str(script),
                         env={**env, "SPMD_TIMEOUT": "60"})  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert took < 15, f"the job took {took:.1f} s"
    if transport == "nodes" and leave.startswith("os"):
        assert (
            "spmd-run: rank 1 exited with code 0 before its Python program ended (os._exit, or "
            "an exit from C code); ranks [0] had not finished"
            in out.stderr
            or "rank 0: allreduce: rank 1 (node simulated-node-1) has ended" in out.stderr
        ), out.stderr
        return
    gone = "is exiting" if leave.startswith("sys") else "has ended (its process"
    rank1 = "rank 1 (node simulated-node-1)" if transport == "nodes" else "rank 1"
    assert f"spmd-run: rank 0 failed: SpmdError: rank 0: allreduce: {rank1} {gone}" in out.stderr
    where = (
        "while this rank waited for it in collective #2 of the group [0, 1]"
        if transport == "shm"
        else "while this rank waited for it in allreduce(op=sum) of float32[3] over MPI "
        "(collective #2 of the group [0, 1])"
    )
    assert where in out.stderr, out.stderr


@pytest.mark.parametrize("transport", ["shm", "mpi", "nodes"])
def test_a_sigstopped_peer_is_reported_as_stopped_and_the_job_ends_at_the_timeout(
    tmp_path, transport
):
    """A SIGSTOPped rank is alive but cannot run, nor print its stack: the stall report says it
    is stopped, and the waiting rank's timeout ends the job, stopped rank included. Over MPI the
    waiting rank reads how far each peer got from the group's shared-memory segment; between
    nodes the peer watch finds it silent."""
    script = tmp_path / "stop.py"
    script.write_text(
        "import os, signal\nimport jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        "if comm.rank == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "spmd.allreduce(jnp.ones(3))\n"
    )
    before = _mpich_files()
    args, env = _placement(transport)
    env = {**env, "SPMD_STALL_WARN": "1", "SPMD_TIMEOUT": "4"}
    out, took = spmd_run(*args, "-n", "2", sys.executable, str(script), env=env)
    assert out.returncode == 1, out.stderr
    if transport == "nodes":
        silent = (
            "rank 1 (node simulated-node-1), which does not answer the peer watch (its process "
            "may be stopped, or its node unreachable)."
        )
        assert f"(collective #2 of the group [0, 1]) for {silent}" in out.stderr, out.stderr
        assert (
            "timed out after 4 s in allreduce(op=sum) of float32[3] over MPI (collective #2 of "
            f"the group [0, 1]) waiting for {silent}" in out.stderr
        ), out.stderr
        assert took < 15, f"the job took {took:.1f} s"
        assert _left_behind(before) == set(), "MPICH's files were left behind"
        return
    started = "on the group" if transport == "shm" else "over MPI on the group"
    assert f"for rank 1, which has started 1 collectives {started}" in out.stderr, out.stderr
    assert "is stopped (SIGSTOP, Ctrl-Z or a debugger)" in out.stderr, out.stderr
    assert "Its Python stack follows" not in out.stderr
    timed_out = (
        "timed out after 4 s waiting for ranks [1]"
        if transport == "shm"
        else "timed out after 4 s in allreduce(op=sum) of float32[3] over MPI (collective #2 of "
        "the group [0, 1]) waiting for rank 1, which has started 1 collectives"
    )
    assert timed_out in out.stderr, out.stderr
    assert took < 15, f"the job took {took:.1f} s"
    assert _left_behind(before) == set(), "MPICH's files were left behind"


@pytest.mark.parametrize("transport", ["shm", "mpi", "nodes"])
def test_a_stalled_peer_is_reported_with_its_python_stack(tmp_path, transport):
    """A peer that is alive but does not arrive: after SPMD_STALL_WARN seconds the waiting rank
    says where it waits, for whom, how far that rank got, and has it print its Python stack."""
    script = tmp_path / "stall.py"
    script.write_text(
        "import time\nimport jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        "def busy_elsewhere():\n    time.sleep(3)\n"
        "if comm.rank == 1:\n    busy_elsewhere()\n"
        "print(comm.rank, float(spmd.allreduce(jnp.ones(3))[0]))\n"
    )
    args, env = _placement(transport)
    out, _ = spmd_run(*args, "-n", "2", sys.executable, str(script),
                      env={**env, "SPMD_STALL_WARN": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split("\n")[:2]) == ["0 2.0", "1 2.0"], out.stdout
    rank1 = "rank 1 (node simulated-node-1)" if transport == "nodes" else "rank 1"
    report = (
        "[rank 0] spmd: stalled: this rank has waited 1 s in allreduce(op=sum) of float32[3] "
        "(collective #2 of the group [0, 1]) for rank 1, which has started 1 collectives on the "
        "group: it has not reached this collective."
        if transport == "shm"
        else "[rank 0] spmd: stalled: this rank has waited 1 s in allreduce(op=sum) of "
        f"float32[3] over MPI (collective #2 of the group [0, 1]) for {rank1}, which has "
        "started 1 collectives over MPI on the group: it has not reached this collective. Its "
        "Python stack follows in its output."
    )
    assert report in out.stderr, out.stderr
    assert 'stall.py", line 7 in busy_elsewhere' in out.stderr, out.stderr
    assert out.stderr.count("spmd: stalled") == 1, out.stderr


def _sleeping_job(tmp_path, preamble=""):
    """A 2-rank job of sleepers (after ``preamble``); returns spmd-run's process and the ranks'
    pids once both ranks are running."""
    script = tmp_path / "sleeper.py"
    # Written under another name and renamed, so that a pid file is never seen empty.
    script.write_text(
        f"import os, signal, time\n{preamble}"
        f"path = os.path.join({str(tmp_path)!r}, 'pid.' + os.environ['PMI_RANK'])\n"
        "open(path + '.part', 'w').write(str(os.getpid()))\n"
        "os.replace(path + '.part', path)\n"
        "time.sleep(120)\n"
    )
    # spmd-run's status directory goes under tmp_path: a spmd-run killed by SIGKILL cannot
    # remove it.
    proc = subprocess.Popen([*SPMD_RUN, "-n", "2", sys.executable, str(script)],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid.?"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid.?")]
        assert len(pids) == 2
    except BaseException:
        proc.kill()  # no job left running into the next tests
        proc.communicate(timeout=30)
        raise
    return proc, pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_stops_the_whole_job(tmp_path, sig):
    """spmd-run runs the job in a session of its own: killed without stopping it, it left
    mpiexec and every rank running."""
    proc, pids = _sleeping_job(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert f"spmd-run: stopped the job on {sig.name}" in err
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_second_interrupt_does_not_cut_the_stop_short(tmp_path):
    """Ranks that ignore SIGTERM are stopped by SIGKILL 3 s later; an interrupt in between used
    to escape from the stop and leave them running."""
    proc, pids = _sleeping_job(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n")
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # spmd-run is now waiting for the ranks to go
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    # MPICH starts each rank in a session of its own: the launcher's proxy kills them once
    # the launcher is gone (SIGKILLed), which takes a moment.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_job_ends_when_spmd_run_is_killed(tmp_path):
    """SIGKILL gives spmd-run no chance to stop the job (a notebook kernel killed mid-cell, the
    out-of-memory killer): the launcher used to run on, and its ranks with it. Nor can it
    remove its status directory and what the job left: the next spmd-run does."""
    before = _mpich_files()
    proc, pids = _sleeping_job(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
    assert len(list(tmp_path.glob("spmd-run-*"))) == 1  # the killed spmd-run's
    out, _ = spmd_run("-n", "1", "true", env={"TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.glob("spmd-run-*")) == []
    assert _left_behind(before) == set(), "the killed job's MPICH files were left behind"


def test_a_killed_launcher_is_named_and_takes_its_ranks_with_it(tmp_path):
    """mpiexec killed under spmd-run: its ranks end with it, spmd-run names the signal (it said
    "exited with code -9") and exits as a shell would, and nothing is left behind."""
    before = _mpich_files()
    proc, pids = _sleeping_job(tmp_path)
    launcher = next(
        int(p) for p in os.listdir("/proc") if p.isdigit() and _is_launcher_of(int(p), proc.pid)
    )
    os.kill(launcher, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "spmd-run: the launcher (mpiexec) was killed by SIGKILL" in err, err
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
    assert _left_behind(before) == set(), "the job's MPICH files were left behind"


def _is_launcher_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0")[0]
    except OSError:
        return False
    return int(fields[1]) == parent and argv0.endswith(b"mpiexec")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_python_c_code_runs_as_main_and_exits_normally(tmp_path):
    code = (
        "import atexit, pickle, sys, __main__\n"
        "class Point: pass\n"
        "pickle.dumps(Point())\n"
        "assert __main__.Point is Point\n"
        f"atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').write('ran'))\n"
        f"log = open({str(tmp_path / 'log')!r}, 'w'); log.write('buffered')\n"
        "sys.exit(3)\n"
    )
    out, _ = spmd_run("-n", "1", sys.executable, "-c", code)
    assert out.returncode == 3, out.stderr
    # no MPI and no spmd runtime running: the rank exits as Python would, nothing is lost
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "log").read_text() == "buffered"


def test_usage_errors():
    out, _ = spmd_run("-n", "0", "true")
    assert out.returncode == 2 and "spmd-run: -n 0: need at least one rank" in out.stderr
    assert "spmd-run: spmd-run" not in out.stderr
    out, _ = spmd_run("-n", "2")
    assert out.returncode == 2 and "no command given" in out.stderr


def test_wrap_command(tmp_path):
    exec_ = [sys.executable, "-m", "spmd.launch._rank"]
    py = sys.executable
    # -S hides site-packages, where spmd is: the program runs under the wrapper instead of
    # inside it (it failed with "No module named 'spmd'")
    assert wrap_command([py, "-S", "t.py"]) == [*exec_, "--exec", py, "-S", "t.py"]
    code = "import sys; sys.stdout.write(f'no_site={sys.flags.no_site}\\n')"  # one write
    out, _ = spmd_run("-n", "2", py, "-S", "-c", code)
    assert out.returncode == 0 and out.stdout.count("no_site=1\n") == 2, (out.stdout, out.stderr)
    assert wrap_command([py, "-u", "-W", "error", "t.py", "x"]) == [
        py,
        "-u",
        "-W",
        "error",
        "-m",
        "spmd.launch._rank",
        "--python",
        "t.py",
        "x",
    ]
    assert wrap_command([py, "-c", "pass"]) == [
        py,
        "-m",
        "spmd.launch._rank",
        "--python",
        "-c",
        "pass",
    ]
    assert wrap_command(["hostname"]) == [*exec_, "--exec", "hostname"]
    assert wrap_command([py]) == [*exec_, "--exec", py]  # interactive: as is
    # An interpreter that cannot import spmd runs the command as a plain program.
    other = tmp_path / "python3"
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    assert wrap_command([str(other), "t.py"]) == [*exec_, "--exec", str(other), "t.py"]


# -- pinning ranks to cores ------------------------------------------------------------------------

AFFINITY = "import os; print(os.environ['PMI_RANK'], sorted(os.sched_getaffinity(0)))"


def _masks(out):
    assert out.returncode == 0, out.stderr
    masks = {}
    for line in out.stdout.splitlines():
        rank, cpus = line.split(" ", 1)
        masks[int(rank)] = ast.literal_eval(cpus)  # a printed list of ints
    return masks


def test_share_of_the_cores():
    from spmd.runtime._affinity import share

    assert share([0, 1], 0, 2) == {0}
    assert share([0, 1], 1, 2) == {1}
    assert share([4, 5, 6, 7, 8], 1, 2) == {6, 7}  # k = 5 // 2; the odd core stays free
    assert share([0, 1, 2, 3], 3, 4) == {3}
    assert share([0, 1], 0, 3) is None  # oversubscribed: no pinning
    assert share([0, 1], 0, 1) is None  # alone on the node: the whole machine


def test_local_rank_from_each_launcher():
    from spmd.runtime._affinity import local_rank_size

    assert local_rank_size({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}) == (1, 2)
    assert local_rank_size(
        {"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    ) == (3, 4)
    assert local_rank_size({"PMI_RANK": "0"}) is None


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_ranks_are_pinned_to_disjoint_cores():
    import os

    cpus = sorted(os.sched_getaffinity(0))
    masks = _masks(spmd_run("-n", "2", sys.executable, "-c", AFFINITY)[0])
    k = len(cpus) // 2
    assert masks == {0: cpus[:k], 1: cpus[k : 2 * k]}
    # Threads started later (XLA's pool) inherit the mask.
    code = (
        "import os, threading, jax; jax.numpy.ones(2).block_until_ready(); "
        "print(os.environ['PMI_RANK'], sorted(set().union(*(os.sched_getaffinity(int(t)) "
        "for t in os.listdir('/proc/self/task')))))"
    )
    assert _masks(spmd_run("-n", "2", sys.executable, "-c", code)[0]) == masks


def test_pinning_off_oversubscribed_or_chosen_by_the_launcher(monkeypatch):
    import os

    cpus = sorted(os.sched_getaffinity(0))
    over = len(cpus) + 1
    masks = _masks(spmd_run("-n", str(over), sys.executable, "-c", AFFINITY)[0])
    assert masks == dict.fromkeys(range(over), cpus)
    monkeypatch.setenv("SPMD_BIND", "none")
    masks = _masks(spmd_run("-n", "2", sys.executable, "-c", AFFINITY)[0])
    assert masks == {0: cpus, 1: cpus}
    monkeypatch.setenv("SPMD_BIND", "auto")
    # The launcher's own binding stands: every rank on the first core.
    masks = _masks(
        spmd_run("-n", "2", "--mpi-arg=-bind-to", f"--mpi-arg=user:{cpus[0]},{cpus[0]}",
                 sys.executable, "-c", AFFINITY)[0]
    )  # fmt: skip
    assert masks == {0: [cpus[0]], 1: [cpus[0]]}
    # ... also when it says not to bind (spmd-run pinned the ranks regardless)
    masks = _masks(
        spmd_run("-n", "2", "--mpi-arg=-bind-to", "--mpi-arg=none", sys.executable, "-c",
                 AFFINITY)[0]
    )  # fmt: skip
    assert masks == {0: cpus, 1: cpus}


def test_bad_bind_setting(monkeypatch):
    monkeypatch.setenv("SPMD_BIND", "cores")
    out, _ = spmd_run("-n", "2", "true")
    assert out.returncode == 2
    assert "SPMD_BIND='cores'; expected one of auto, none" in out.stderr


def test_output_dir_keeps_each_ranks_output_apart(tmp_path):
    code = (
        "import os, subprocess, sys\n"
        "import spmd\n"
        "comm = spmd.init()\n"
        "print('out of', comm.rank)\n"
        "print('err of', comm.rank, file=sys.stderr)\n"
        "subprocess.run(['echo', 'child of', str(comm.rank)])\n"  # children write there too
        "assert 'SPMD_RUN_OUTPUT_DIR' not in os.environ\n"  # a nested job would not overwrite
        "if comm.rank == 1:\n"
        "    raise ValueError('rank one fails')\n"
    )
    out, _ = spmd_run("--output", str(tmp_path / "logs"), "-n", "2", sys.executable, "-c", code)
    assert out.returncode == 1
    assert out.stdout == ""  # nothing reached the terminal but spmd-run's own summary
    assert out.stderr.strip() == "spmd-run: rank 1 failed: ValueError: rank one fails"
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [
        "launcher.stderr", "launcher.stdout",
        "rank0.stderr", "rank0.stdout", "rank1.stderr", "rank1.stdout",
    ]  # fmt: skip
    for r in (0, 1):
        assert (logs / f"rank{r}.stdout").read_text() == f"out of {r}\nchild of {r}\n"
    assert (logs / "rank0.stderr").read_text() == "err of 0\n"
    err1 = (logs / "rank1.stderr").read_text()
    assert err1.startswith("err of 1\n[rank 1] Traceback")
    assert "[rank 1] ValueError: rank one fails" in err1
    # spmd-run stopped the job, not MPI_Abort: MPICH prints no abort line of its own.
    assert "MPI_Abort" not in (logs / "launcher.stderr").read_text() + err1
    mine = ["launcher.py", "rank_notes.stdout", "rank1.stdout.txt"]  # the user's, kept
    for name in mine:
        (logs / name).write_text("keep")
    out, _ = spmd_run("--output", str(logs), "-n", "1", sys.executable, "-c", "print('again')")
    assert out.returncode == 0, out.stderr
    names = sorted(p.name for p in logs.iterdir())  # rank 1's files of the first job are gone
    assert names == sorted(
        ["launcher.stderr", "launcher.stdout", "rank0.stderr", "rank0.stdout", *mine]
    )
    assert all((logs / name).read_text() == "keep" for name in mine)
    assert (logs / "rank0.stdout").read_text() == "again\n"
    out, _ = spmd_run("--output", "", "-n", "1", "true")
    assert out.returncode == 2 and "spmd-run: --output needs a directory" in out.stderr
    bad = tmp_path / "file"
    bad.write_text("")
    out, _ = spmd_run("--output", str(bad / "sub"), "-n", "1", "true")
    assert out.returncode == 2 and "spmd-run: --output" in out.stderr
    assert "cannot create the directory" in out.stderr


_FLIGHT = (
    "import os, time\nimport jax.numpy as jnp\nimport spmd\n"
    "comm = spmd.init()\n"
    "for _ in range(3):\n    spmd.allreduce(jnp.ones(3))\n"
    "spmd.allgather(jnp.ones(4))\n"
    "if comm.rank == 1:\n    {rank1}\n"
    "spmd.allreduce(jnp.ones(5), op='sum' if comm.rank == 0 else 'max')\n"
)


@pytest.mark.parametrize("rank1", ["time.sleep(30)", "pass"], ids=["stall", "mismatch"])
def test_the_flight_recorder_says_where_each_rank_stood(tmp_path, rank1):
    """When a job fails, spmd-run reads each rank's ring of recent collectives (a file in its
    status directory, so a killed rank's too) and prints, for each group whose ranks did not
    end alike, each rank's last collective and the first one whose signature differs."""
    script = tmp_path / "flight.py"
    script.write_text(_FLIGHT.format(rank1=rank1))
    out, took = spmd_run("-n", "2", sys.executable, str(script), env={"SPMD_TIMEOUT": "3"})
    assert out.returncode == 1, out.stderr
    assert "spmd-run: flight recorder: the group [0, 1] when the job ended:" in out.stderr
    if rank1 == "pass":
        assert "spmd-run:   rank 0: collective #5 allreduce of 20 bytes, failed" in out.stderr
        assert "spmd-run:   rank 1: collective #5 allreduce of 20 bytes, failed" in out.stderr
        assert "first collective whose signature differs: #5" in out.stderr, out.stderr
    else:
        assert "spmd-run:   rank 0: collective #5 allreduce of 20 bytes, failed" in out.stderr
        assert "spmd-run:   rank 1: collective #4 allgather of 16 bytes, done" in out.stderr
    assert took < 15, f"the job took {took:.1f} s"


def test_the_timeline_has_a_track_per_rank_with_every_collective(tmp_path):
    """SPMD_TIMELINE=dir: each rank writes its collectives as Chrome trace events at exit, and
    spmd-run merges them into dir/timeline.json."""
    import json

    timeline = tmp_path / "timeline"
    code = (
        "import jax.numpy as jnp, spmd\nc = spmd.init()\n"
        "for i in range(4):\n    spmd.allreduce(jnp.ones(1000 * (i + 1)))\n"
        "spmd.allgather(jnp.ones(8))\n"
    )
    out, _ = spmd_run("-n", "2", sys.executable, "-c", code, env={"SPMD_TIMELINE": str(timeline)})
    assert out.returncode == 0, out.stderr
    merged = timeline / "timeline.json"
    assert f"spmd-run: timeline of the job's collectives: {merged}" in out.stderr
    events = json.loads((timeline / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        calls = sorted((e for e in events if e["ph"] == "X" and e["pid"] == rank),
                       key=lambda e: e["args"]["call"])  # fmt: skip
        assert [e["name"] for e in calls] == ["allreduce"] * 4 + ["allgather"]
        assert [e["args"]["bytes"] for e in calls] == [4000, 8000, 12000, 16000, 32]
        assert [e["args"]["call"] for e in calls] == [1, 2, 3, 4, 5]
        assert all(e["tid"] == "group [0, 1]" and e["args"]["state"] == "done" for e in calls)
        assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in calls)
        starts = [e["ts"] for e in calls]
        assert starts == sorted(starts)


@pytest.mark.parametrize("kind", ["missing", "syntax"])
def test_an_error_every_rank_meets_is_printed_once(tmp_path, kind):
    """A missing script or a syntax error: one traceback, one line for each other rank naming
    the rank that printed it, one summary line listing the ranks (not three copies of each)."""
    script = tmp_path / "train.py"
    if kind == "syntax":
        script.write_text("x = (\n")
    out, _ = spmd_run("-n", "3", sys.executable, str(script))
    assert out.returncode == 1
    err = out.stderr.splitlines()
    what = "No such file or directory" if kind == "missing" else "SyntaxError: '(' was never closed"
    mentions = [line for line in err if what in line and line.startswith("[rank")]
    assert len(mentions) == 3, out.stderr  # each rank says it failed, once
    short = [line for line in mentions if "(the traceback rank" in line]
    assert len(short) == 2, out.stderr  # two of them point at the one that printed it
    summary = [line for line in err if line.startswith("spmd-run:")]
    assert len(summary) == 1 and summary[0].startswith("spmd-run: ranks [0, 1, 2] failed: ")
    if kind == "syntax":
        assert sum("x = (" in line for line in err) == 1  # the source line, once
