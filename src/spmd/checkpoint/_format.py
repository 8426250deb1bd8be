"""The on-disk format: the manifest's identity and version, reading and writing it, the saved tree
structure, the user's metadata, and the names of the directories a save leaves beside its target.
The format itself is documented in :mod:`spmd.checkpoint`."""

from __future__ import annotations

import base64
import importlib
import json
import math
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

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


# The tree structure as data: dicts (str or int keys, in jax's sorted order), lists, tuples,
# None and namedtuples (by module and name, such as optax's states), with "*" for a leaf; a load
# rebuilds it without unpickling anything. Trees with other node types (custom pytree nodes)
# need like=, or the pickled treedef with trust=True.
_LEAF = "*"
_MAX_DEPTH = 200


class _Placeholder:
    """A leaf of a rebuilt structure, before the values take its place."""


def describe_structure(tree: Any, is_leaf: Any) -> Any:
    """``tree``'s structure as JSON data, or None if it has nodes that are not dict, list,
    tuple, None or a namedtuple defined at a module's top level (or dict keys that are not str
    or int)."""

    def walk(x: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _NotData
        if x is None:
            return None
        t = type(x)
        if t is list or t is tuple:
            return {t.__name__: [walk(v, depth + 1) for v in x]}
        if t is dict:
            if not all(type(k) in (str, int) for k in x):
                raise _NotData
            try:
                keys = sorted(x)  # jax's order of a dict's children
            except TypeError:  # str and int keys together
                raise _NotData from None
            return {"dict": [[k, walk(x[k], depth + 1)] for k in keys]}
        if isinstance(x, tuple) and hasattr(t, "_fields") and "<locals>" not in t.__qualname__:
            children = [walk(v, depth + 1) for v in x]
            return {"namedtuple": [t.__module__, t.__qualname__, children]}
        leaf: Any = jax.tree_util.tree_structure(x, is_leaf=is_leaf)
        if leaf.num_nodes == 1 and leaf.num_leaves == 1:
            return _LEAF
        raise _NotData  # a custom pytree node, a namedtuple defined inside a function, ...

    try:
        return walk(tree, 0)
    except _NotData:
        return None


class _NotData(Exception):
    pass


def structure_treedef(data: Any, leaves: int, where: str, op: str) -> Any:
    """The treedef the manifest's ``structure`` describes, checked to hold ``leaves`` leaves."""

    def bad(at: str, got: Any) -> SpmdError:
        return SpmdError(
            f'{where}: {at} is {got!r:.80}; expected null, "*" (a leaf), or one of '
            '{"list": [...]}, {"tuple": [...]}, {"dict": [[key, ...], ...]} with str or int '
            'keys, {"namedtuple": [module, name, [...]]}. The manifest is corrupt or was not '
            "written by spmd.save",
            op=op,
        )

    def build(x: Any, at: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise SpmdError(f"{where}: {at} is nested more than {_MAX_DEPTH} deep", op=op)
        if x is None:
            return None
        if x == _LEAF:
            return _Placeholder()
        if not isinstance(x, dict) or len(x) != 1:
            raise bad(at, x)
        ((kind, body),) = x.items()
        if kind in ("list", "tuple") and isinstance(body, list):
            built = [build(v, f"{at}.{kind}[{i}]", depth + 1) for i, v in enumerate(body)]
            return built if kind == "list" else tuple(built)
        if kind == "namedtuple" and isinstance(body, list) and len(body) == 3:
            cls = _namedtuple_class(body[0], body[1], f"{at}.namedtuple", where, op)
            if not isinstance(body[2], list) or len(body[2]) != len(cls._fields):
                raise bad(f"{at}.namedtuple[2]", body[2])
            return cls(
                *(build(v, f"{at}.{body[1]}[{i}]", depth + 1) for i, v in enumerate(body[2]))
            )
        if kind == "dict" and isinstance(body, list):
            out = {}
            for i, item in enumerate(body):
                ok = isinstance(item, list) and len(item) == 2
                if not ok or type(item[0]) not in (str, int):
                    raise bad(f"{at}.dict[{i}]", item)
                out[item[0]] = build(item[1], f"{at}.dict[{i}][1]", depth + 1)
            return out
        raise bad(at, x)

    treedef: Any = jax.tree_util.tree_structure(build(data, "structure", 0))
    if treedef.num_leaves != leaves:
        raise SpmdError(
            f"{where}: the structure has {treedef.num_leaves} leaves but the manifest lists "
            f"{leaves}; the manifest is corrupt",
            op=op,
        )
    return treedef


# Packages whose modules a load may import to find a namedtuple (their optimizer and model
# states); any other module must have been imported by the program already.
IMPORTABLE = ("optax", "flax", "equinox", "haiku", "jax", "spmd")


def _namedtuple_class(module: Any, qualname: Any, at: str, where: str, op: str) -> Any:
    """The namedtuple class a structure names, from a module the program has imported already
    or one of the packages in IMPORTABLE (a manifest must not make a load import any module:
    importing runs its code), checked to be a namedtuple."""
    mod = sys.modules.get(module) if isinstance(module, str) else None
    if mod is None and isinstance(module, str) and module.split(".")[0] in IMPORTABLE:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            mod = None
    cls: Any = mod
    for part in qualname.split(".") if isinstance(qualname, str) and mod is not None else []:
        cls = getattr(cls, part, None)
    if mod is None or not (isinstance(cls, type) and issubclass(cls, tuple)):
        raise SpmdError(
            f"{where}: {at} names the namedtuple {module}.{qualname}, which is not a namedtuple "
            f"of a module this program has imported (or of {', '.join(IMPORTABLE)}); import the "
            "module that defines it, or pass like= (a tree of the same structure)",
            op=op,
        )
    if not hasattr(cls, "_fields"):
        raise SpmdError(f"{where}: {at} names {module}.{qualname}, not a namedtuple", op=op)
    return cls


def saved_treedef(manifest: dict[str, Any], where: str, op: str, trust: bool) -> Any:
    """The saved tree structure, for a load without ``like``: from the manifest's data, or
    from its pickle only when the caller trusts the checkpoint (unpickling can run code)."""
    leaves = len(manifest["leaves"])
    if manifest.get("structure") is not None:
        return structure_treedef(manifest["structure"], leaves, where, op)
    if manifest.get("treedef") is None:
        raise SpmdError(
            f"the checkpoint's tree structure ({manifest.get('tree', '?')}) could not be "
            "pickled when it was saved; pass like= (a tree of the same structure) to load it",
            op=op,
        )
    if not trust:
        raise SpmdError(
            f"the checkpoint's tree structure ({manifest.get('tree', '?'):.200}) has node types "
            "other than dict, list, tuple, None and namedtuples, which only the pickle in its "
            "manifest can rebuild, and unpickling runs whatever code the pickle names: pass "
            "like= (a tree of the same structure), or trust=True if you trust everyone who could "
            "have written the checkpoint",
            op=op,
        )
    treedef = unpickle_treedef(manifest, op)
    if treedef.num_leaves != leaves:
        raise SpmdError(
            f"the manifest lists {leaves} leaves but its tree structure has "
            f"{treedef.num_leaves}; the manifest is corrupt",
            op=op,
        )
    return treedef


# -- checking a manifest before anything is read through it ---------------------------------------

KINDS = ("jax", "sharded", "numpy", "numpy_scalar", "int", "float", "bool", "complex")


def savable(d: np.dtype[Any]) -> bool:
    """Whether a checkpoint holds arrays of ``d``: numbers and bool (ml_dtypes' bfloat16 and
    float8 types included), whose name alone rebuilds the dtype."""
    try:
        return d.kind in "biufcV" and d.names is None and jax.numpy.dtype(d.name) == d
    except TypeError:
        return False


def dtype_from_name(name: Any) -> np.dtype[Any] | None:
    """The dtype a manifest names, if it is one spmd.save writes (see :func:`savable`)."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        return None
    try:
        d = np.dtype(jax.numpy.dtype(name))
    except TypeError:
        return None
    return d if d.name == name and savable(d) else None


def check_manifest(manifest: dict[str, Any], where: str, op: str) -> None:
    """Every field a load uses has the type and range :func:`spmd.save` writes: file names of
    this checkpoint's own pattern (no path can lead outside it), index ranges inside the
    array, dtypes from the allow-list. An error names the field."""

    def fail(at: str, got: Any, expected: str) -> SpmdError:
        return SpmdError(
            f"{where}: {at} is {got!r:.200}; expected {expected}. The manifest is corrupt or was "
            "not written by spmd.save",
            op=op,
        )

    def nat(x: Any) -> bool:
        return type(x) is int and x >= 0

    if manifest.get("byteorder", "little") not in ("little", "big"):
        raise fail("byteorder", manifest.get("byteorder"), '"little" or "big"')
    meta = manifest.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise fail("metadata", meta, "a JSON object")
    for field in ("treedef", "tree"):
        if manifest.get(field) is not None and not isinstance(manifest[field], str):
            raise fail(field, manifest[field], "a string or null")
    leaves = manifest.get("leaves")
    if not isinstance(leaves, list):
        raise fail("leaves", leaves, "a list of leaf records")
    for i, e in enumerate(leaves):
        at = f"leaves[{i}]"
        if not isinstance(e, dict):
            raise fail(at, e, "a leaf record (a JSON object)")
        if not isinstance(e.get("path"), str):
            raise fail(f"{at}.path", e.get("path"), "the leaf's path, a string")
        if e.get("kind") not in KINDS:
            raise fail(f"{at}.kind", e.get("kind"), f"one of {', '.join(KINDS)}")
        shape = e.get("shape")
        if not isinstance(shape, list) or len(shape) > 64 or not all(nat(n) for n in shape):
            raise fail(f"{at}.shape", shape, "a list of at most 64 non-negative ints")
        dtype = dtype_from_name(e.get("dtype"))
        if dtype is None:
            raise fail(f"{at}.dtype", e.get("dtype"), "a numeric or bool dtype name")
        files = e.get("files")
        if not isinstance(files, list):
            raise fail(f"{at}.files", files, "a list of file records")
        pattern = rf"{i:05d}(\.\d{{5,}})?\.bin"
        for j, rec in enumerate(files):
            fat = f"{at}.files[{j}]"
            if not isinstance(rec, dict):
                raise fail(fat, rec, "a file record (a JSON object)")
            name = rec.get("file")
            if not isinstance(name, str) or not re.fullmatch(pattern, name):
                raise fail(
                    f"{fat}.file",
                    name,
                    f"the name of a file inside the checkpoint, {i:05d}.bin or {i:05d}.<shard>.bin",
                )
            index: Any = rec.get("index")
            ok = isinstance(index, list) and len(index) == len(shape)
            ok = ok and all(
                isinstance(r, list) and len(r) == 2 and nat(r[0]) and nat(r[1])
                and r[0] <= r[1] <= n
                for r, n in zip(index, shape, strict=False)
            )  # fmt: skip
            if not ok:
                raise fail(
                    f"{fat}.index", index, f"a [start, stop] pair inside {shape} per dimension"
                )
            if not nat(rec.get("bytes")):
                raise fail(f"{fat}.bytes", rec.get("bytes"), "a non-negative int")
            crc: Any = rec.get("crc32")
            if not nat(crc) or crc >= 1 << 32:
                raise fail(f"{fat}.crc32", crc, "a CRC-32, an int below 2**32")


# -- the manifest ---------------------------------------------------------------------------------


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(directory / MANIFEST, flags, 0o600), "w", encoding="utf-8") as f:
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
    except RecursionError:
        raise SpmdError(
            f"{p} is JSON nested too deeply to read; the manifest is corrupt", op=op
        ) from None
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
    check_manifest(manifest, str(p), op)
    return manifest
