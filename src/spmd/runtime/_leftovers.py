"""Files MPICH makes for a job and leaves when the job does not end cleanly, removed by the job's
own ranks once every rank has passed ``MPI_Init``: under any launcher, not only ``spmd-run``.

- MPICH's shared-memory segments (``/dev/shm/mpich_shm_*``): every rank of the node maps them
  in ``MPI_Init`` and keeps them mapped; MPICH unlinks the names only in ``MPI_Finalize``.
- The launcher's topology file (``/tmp/hydra_hwloc_xmlfile_*``): MPICH's process manager (the
  ``hydra_pmi_proxy`` of each node) writes it when a rank of the node first asks for it in
  ``MPI_Init``, hands the name to its ranks, which read it there, and removes it when it exits
  normally; a job that ends in ``MPI_Abort`` or a kill leaves it (5 KiB each time).

The ranks are not told which topology file is their job's, so a file is taken as this job's, or
as a dead job's, only where no other job can own it: a proxy writes its file after it starts, so
a file whose every possible writer (a live proxy of this user that started before the file was
written) is this rank's own proxy, or that has no live possible writer at all, is removed. A
file that a concurrent job of the same user may own stays, and is removed by the first job to
start on the node after that job has ended.
"""

from __future__ import annotations

import glob
import os
import stat
import time

_PROXY = "hydra_pmi_proxy"
_TOPOLOGY = "/tmp/hydra_hwloc_xmlfile_*"  # the template is fixed in MPICH's launcher
_MARGIN_S = 0.05  # process start times have the clock tick's resolution (10 ms)


def unlink_mpich_segments() -> None:
    """Unlink the shared-memory segments MPICH mapped in ``MPI_Init``. Each rank unlinks those it
    maps (the first one succeeds), so nothing is left however the job ends; ``MPI_Finalize``
    then finds the names gone, which it ignores. Open MPI's segments are attached later, peer by
    peer, so they are left alone."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(None, 5)
        name = parts[5] if len(parts) == 6 else ""
        if name.startswith("/dev/shm/mpich_shm_") and not name.endswith(" (deleted)"):
            try:
                os.unlink(name)
            except OSError:
                pass  # another rank of the node was first


def _proxy_ages(uid: int) -> dict[int, float]:
    """Seconds since each live launcher proxy of user ``uid`` started, by pid."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return {}
    ages = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.find("(") + 1 : text.rfind(")")]
        if name != _PROXY:
            continue
        started = int(text[text.rfind(")") + 2 :].split()[19]) / tick  # field 22 of stat
        ages[int(pid)] = uptime - started
    return ages


def _own_proxy() -> int | None:
    """This process's nearest ancestor that is a launcher proxy (None outside MPICH's launcher)."""
    pid = os.getppid()
    for _ in range(8):  # the proxy, a wrapper or two between it and the rank at most
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
        except OSError:
            return None
        if text[text.find("(") + 1 : text.rfind(")")] == _PROXY:
            return pid
        pid = int(text[text.rfind(")") + 2 :].split()[1])
    return None


def stale_topology_files(
    files: dict[str, float], proxies: dict[int, float], own: int | None
) -> list[str]:
    """Of ``files`` (path -> seconds since it was last written), those that no live proxy other
    than ``own`` can have written: every proxy in ``proxies`` (pid -> seconds since it started)
    that started before the file was written, with a margin for the clock's resolution, is
    ``own``. ``own``'s ranks have all passed ``MPI_Init``, so its file is no longer needed."""
    stale = []
    for path, age in files.items():
        writers = {pid for pid, started in proxies.items() if started + _MARGIN_S >= age}
        if writers <= {own}:
            stale.append(path)
    return stale


def unlink_launcher_topology() -> list[str]:
    """Remove this user's launcher topology files that no other job can own (see the module's
    text); returns their paths. Called once every rank of the job has passed ``MPI_Init``."""
    uid = os.getuid()
    files = {}
    now = time.time()
    for path in glob.glob(_TOPOLOGY):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == uid and stat.S_ISREG(st.st_mode):
            files[path] = now - max(st.st_mtime, st.st_ctime)
    if not files:
        return []
    removed = []
    for path in stale_topology_files(files, _proxy_ages(uid), _own_proxy()):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # another rank of the node was first
    return removed
