"""A private single-node Slurm cluster for the tests: munged, slurmctld and slurmd on loopback.

Everything lives in one temporary directory: munge's key and socket, Slurm's configuration,
state, spool and logs. The daemons listen on ports of their own, so a Slurm the machine already
runs is left alone; ``srun``, ``sbatch`` and the other clients find this cluster through
``SLURM_CONF`` in :attr:`Slurm.env`. The node is the machine as ``slurmd -C`` describes it (its
CPUs and memory), named ``localhost``. Process tracking by the process tree
(``proctrack/linuxproc``), no task plugin and no accounting: nothing needs cgroups, so it runs in
a container. ``MpiDefault=none``, as on a cluster where ``srun`` needs ``--mpi``.

``Slurm(nodes=2)`` makes a cluster of two nodes on test hosts (``spmd.launch._hosts``: network
namespaces joined by a bridge): ``slurmctld`` in the switch namespace as host ``sw``, and a
``slurmd`` per host (``h0``, ``h1``) in the host's network namespace and new UTS, IPC and mount
namespaces, with the host's name as hostname (spmd's node identity), a ``/dev/shm`` of its own
and an ``/etc/hosts`` that names the three; munged stays outside (its socket is a file). The
clients run in the switch namespace (:meth:`Slurm.run`). ``nsenter --net`` enters a network
namespace without remounting ``/sys``, where slurmd finds the machine's cgroups.

Debian's packages give it: ``apt-get install slurmctld slurmd slurm-client munge``, and
``libpmix-dev`` for ``srun --mpi=pmix`` (Slurm's PMIx plugin opens ``libpmix.so``). The daemons
run as root here, as on a cluster (slurmd starts each job's processes as its user): where they
are missing, or this is not root, or they do not start, :func:`unavailable` or
:meth:`Slurm.start` says why and the tests skip with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from spmd.launch._hosts import SUBNET, TestHosts

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scancel", "squeue", "sinfo")
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return shutil.which(name, path=path)


def unavailable() -> str:
    """Why a private Slurm cannot run here ("" where it can be tried)."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return (
            f"no {', '.join(missing)} (a private Slurm needs Debian's slurmctld, slurmd, "
            "slurm-client and munge packages)"
        )
    if os.geteuid() != 0:
        return "a private Slurm runs its daemons as root (slurmd starts job steps as their user)"
    return ""


class SlurmUnavailable(RuntimeError):
    """The cluster did not start; the message says why (with the end of the daemon's log)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_hardware() -> str:
    """This machine as ``slurmd -C`` describes it: ``CPUs=2 Boards=1 ... RealMemory=24105``."""
    slurmd = _which("slurmd")
    assert slurmd is not None
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30)
    line = out.stdout.splitlines()[0] if out.stdout else ""
    if out.returncode != 0 or not line.startswith("NodeName="):
        raise SlurmUnavailable(f"slurmd -C failed: {out.stdout}{out.stderr}")
    return line.split(None, 1)[1]


_CONF = """\
ClusterName=spmdtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=5
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 {hardware} State=UNKNOWN
PartitionName=main Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _on_hosts(conf: str, hosts: TestHosts) -> str:
    """The configuration of a cluster of the test hosts' nodes, its controller on ``sw``."""
    nodes = "".join(
        f"NodeName={name} NodeAddr={address} {{hardware}} State=UNKNOWN\n"
        for name, address in zip(hosts.names, hosts.addresses, strict=True)
    )
    for old, new in [
        ("SlurmctldHost=localhost", f"SlurmctldHost=sw({SUBNET}.254)"),
        ("SlurmdSpoolDir={root}/spool", "SlurmdSpoolDir={root}/spool-%n"),
        ("SlurmdPidFile={root}/slurmd.pid", "SlurmdPidFile={root}/slurmd-%n.pid"),
        ("SlurmdLogFile={root}/log/slurmd.log", "SlurmdLogFile={root}/log/slurmd-%n.log"),
        ("NodeName=localhost NodeAddr=127.0.0.1 {hardware} State=UNKNOWN\n", nodes),
        ("Nodes=localhost", f"Nodes={','.join(hosts.names)}"),
    ]:
        assert old in conf, old
        conf = conf.replace(old, new)
    return conf


