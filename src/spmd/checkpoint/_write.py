"""Writing and committing: each rank's files, rank 0's check that they all arrived, and the
renames that publish the new checkpoint without ever leaving a half-written one at its path."""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import SpmdError
from ._format import MANIFEST, fsync_dir, siblings


def check_target(target: Path, op: str) -> None:
    # Replacing whatever sits at path would delete it: only a checkpoint (or an empty directory)
    # may be replaced.
    if not os.path.lexists(target):
        return
    if target.is_dir() and ((target / MANIFEST).exists() or not any(target.iterdir())):
        return
    what = "a directory without manifest.json" if target.is_dir() else "a file"
    raise SpmdError(
        f"{target} exists and is {what}, not an spmd checkpoint; refusing to replace it. "
        "Choose another path or remove it. Nothing was written",
        op=op,
    )


def write_file(path: Path, data: np.ndarray[Any, Any]) -> dict[str, Any]:
    """Write an array's bytes and fsync them; returns its size and checksum."""
    # A byte view of the array: no copy of what may be hundreds of megabytes.
    raw = data.reshape(-1).view(np.uint8)
    # Readable by the job's user alone; never through a link planted at the name.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw.data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": int(raw.size), "crc32": zlib.crc32(raw.data)}


def check_arrived(directory: Path, manifest: dict[str, Any], op: str) -> None:
    """Every file of the manifest is in rank 0's view of the directory, at its full size: ranks
    that write to different file systems (no shared storage between nodes) fail here, before
    an incomplete checkpoint could be published."""
    for leaf in manifest["leaves"]:
        for rec in leaf["files"]:
            p = directory / rec["file"]
            size = p.stat().st_size if p.exists() else None
            if size != rec["bytes"]:
                seen = "at all" if size is None else f"complete ({size} of {rec['bytes']} bytes)"
                raise SpmdError(
                    f"rank 0 does not see {p} {seen}; every rank must write to the same "
                    "(shared) file system",
                    op=op,
                )


def commit(tmp: Path, target: Path, token: str) -> None:
    """Publish ``tmp`` as ``target``: the previous checkpoint stays loadable at every instant
    (at ``target``, or in the window between the renames at ``target.old-*``)."""
    old: Path | None = None
    if os.path.lexists(target):
        old = Path(f"{target}.old-{token}")
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        if old is not None:  # put the previous checkpoint back where it was
            os.rename(old, target)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # What interrupted saves left behind is obsolete now that target is complete.
    for sibling in siblings(target, ".tmp-") + siblings(target, ".old-"):
        shutil.rmtree(sibling, ignore_errors=True)
