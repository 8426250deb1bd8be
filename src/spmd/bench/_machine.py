"""What a result is recorded with: the machine and the versions (no hostname, no paths), the
cores the job was given, and the shared-memory hop time spmd's staging decides by."""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import subprocess
import sys
from typing import Any

import numpy as np

from ..runtime import recorded_cpus
from ._peers import Env


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def host_info(*packages: str) -> dict[str, Any]:
    """The machine and the versions every result records (no hostname, no paths): cpu, cores,
    the job's cores, memory, Python, spmd, jax, jaxlib, each of ``packages``, the MPICH
    wheel."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "job_cores": job_cores(),
        "memory_GiB": memory_gib(),
        "python": platform.python_version(),
        **{p: package_version(p) for p in ("spmd", "jax", "jaxlib", *packages)},
        "mpich_wheel": package_version("mpich"),
    }


def machine_info(env: Env, transport: str) -> dict[str, Any]:
    """Hardware and versions; no hostname, no paths."""
    import jax

    from ..runtime import shm_staging

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    lib = str(env.mpi.Get_library_version()).strip().splitlines()[0]
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "job_cores": job_cores(),
        "cores_per_rank": affinity,  # rank 0's affinity mask (spmd-run pins ranks)
        "memory_GiB": memory_gib(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "spmd": package_version("spmd"),
        "jax": jax.__version__,
        "jaxlib": package_version("jaxlib"),
        "jax_device": str(jax.devices()[0].device_kind),
        "numpy": np.__version__,
        "mpi4py": package_version("mpi4py"),
        "mpi_library": " ".join(lib.split()),
        "mpi_standard": "{}.{}".format(*env.mpi.Get_version()),
        "mpich_wheel": package_version("mpich"),
        "mpi4jax": package_version("mpi4jax"),
        "torch": package_version("torch"),
        "spmd_transport": transport,
        "spmd_shm_staging": shm_staging(),
        "ranks": env.n,
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
    }
    return info


def shm_hop(probes: int = 3) -> float | None:
    """The world's shared-memory hop time (spmd.runtime.shm_hop_ns), rounded, as rank 0
    measured it: the least of ``probes`` probes, since a rank descheduled during one (at a job's
    start, XLA's threads still busy) only adds to it. Collective. Over 100 ns the ranks share
    no cache and staging streams; the state can change during a run on a VM."""
    from ..runtime import get_communicator, shm_hop_ns

    hops = [shm_hop_ns(get_communicator()) for _ in range(probes)]
    if hops[0] is None or math.isnan(hops[0]):
        return None
    return round(min(h for h in hops if h is not None), 1)


def job_cores() -> int:
    """The cores this job may use: those ``spmd-run`` recorded for its ranks before pinning them
    (``SPMD_BIND_CPUS``), else this process's affinity (``taskset``, a cgroup's cpuset), else
    every core of the machine."""
    recorded = recorded_cpus(os.environ)
    if recorded is not None:
        return len(recorded)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cores_tag() -> str:
    """``cpu<cores>`` for the results' file names; ``cpu<cores>of<total>`` when the job was given
    fewer cores than the machine has, so that such a run never overwrites a whole machine's."""
    used, total = job_cores(), os.cpu_count() or 1
    return f"cpu{used}" if used >= total else f"cpu{used}of{total}"


def run_tag(n: int, transport_forced: str | None) -> str:
    tag = f"{cores_tag()}-n{n}"
    if not transport_forced or transport_forced == "auto":
        return tag
    return f"{tag}-{transport_forced.replace(',', '+')}"


def in_job() -> bool:
    """Whether this process is a rank of a job the MPI launcher started."""
    return "PMI_RANK" in os.environ or "PMI_SIZE" in os.environ


def relaunch(nprocs: int, script: str, argv: list[str]) -> int:
    """Run ``python script *argv`` as a job of ``nprocs`` ranks under ``spmd-run``; its exit
    code (a benchmark started outside a job starts one itself)."""
    cmd = [sys.executable, "-m", "spmd.cli.run", "-n", str(nprocs), sys.executable, script, *argv]
    return subprocess.call(cmd)