class Slurm:
    """One private cluster: :meth:`start`, run jobs with :meth:`srun` / :meth:`sbatch`, and
    :meth:`stop`, which ends its jobs and daemons and removes the directory. ``nodes=2``: two
    nodes on test hosts (see the module's docstring)."""

    def __init__(self, nodes: int = 1) -> None:
        # A short path: munge's and PMIx's sockets live under it (sockets' paths are short).
        self.root = Path(tempfile.mkdtemp(prefix="spmd-slurm-", dir="/tmp"))
        self.conf = self.root / "slurm.conf"
        self._daemons: list[subprocess.Popen[bytes]] = []
        self.hosts = TestHosts(nodes) if nodes > 1 else None
        self.nodes = self.hosts.names if self.hosts else ["localhost"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI"))}
        env["SLURM_CONF"] = str(self.conf)
        self.env = env

    # -- the daemons -------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        spools = [f"spool-{n}" for n in self.nodes] if self.hosts else ["spool"]
        for sub in ("munge", "state", "log", *spools):
            (self.root / sub).mkdir(mode=0o755)
        key = self.root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "plugstack.conf").write_text("")
        conf = _CONF
        if self.hosts:
            try:
                self.hosts.create()
            except Exception as e:  # no namespaces here: the tests skip
                raise SlurmUnavailable(f"no test hosts: {e}") from e
            conf = _on_hosts(conf, self.hosts)
            names = zip(self.hosts.addresses, self.hosts.names, strict=True)
            (self.root / "hosts").write_text(
                f"127.0.0.1 localhost\n{SUBNET}.254 sw\n"
                + "".join(f"{address} {name}\n" for address, name in names)
            )
        self.conf.write_text(
            conf.format(
                root=self.root,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                hardware=_node_hardware(),
            )
        )
        munge = self.root / "munge"
        self._spawn(
            "munged", "-F", "--force", f"--socket={munge}/socket", f"--key-file={key}",
            f"--pid-file={munge}/pid", f"--log-file={munge}/log", f"--seed-file={munge}/seed",
        )  # fmt: skip
        self._wait(lambda: (munge / "socket").exists(), timeout, "munged", munge / "log")
        self._spawn("slurmctld", "-D", "-f", str(self.conf), host="sw")
        for node in self.nodes:
            self._spawn("slurmd", "-D", "-f", str(self.conf), "-N", node, host=node)
        log = "slurmd-h0.log" if self.hosts else "slurmd.log"
        self._wait(self._node_idle, timeout, "slurmd", self.root / "log" / log)

    def _inside(self, host: str) -> list[str]:
        """The prefix that runs a command on a test host (``sw``: the switch), or nothing."""
        if self.hosts is None:
            return []
        ns = self.hosts.switch if host == "sw" else self.hosts.namespace(host)
        setup = f"hostname {host} && mount --bind {self.root}/hosts /etc/hosts"
        if host != "sw":
            setup += " && mount -t tmpfs -o mode=1777 spmd-shm /dev/shm"
        return ["nsenter", f"--net=/var/run/netns/{ns}", "unshare", "--uts", "--ipc", "--mount",
                "--propagation", "private", "sh", "-c", setup + ' && exec "$0" "$@"']  # fmt: skip

    def _spawn(self, name: str, *args: str, host: str = "") -> None:
        exe = _which(name)
        assert exe is not None
        out = self.root / "log" / f"{name}{'-' + host if self.hosts and host else ''}.out"
        with open(out, "wb") as log:  # the daemon keeps its own
            self._daemons.append(
                subprocess.Popen(
                    [*(self._inside(host) if host else []), exe, *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            )

    def _wait(self, ready: Callable[[], bool], timeout: float, name: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [d for d in self._daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"exited with {dead[0].returncode}" if dead else f"not ready in {timeout:g} s"
                raise SlurmUnavailable(f"{name} {why}: {self._tail(log)}")
            time.sleep(0.1)

    def _tail(self, log: Path) -> str:
        texts = []
        for path in (log, *sorted((self.root / "log").glob("*.out"))):
            try:
                texts.append(f"{path.name}: " + " | ".join(path.read_text().splitlines()[-5:]))
            except OSError:
                pass
        return "; ".join(texts)

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
        return out.stdout.split() == ["idle"] * len(self.nodes)

    def stop(self) -> None:
        """Cancel every job, wait for their processes to end, stop the daemons, remove it all."""
        try:
            if self._daemons and all(d.poll() is None for d in self._daemons):
                self.run("scancel", "--user", str(os.getuid()), check=False)
                deadline = time.monotonic() + 20
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.2)
        finally:
            for daemon in reversed(self._daemons):
                if daemon.poll() is None:
                    daemon.send_signal(signal.SIGTERM)
            for daemon in reversed(self._daemons):
                try:
                    daemon.wait(10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
            for pid in processes_using(self.root):  # a job step that outlived its daemons
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.hosts is not None:
                self.hosts.remove()
            shutil.rmtree(self.root, ignore_errors=True)

    # -- the clients --------------------------------------------------------------------------

    @staticmethod
    def which(name: str) -> str:
        """The path of a Slurm client or daemon (``sbin`` directories included)."""
        found = _which(name)
        assert found is not None, name
        return found

    def run(self, *argv: str, check: bool = True, timeout: float = 60.0,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """A Slurm client (``srun``, ``squeue``, ...) against this cluster."""
        argv = (*self._inside("sw"), self.which(argv[0]), *argv[1:])
        out = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr}")
        return out

    def sbatch(self, script: Path, *args: str) -> int:
        """Submit a batch script (run from its directory); the job's id."""
        out = self.run("sbatch", "--parsable", *args, str(script), cwd=script.parent)
        return int(out.stdout.strip().split(";")[0])

    def jobs(self) -> list[int]:
        """The ids of the jobs this cluster still holds (pending, running or completing)."""
        out = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
        return [int(j) for j in out.stdout.split() if j.isdigit()]

    def wait_gone(self, job: int, timeout: float) -> float:
        """Seconds until ``job`` has left the queue; AssertionError after ``timeout``."""
        start = time.monotonic()
        while job in self.jobs():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"job {job} still in the queue after {timeout:g} s")
            time.sleep(0.1)
        return time.monotonic() - start


def processes_using(root: Path) -> list[int]:
    """The processes (other than this one) with a file, working directory or executable under
    ``root``: what is left of the cluster's daemons and job steps."""
    prefix = str(root) + os.sep
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        links = [f"/proc/{entry}/cwd"]
        try:
            links += [f"/proc/{entry}/fd/{fd}" for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith(prefix):
                found.append(int(entry))
                break
    return found


def node_state_reason(slurm: Slurm) -> str:
    """The node's state and Slurm's reason for it (for a test's failure message)."""
    out = slurm.run("sinfo", "-h", "-N", "-o", "%T %E", check=False, timeout=10)
    return re.sub(r"\s+", " ", out.stdout.strip())
