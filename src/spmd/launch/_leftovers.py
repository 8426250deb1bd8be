"""What MPICH and spmd leave behind when a job does not end cleanly, removed by ``spmd-run``.

A rank that is killed, or that stops its job with ``MPI_Abort``, leaves MPICH's shared-memory
segments (``/dev/shm/mpich_shm_*``) and the launcher's topology file
(``hydra_hwloc_xmlfile_*`` in the temporary directory) in place: nothing of MPICH runs any more
to remove them, and a machine that runs many failing jobs fills ``/dev/shm``. spmd's own group
segments (``/dev/shm/spmd-<pid>-*``) are removed by their creator once every rank has mapped
them, so only a creator killed in that window leaves one (a peer's ``MPI_Abort`` right after
``spmd.init`` on 4 ranks did, in about half of the runs). After each job,
``spmd-run`` removes those that appeared while the job ran, that belong to this user and that
no process has open or mapped (a concurrent job's segments are in use by its processes). The
launcher writes its topology file as it starts, and its ranks read it at once: only such a file
made in the first seconds of this job is taken as this job's (a job started in those seconds
whose ranks had not yet read its own could lose it: a narrow window, accepted). On a loaded
machine the launcher's proxies start later (a test host's proxy wrote its file 3 s after the job
began with 8 processes per core runnable): the window grows with the load, up to 4x.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

_SEGMENTS = ("/dev/shm/mpich_shm_*", "/dev/shm/spmd-*")
_TOPOLOGY = "hydra_hwloc_xmlfile_*"
_TOPOLOGY_WINDOW_S = 3.0  # after the job's start


def load_factor() -> float:
    """The 1-minute load average per usable core, between 1 and 4 (1 where it is unknown)."""
    try:
        per_core = os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except (OSError, AttributeError):
        return 1.0
    return min(4.0, max(1.0, per_core))


def _candidates(since: float) -> list[str]:
    uid = os.getuid()
    window = _TOPOLOGY_WINDOW_S * load_factor()
    found = []
    dirs = {tempfile.gettempdir(), "/tmp"}
    paths = [p for pattern in _SEGMENTS for p in glob.glob(pattern)]
    paths += [p for d in dirs for p in glob.glob(os.path.join(d, _TOPOLOGY))]
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        born = max(st.st_mtime, st.st_ctime)
        topology = os.path.basename(path).startswith("hydra_hwloc_xmlfile_")
        if topology and born > since + window:
            continue
        if st.st_uid == uid and born >= since:
            found.append(os.path.realpath(path))
    return found


def _in_use() -> set[str]:
    """Every file some process has open or mapped (those of this user's processes, which are
    the ones this user can read)."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        base = f"/proc/{pid}"
        try:
            for fd in os.listdir(f"{base}/fd"):
                try:
                    used.add(os.readlink(f"{base}/fd/{fd}"))
                except OSError:
                    pass
            with open(f"{base}/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        used.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return used


def remove_leftovers(since: float, settle_s: float = 1.0) -> list[str]:
    """Remove MPICH's and spmd's files that appeared since ``since`` (a ``time.time()``) and that no
    process uses; returns their paths. A rank killed with its launcher may take a moment to
    die and unmap its segments: files still in use are looked at again for up to ``settle_s``
    seconds (a concurrent job's stay in use and stay). Linux only (elsewhere: nothing)."""
    if not os.path.isdir("/proc/self/fd"):
        return []
    found = _candidates(since)
    removed: list[str] = []
    deadline = time.monotonic() + settle_s
    while found:
        used = _in_use()
        for path in found:
            if path not in used:
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
        found = [p for p in found if p in used]
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return removed
