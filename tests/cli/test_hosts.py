"""spmd-run --hosts: test hosts made of network namespaces, MPI over TCP between them, under the
real launcher. Skipped, with the reason, where they cannot be made (not root, no iproute2)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd.testing import run
from spmd.testing.hosts import TestHosts, unavailable

from .. import _leftovers as leftovers
from .test_run import SPMD_RUN, spmd_run

REASON = unavailable()
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "test hosts available")


_test_namespaces = leftovers.namespaces
_SHM = ["/dev/shm/*"]
_HYDRA = ["/tmp/hydra_hwloc_xmlfile_*"]  # the launcher's topology files (its proxies' too)


def _shm():
    return leftovers.files(_SHM)


def _hydra_files():
    return leftovers.files(_HYDRA)


def test_ranks_on_two_hosts_have_their_own_hostname_address_and_shared_memory(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(
        "import json, os, socket\nimport jax.numpy as jnp\nimport spmd\n"
        "from spmd.runtime._watch import _interface_addresses\n"
        "comm = spmd.init()\n"
        "def rx():\n    return int(open('/sys/class/net/eth0/statistics/rx_bytes').read())\n"
        "before = rx()\n"
        "total = float(spmd.allreduce(jnp.full(4 << 20, comm.rank + 1.0))[0])\n"
        "received = rx() - before\n"
        "gathered = spmd.allgather(jnp.array([comm.rank * 10])).tolist()\n"
        "print(json.dumps({'rank': comm.rank, 'host': socket.gethostname(), 'nodes': "
        "list(comm.node_ids), 'addresses': _interface_addresses(), 'total': total, "
        "'gathered': gathered, 'transport': spmd.ops.get_transport(), "
        "'shm': os.stat('/dev/shm').st_dev, 'received': received}), flush=True)\n"
    )
    before, shm_before = _test_namespaces(), _shm()
    out, _ = spmd_run("--hosts", "2", "-n", "4", sys.executable, str(script))
    assert out.returncode == 0, out.stderr
    ranks = sorted((json.loads(line) for line in out.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["host"] for r in ranks] == ["h0", "h0", "h1", "h1"]
    assert all(r["nodes"] == ["h0", "h0", "h1", "h1"] for r in ranks)
    for r in ranks:  # each host's own address on the bridge, and nothing of the machine's
        host = int(r["host"][1])
        assert sorted(r["addresses"]) == sorted(["127.0.0.1", f"10.77.0.{host + 1}"]), r
        assert r["total"] == 10.0 and r["gathered"] == [0, 10, 20, 30], r
        assert r["transport"] == "hier", r  # shared memory within a host, MPI across
    # The 16 MiB allreduce crossed the link: each host's end received at least half of it
    # (the rails' MPI allreduce over TCP, not a shared-memory shortcut between hosts).
    assert ranks[0]["received"] >= 8 << 20 and ranks[2]["received"] >= 8 << 20, ranks
    # The ranks of a host share a /dev/shm of their own; the hosts do not share one.
    assert ranks[0]["shm"] == ranks[1]["shm"] != ranks[2]["shm"] == ranks[3]["shm"]
    assert leftovers.new_namespaces(before) == set(), "test hosts were left behind"
    assert leftovers.new_files(_SHM, shm_before) == set(), "shared memory was left behind"


LINK_BYTES = """
import json, sys
import jax, jax.numpy as jnp
import spmd
comm = spmd.init()
MiB = 1 << 20
calls = {
    "allreduce": (lambda x: spmd.allreduce(x), 4 * MiB),
    "allgather": (lambda x: spmd.allgather(x), 4 * MiB // comm.size),
    "reduce_scatter": (lambda x: spmd.reduce_scatter(x), 4 * MiB),
    "broadcast": (lambda x: spmd.broadcast(x, root=0), 4 * MiB),
    "all_to_all": (lambda x: spmd.all_to_all(x), MiB // 8),
}
def sent():
    return int(open("/sys/class/net/eth0/statistics/tx_bytes").read())
out = {}
for transport in ("hier", "mpi"):
    spmd.ops.set_transport(transport)
    for op, (fn, nbytes) in calls.items():
        f = jax.jit(fn)
        x = jnp.ones(nbytes // 4, jnp.float32)
        f(x).block_until_ready()
        spmd.barrier()
        before = sent()
        for _ in range(4):
            f(x).block_until_ready()
        spmd.barrier()
        out[f"{op}/{transport}"] = (sent() - before) / 4
if comm.rank == 0:
    print(json.dumps(out), flush=True)
"""


def test_each_hosts_link_carries_the_bytes_the_cost_model_counts(tmp_path):
    """Per call of every op, hierarchical and one MPI call over the group: the bytes h0 sends on
    its link are those spmd.perf's model puts there (TCP's headers and acknowledgements aside).
    The hierarchical allgather and reduce_scatter send half of what MPI sends."""
    from spmd.perf import collective_cost

    script = tmp_path / "bytes.py"
    script.write_text(LINK_BYTES)
    out, _ = spmd_run("--hosts", "2", "-n", "4", sys.executable, str(script))
    assert out.returncode == 0, out.stderr
    sent = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    sizes = {"allreduce": 4 * mib, "allgather": 4 * mib, "reduce_scatter": 4 * mib,
             "broadcast": 4 * mib, "all_to_all": mib // 8}  # fmt: skip
    for key, got in sent.items():
        op, algorithm = key.split("/")
        model = collective_cost(op, sizes[op], 2, 2, algorithm)["net_beta"]
        # The barrier's bytes, and 4-8% of TCP/IP headers and acknowledgements on top.
        assert 0.99 * model <= got <= 1.08 * model + (64 << 10), (key, got, model)
    assert sent["allgather/hier"] < 0.7 * sent["allgather/mpi"], sent
    assert sent["reduce_scatter/hier"] < 0.6 * sent["reduce_scatter/mpi"], sent


def test_a_rank_on_another_host_that_leaves_early_is_named_by_the_peer_watch(tmp_path):
    """Across hosts no segment shows a peer: the peer watch asks it over TCP."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys\nimport jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        "if comm.rank == 1:\n    sys.exit(0)\n"
        "spmd.allreduce(jnp.ones(3))\n"
    )
    before = _test_namespaces()
    out, took = spmd_run("--hosts", "2", "-n", "2", sys.executable, str(script),
                         env={"SPMD_TIMEOUT": "60"})  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert (
        "spmd-run: rank 0 failed: SpmdError: rank 0: allreduce: rank 1 (node h1) is exiting (its "
        "Python program ended, or called sys.exit) while this rank waited for it in "
        "allreduce(op=sum) of float32[3] over MPI (collective #2 of the group [0, 1])"
    ) in out.stderr, out.stderr
    assert took < 20, f"the job took {took:.1f} s"
    assert leftovers.new_namespaces(before) == set(), "test hosts were left behind"


def _fault_mid_job(argv, marker, fault, env=None):
    """Run ``spmd-run *argv``; once ``marker`` exists, ``fault(namespaces)`` with the job's test
    hosts' namespaces. Returns the exit code, standard error, and the seconds from the fault to
    the job's end."""
    before = _test_namespaces()
    proc = subprocess.Popen([*SPMD_RUN, *argv], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the job never got past its first collective"
        fault([n for n in _test_namespaces() - before if n.startswith(f"spmd-{proc.pid}-")])
        at = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
    return proc.returncode, stderr, time.monotonic() - at


def test_a_host_that_loses_its_link_is_named_and_the_job_ends_at_the_timeout(tmp_path):
    """h1's link goes down between two collectives: its rank is alive but unreachable. The
    stall report and the timeout name it; the job ends, and the hosts are removed."""
    script = tmp_path / "cut.py"
    marker = tmp_path / "ready"
    script.write_text(
        "import time\nimport jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        f"if comm.rank == 1:\n    open({str(marker)!r}, 'w').close()\n    time.sleep(3)\n"
        "spmd.allreduce(jnp.ones(3))\n"
    )
    before, files_before = _test_namespaces(), _hydra_files()
    env = {**os.environ, "SPMD_TIMEOUT": "6", "SPMD_STALL_WARN": "2"}

    def cut(namespaces):
        switch = next(n for n in namespaces if n.endswith("-sw"))
        subprocess.run(["ip", "-n", switch, "link", "set", "vh1", "down"], check=True)

    argv = ["--hosts", "2", "-n", "2", sys.executable, str(script)]
    code, stderr, took = _fault_mid_job(argv, marker, cut, env)
    assert code == 1, stderr
    silent = (
        "rank 1 (node h1), which does not answer the peer watch (its process may be stopped, or "
        "its node unreachable)."
    )
    assert f"(collective #2 of the group [0, 1]) for {silent}" in stderr, stderr  # stall report
    assert (
        "timed out after 6 s in allreduce(op=sum) of float32[3] over MPI (collective #2 of the "
        f"group [0, 1]) waiting for {silent}"
    ) in stderr, stderr
    assert took < 6 + 10, f"the job ended {took:.1f} s after the cut"
    assert leftovers.new_namespaces(before) == set(), "test hosts were left behind"
    # The cut-off host's launcher proxy held its topology file open until the hosts went.
    left = leftovers.new_files(_HYDRA, files_before)
    assert left == set(), "the launcher's files were left behind"


def test_a_host_whose_processes_are_all_killed_is_named(tmp_path):
    """Every process of h1 (its ranks, their wrappers, the launcher's proxy) SIGKILLed mid-job,
    as a host that dies: nobody on h1 can report, the launcher stops the others, and spmd-run
    names the rank of h1 that ended first (the kernel tells it when each rank's process ended)."""
    script = tmp_path / "die.py"
    marker = tmp_path / "ready"
    script.write_text(
        "import time\nimport jax.numpy as jnp\nimport spmd\n"
        "comm = spmd.init()\nspmd.allreduce(jnp.ones(3))\n"
        f"if comm.rank == 0:\n    open({str(marker)!r}, 'w').close()\n"
        "for _ in range(1200):\n    spmd.allreduce(jnp.ones(3))\n    time.sleep(0.05)\n"
    )
    before, shm_before, files_before = _test_namespaces(), _shm(), _hydra_files()

    def kill_h1(namespaces):
        h1 = next(n for n in namespaces if n.endswith("-h1"))
        pids = subprocess.run(["ip", "netns", "pids", h1], capture_output=True, text=True,
                              check=True).stdout.split()  # fmt: skip
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)

    argv = ["--hosts", "2", "-n", "4", sys.executable, str(script)]
    code, stderr, took = _fault_mid_job(argv, marker, kill_h1)
    assert code != 0, stderr
    assert "ranks without a clean end: [0, 1, 2, 3]" in stderr, stderr
    first = next(line for line in stderr.splitlines() if "ended first" in line)
    assert first.startswith(("spmd-run: rank 2 (host h1) ended first", "spmd-run: rank 3 (host "
                             "h1) ended first")), stderr  # fmt: skip
    assert "without reporting how (killed together with its wrapper, or its host lost)" in first
    assert took < 10, f"the job ended {took:.1f} s after the kill"
    assert leftovers.new_namespaces(before) == set(), "test hosts were left behind"
    assert leftovers.new_files(_SHM, shm_before) == set(), "shared memory was left behind"
    left = leftovers.new_files(_HYDRA, files_before)
    assert left == set(), "the launcher's files were left behind"


def test_links_are_shaped(tmp_path):
    """A rate (netem, or tbf where the kernel has no netem) on each host's end of its link."""
    script = tmp_path / "qdisc.py"
    script.write_text(
        "import subprocess\nimport spmd\ncomm = spmd.init()\n"
        "out = subprocess.run(['tc', 'qdisc', 'show', 'dev', 'eth0'], capture_output=True, "
        "text=True).stdout\n"
        "print(comm.rank, ('netem' in out or 'tbf' in out) and 'rate 1Gbit' in out, flush=True)\n"
    )
    out, _ = spmd_run("--hosts", "2", "--link", "rate 1gbit", "-n", "2", sys.executable,
                      str(script))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split()) == sorted(["0", "True", "1", "True"]), out.stdout


