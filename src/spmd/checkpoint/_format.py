"""The on-disk format: the manifest's identity and version, reading and writing it, the saved tree
structure, the user's metadata, and the names of the directories a save leaves beside its target.
The format itself is documented in :mod:`spmd.checkpoint`."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

from .._errors import SpmdError, SpmdTypeError

FORMAT = "spmd.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"

Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension of the global array

NOT_JSON = (
    "{problem}; metadata must be JSON: dicts with string keys, lists, str, int, float, bool, "
    "None (convert numpy scalars with int() or float(), arrays with .tolist(), or save arrays "
    "in the tree instead). Nothing was written"
)


def volume(index: Index) -> int:
    return math.prod(max(0, b - a) for a, b in index)


def siblings(target: Path, infix: str) -> list[Path]:
    """spmd's own ``{path}{infix}{token}`` directories: the token is a save's 32-hex-digit id,
    so a user's ``ckpt.old-run1`` beside ``ckpt`` is neither removed nor read."""
    prefix = target.name + infix
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    return [
        target.parent / n
        for n in names
        if n.startswith(prefix) and re.fullmatch(r"[0-9a-f]{32}", n[len(prefix) :])
    ]


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- the user's metadata --------------------------------------------------------------------------


def check_metadata(meta: Any, op: str) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise SpmdTypeError(
            f"metadata is a {type(meta).__name__}; expected a dict (JSON object) or None", op=op
        )
    problem = _json_problem(meta, "metadata")
    if problem is None:
        try:
            json.dumps(meta)
        except (TypeError, ValueError, RecursionError) as e:
            problem = f"metadata does not convert to JSON ({e})"
    if problem is not None:
        raise SpmdError(NOT_JSON.format(problem=problem), op=op)
    return meta


def _json_problem(x: Any, at: str, depth: int = 0) -> str | None:
    """Where ``x`` holds something JSON would refuse or silently change (a non-string key)."""
    if depth > 100:
        return f"{at} is nested too deeply (a cycle?)"
    if x is None or isinstance(x, str | int | float):  # bool is an int
        return None
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                return f"{at} has the key {k!r} ({type(k).__name__}), not a str"
            found = _json_problem(v, f"{at}[{k!r}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(x, list | tuple):
        for i, v in enumerate(x):
            found = _json_problem(v, f"{at}[{i}]", depth + 1)
            if found:
                return found
        return None
    return f"{at} is a {type(x).__name__} ({x!r:.60}), which JSON cannot hold"


# -- the tree structure ---------------------------------------------------------------------------


def pickle_treedef(treedef: Any) -> str | None:
    try:
        return base64.b64encode(pickle.dumps(treedef)).decode("ascii")
    except Exception:
        # A custom node whose auxiliary data does not pickle: the checkpoint is still complete,
        # but loading it needs like= to give the structure (documented in the package).
        return None


def unpickle_treedef(manifest: dict[str, Any], op: str) -> Any:
    data = manifest.get("treedef")
    if data is None:
        raise SpmdError(
            f"the checkpoint's tree structure ({manifest.get('tree', '?')}) could not be "
            "pickled when it was saved; pass like= (a tree of the same structure) to load it",
            op=op,
        )
    try:
        return pickle.loads(base64.b64decode(data))
    except Exception as e:
        raise SpmdError(
            f"the checkpoint's tree structure ({manifest.get('tree', '?')}) does not "
            f"unpickle here ({type(e).__name__}: {e}); import the modules that define its node "
            "types, or pass like= (a tree of the same structure)",
            op=op,
        ) from None


# -- the manifest ---------------------------------------------------------------------------------


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    with open(directory / MANIFEST, "x", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    # Make the directory's entries (every rank's files and the manifest) durable before the
    # rename publishes it.
    fsync_dir(directory)


def read_manifest(directory: Path, op: str) -> dict[str, Any]:
    p = directory / MANIFEST
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpmdError(
            f"{directory} has no {MANIFEST}, so it is not a complete spmd checkpoint (save "
            "writes the manifest last; an interrupted save never leaves its directory at the "
            "checkpoint's path)",
            op=op,
        ) from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise SpmdError(f"{p} is not valid JSON ({e}); the manifest is corrupt", op=op) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise SpmdError(
            f"{p} has format {got!r}, expected {FORMAT!r}: not an spmd checkpoint", op=op
        )
    version = manifest.get("version")
    if version != VERSION:
        raise SpmdError(
            f"{p} has format version {version!r}; this spmd reads version {VERSION}. "
            "Load it with the spmd version that wrote it",
            op=op,
        )
    return manifest
