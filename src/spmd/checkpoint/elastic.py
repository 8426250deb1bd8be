"""Elastic restart: a job that ``spmd-run --max-restarts K`` starts again after a rank fails
resumes from its newest complete checkpoint, at whatever world size it now has.

A training script needs three lines::

    state, step, meta = spmd.elastic.resume("ckpt", like={"params": params, "opt": opt_state})
    ...
    for step in range(step, steps):
        ...
        if (step + 1) % every == 0:
            spmd.elastic.save("ckpt", step + 1, {"params": params, "opt": opt_state})

Checkpoints go to ``DIR/step-NNNNNNNN`` (``spmd.save``: atomic, so a rank killed while saving
leaves the previous one complete, and resharding: a checkpoint saved on 4 ranks loads on 3).
:func:`resume` loads the newest complete one, or gives back ``like`` and step 0 when there is
none (saying so on rank 0 when the job is a restart). :func:`restart` is how many times
``spmd-run`` has restarted the job (``SPMD_RESTART``; 0 on the first run and outside
``spmd-run``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from . import load, metadata
from . import save as _save

__all__ = ["latest", "restart", "resume", "save"]

_NAME = re.compile(r"^step-(\d+)$")


def restart() -> int:
    """How many times ``spmd-run --max-restarts`` has restarted this job (0: the first run)."""
    try:
        return int(os.environ.get("SPMD_RESTART", "0"))
    except ValueError:
        return 0


def _steps(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` (a manifest is written last), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        m = _NAME.match(child.name)
        if m and (child / "manifest.json").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint that :func:`save` wrote in ``directory``, or None."""
    steps = _steps(Path(directory))
    return steps[-1][1] if steps else None


def save(
    directory: str | os.PathLike[str],
    step: int,
    tree: Any,
    *,
    metadata: dict[str, Any] | None = None,
    keep: int = 2,
    group: Any = None,
) -> Path:
    """``spmd.save`` of ``tree`` to ``directory/step-NNNNNNNN`` (a collective), with ``step`` in
    its metadata; then rank 0 removes all but the ``keep`` newest. Returns the path."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}; expected an int >= 0")
    if keep < 1:
        raise ValueError(f"keep={keep!r}; expected at least 1 (the checkpoint just written)")
    path = Path(directory) / f"step-{step:08d}"
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(path, tree, metadata={**(metadata or {}), "step": step}, group=group)
    from ..mesh import resolve_group

    if resolve_group(None, group, op="spmd.elastic.save").rank == 0:
        for _, old in _steps(Path(directory))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def resume(
    directory: str | os.PathLike[str], like: Any, *, group: Any = None
) -> tuple[Any, int, dict[str, Any]]:
    """``(state, step, metadata)`` of the newest complete checkpoint in ``directory``, loaded in
    the layout of ``like`` (a collective: every rank calls it); ``(like, 0, {})`` when there is
    none. Rank 0 of the group says which, on standard error, when the job is a restart."""
    from ..mesh import resolve_group

    comm = resolve_group(None, group, op="spmd.elastic.resume")
    # One rank looks, so that every rank loads the same checkpoint even if one is being written.
    found = comm.broadcast_object(str(latest(directory) or "") if comm.rank == 0 else None)
    if not found:
        if restart() and comm.rank == 0:
            print(f"spmd.elastic: restart {restart()}: no checkpoint in {directory} to resume "
                  "from; starting fresh", file=sys.stderr, flush=True)  # fmt: skip
        return like, 0, {}
    meta = metadata(found)
    step = int(meta.get("step", 0))
    state = load(found, like=like, group=group)
    if restart() and comm.rank == 0:
        print(f"spmd.elastic: restart {restart()}: resumed from {found} (step {step}) on "
              f"{comm.size} ranks", file=sys.stderr, flush=True)  # fmt: skip
    return state, step, meta