def test_bad_host_settings_are_errors_before_anything_starts():
    before = _test_namespaces()
    out, _ = spmd_run("--hosts", "2", "-n", "3", sys.executable, "-c", "pass")
    assert out.returncode == 2
    assert "spmd-run: -n 3 ranks do not split evenly over 2 test hosts" in out.stderr
    out, _ = spmd_run("--hosts", "2", "--nodes", "2", "-n", "2", sys.executable, "-c", "pass")
    assert out.returncode == 2 and "--nodes and --hosts exclude each other" in out.stderr
    out, _ = spmd_run("--hosts", "2", "--link", "bogus 1", "-n", "2", sys.executable, "-c", "1")
    assert out.returncode == 2 and "link shaping 'bogus 1' failed on vh0" in out.stderr
    assert leftovers.new_namespaces(before) == set(), "test hosts were left behind"


def test_test_hosts_as_a_context_manager_are_removed_on_an_error():
    with pytest.raises(RuntimeError), TestHosts(2) as hosts:
        assert {hosts.switch, *map(hosts.namespace, hosts.names)} <= _test_namespaces()
        raise RuntimeError("inside")
    assert not {hosts.switch, *map(hosts.namespace, hosts.names)} & _test_namespaces()


def where_am_i():
    import socket

    import jax.numpy as jnp

    import spmd

    spmd.init()
    return socket.gethostname(), float(spmd.allreduce(jnp.ones(2))[0])


