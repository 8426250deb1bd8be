"""Test hosts: H hosts on one Linux machine, made of network namespaces, so that multi-node code
runs over real TCP between addresses of their own (``spmd-run --hosts H``, and
``spmd.testing.hosts``).

The layout, for H = 2 (names carry the creating process's pid and a sequence number):

- a *switch* namespace ``spmd-<pid>-<n>-sw`` holding a bridge ``br0`` (address 10.77.0.254),
  where the MPI launcher runs;
- a namespace ``spmd-<pid>-<n>-h<i>`` per host, with its loopback and ``eth0`` (10.77.0.<i+1>),
  one end of a veth pair whose other end (``vh<i>``) is a port of the bridge.

Every address lives inside these namespaces: nothing is added to the machine's own network,
and several sets of test hosts never see each other. MPICH's launcher starts the ranks of a
host through a launcher-exec program (``python -m spmd.launch._hostexec``) in place of ssh:
it enters the host's network namespace and new UTS and mount namespaces, where it sets the
hostname (``h<i>``: spmd's node identity) and mounts a fresh ``/dev/shm``, then runs the
launcher's proxy, which starts the host's ranks there. So the ranks of a host share memory, and
ranks of different hosts talk over TCP through the bridge.

The ranks of different hosts run on one kernel, so UCX (MPICH's default network module here)
takes them for one machine and, with a shared IPC namespace, moves their bytes through System V
shared memory, never the links: each host has an IPC namespace of its own, and jobs on test
hosts get ``UCX_TLS=tcp,self`` unless set (MPICH's own shared memory still serves the ranks of a
host). A 64 MiB allreduce between two hosts moved 18 KB over the links with neither, 68 MB with
either (``tests/cli/test_hosts.py`` checks the bytes on the link).

Optional link shaping: ``tc netem`` on both ends of each host's link (``link="delay 50us rate
10gbit"``); a kernel without netem shapes a rate alone (``link="rate 10gbit"``) with tbf. Taking
a host's link down (:meth:`TestHosts.set_link`) cuts it off mid-job.

Removal deletes the namespaces, which takes the veths and the bridge with them; a host's
``/dev/shm`` goes with the last process of its mount namespace. A process that created test
hosts and was killed before removing them leaves namespaces that the next creation removes
(those whose pid is gone). Creating them needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), ``ip``
(iproute2) and ``unshare`` (util-linux): :func:`unavailable` says what is missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from .._errors import SpmdError

SUBNET = "10.77.0"
BRIDGE = "br0"
_PREFIX = "spmd-"
_seq = itertools.count()
# The environment variable that tells the launcher-exec program the namespaces' prefix.
PREFIX_VAR = "SPMD_TEST_HOSTS_PREFIX"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise SpmdError(f"ip {' '.join(args)} failed: {out.stderr.strip()}", rank=None)
    return out


def unavailable() -> str:
    """Why test hosts cannot be made here ("" if they can)."""
    if not sys.platform.startswith("linux"):
        return "test hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (network, mount and UTS namespaces)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "util-linux")):
        if shutil.which(tool) is None:
            return f"test hosts need the '{tool}' program ({package})"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:  # what creating the hosts and entering one takes, tried in the probe namespace
        for what, args in (
            ("a bridge", ["ip", "-n", probe, "link", "add", BRIDGE, "type", "bridge"]),
            ("a veth pair", ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer",
                             "name", "p1"]),
            ("UTS, IPC and mount namespaces", ["ip", "netns", "exec", probe, "unshare", "--uts",
                                               "--ipc", "--mount", "--propagation", "private",
                                               "mount", "-t", "tmpfs", "spmd-probe",
                                               "/dev/shm"]),
        ):  # fmt: skip
            out = subprocess.run(args, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                return f"cannot make {what} for test hosts: {out.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return ""


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def remove_stale() -> None:
    """Delete test-host namespaces whose creating process is gone."""
    for name in _namespaces():
        if not name.startswith(_PREFIX):
            continue
        try:
            pid = int(name[len(_PREFIX) :].split("-", 1)[0])
            os.kill(pid, 0)
            continue  # its creator still runs
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        _ip("netns", "del", name, check=False)


class TestHosts:
    """``count`` test hosts (see the module's docstring); a context manager.

    >>> with TestHosts(2) as hosts:                            # doctest: +SKIP
    ...     hosts.names, hosts.addresses
    (['h0', 'h1'], ['10.77.0.1', '10.77.0.2'])
    """

    __test__ = False  # not a pytest class

    def __init__(self, count: int, *, link: str | None = None) -> None:
        if not 1 <= count <= 200:
            raise SpmdError(f"{count} test hosts: expected 1 to 200", rank=None)
        self.count = count
        self.link = link
        self.prefix = f"{_PREFIX}{os.getpid()}-{next(_seq)}-"
        self.names = [f"h{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.switch = self.prefix + "sw"
        self.created: list[str] = []

    def namespace(self, host: str) -> str:
        return self.prefix + host

    def create(self) -> TestHosts:
        """Make the namespaces, the bridge and the links (removing everything on a failure)."""
        reason = unavailable()
        if reason:
            raise SpmdError(reason, rank=None)
        remove_stale()
        try:
            self._add(self.switch)
            sw = ("-n", self.switch)
            _ip(*sw, "link", "set", "lo", "up")
            _ip(*sw, "link", "add", BRIDGE, "type", "bridge")
            _ip(*sw, "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
            _ip(*sw, "link", "set", BRIDGE, "up")
            for i, (host, address) in enumerate(zip(self.names, self.addresses, strict=True)):
                ns = self.namespace(host)
                self._add(ns)
                port = f"vh{i}"
                _ip(*sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip(*sw, "link", "set", port, "master", BRIDGE, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.link:
                    self._shape(self.switch, port)
                    self._shape(ns, "eth0")
        except BaseException:
            self.remove()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.created.append(ns)

    def _shape(self, ns: str, dev: str) -> None:
        """``tc netem`` with the link's parameters; where the kernel has no netem, a rate alone
        (``rate 10gbit``) is shaped with a token bucket (tbf) instead."""
        assert self.link is not None
        params = self.link.split()
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        out = subprocess.run([*cmd, "netem", *params], capture_output=True, text=True)
        if out.returncode == 0:
            return
        error = out.stderr.strip()
        if "qdisc kind is unknown" in error and len(params) == 2 and params[0] == "rate":
            tbf = ["tbf", "rate", params[1], "burst", "256kb", "latency", "50ms"]
            out = subprocess.run([*cmd, *tbf], capture_output=True, text=True)
            if out.returncode == 0:
                return
            error = out.stderr.strip()
        elif "qdisc kind is unknown" in error:
            error += " (this kernel has no netem: only a rate, e.g. 'rate 10gbit', can be shaped)"
        raise SpmdError(
            f"link shaping {self.link!r} failed on {dev}: {error} (expected tc netem parameters, "
            "e.g. 'delay 50us rate 10gbit')",
            rank=None,
        )

    def set_link(self, host: str, up: bool) -> None:
        """Take ``host``'s link down (or up again)."""
        port = f"vh{self.names.index(host)}"
        _ip("-n", self.switch, "link", "set", port, "up" if up else "down")

    def remove(self) -> None:
        """Kill what still runs in the namespaces (a host cut off from the launcher keeps its
        ranks), then delete them, and with them the links and the bridge."""
        for ns in self.created:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ValueError, ProcessLookupError, PermissionError):
                    pass
        while self.created:
            _ip("netns", "del", self.created.pop(), check=False)

    def __enter__(self) -> TestHosts:
        return self.create()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def launcher_exec(self, directory: Path) -> Path:
        """Write the launcher-exec program into ``directory`` (MPICH's launcher runs it as it
        would run ssh: ``PROGRAM [options] HOST COMMAND...``)."""
        path = directory / "hostexec"
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m spmd.launch._hostexec "$@"\n')
        path.chmod(0o755)
        return path

    def mpiexec_args(self, nprocs: int, launcher_exec: Path) -> list[str]:
        """MPICH (hydra) arguments that place ``nprocs`` ranks on the hosts, consecutive ranks
        per host, through ``launcher_exec``; the launcher runs in the switch namespace
        (:meth:`runner`)."""
        if nprocs % self.count != 0:
            raise SpmdError(
                f"-n {nprocs} ranks do not split evenly over {self.count} test hosts", rank=None
            )
        return ["-launcher", "ssh", "-launcher-exec", str(launcher_exec), "-iface", BRIDGE,
                "-hosts", ",".join(self.names), "-ppn", str(nprocs // self.count)]  # fmt: skip

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` for a job on the hosts: the namespaces' prefix for the launcher-exec program,
        and UCX on TCP between hosts (see the module's docstring)."""
        return {**env, PREFIX_VAR: self.prefix, "UCX_TLS": env.get("UCX_TLS", "tcp,self")}

    def runner(self) -> list[str]:
        """The prefix that runs a command (the launcher) in the switch namespace."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.switch]