def test_the_harness_spreads_its_ranks_over_test_hosts(monkeypatch):
    monkeypatch.setenv("SPMD_TEST_HOSTS", "2")
    before = _test_namespaces()
    assert run(where_am_i, 4, fresh=True) == [("h0", 4.0), ("h0", 4.0), ("h1", 4.0), ("h1", 4.0)]
    assert run(where_am_i, 3, fresh=True) == [(os.uname().nodename, 3.0)] * 3  # 3 do not divide
    assert leftovers.new_namespaces(before) == set(), "test hosts were left behind"


# Checks of the collectives, data parallel, ZeRO and checkpoints, on 2 hosts x 2 ranks.
ON_HOSTS = [
    "tests/ops/test_values.py::test_every_op_dtype_and_form_in_jit[4]",
    "tests/ops/test_values.py::test_send_recv_pairs[4]",
    "tests/ops/test_hierarchical.py::test_two_nodes_of_two[4]",
    "tests/transforms/test_data_parallel.py::test_parity_with_one_process[4]",
    "tests/transforms/test_zero.py::test_parity_with_data_parallel[4]",
    "tests/test_checkpoint.py::test_sharded_arrays_round_trip_and_each_shard_is_written_once[4]",
]


@pytest.mark.slow(reason="runs several test files again in a pytest of its own, on test hosts")
def test_collectives_data_parallel_zero_and_checkpoints_pass_on_two_hosts():
    root = Path(__file__).resolve().parents[2]
    before = _test_namespaces()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "0", *ON_HOSTS], cwd=root, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "SPMD_TEST_HOSTS": "2"})  # fmt: skip
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert f"{len(ON_HOSTS)} passed" in out.stdout, out.stdout[-2000:]
    assert leftovers.new_namespaces(before) == set(), "test hosts were left behind"
