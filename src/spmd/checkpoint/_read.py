"""Reading and resharding: the checkpoint a path names (or the one an interrupted save moved
aside), every file's size and CRC checked, and each leaf returned whole or as this rank's part
of the layout ``like=`` asks for, reading only the files that part overlaps."""

from __future__ import annotations

import math
import os
import stat
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError, SpmdTypeError, prefix
from ..sharded import ShardedArray, is_sharded
from ._format import MANIFEST, Index, read_manifest, saved_treedef, siblings, volume
from ._plan import SCALARS


def load_tree(target: Path, like: Any, op: str, stacklevel: int, trust: bool = False) -> Any:
    """The tree saved at ``target``, shaped as ``like`` asks (see :func:`spmd.load`); a fallback
    to ``{target}.old-*`` warns ``stacklevel`` frames up from :func:`resolve`."""
    directory = resolve(target, op, stacklevel)
    manifest = read_manifest(directory, op)
    entries = manifest["leaves"]
    swap = manifest.get("byteorder", sys.byteorder) != sys.byteorder
    reader = Reader(directory, swap, op)
    if like is None:
        treedef = saved_treedef(manifest, str(directory / MANIFEST), op, trust)
        values = [_restore(reader.full(e), e["kind"]) for e in entries]
        return jax.tree_util.tree_unflatten(treedef, values)

    with_path, like_def = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_sharded)
    saved_paths = [e["path"] for e in entries]
    like_paths = [jax.tree_util.keystr(p) for p, _ in with_path]
    if saved_paths != like_paths:
        k = next(
            (i for i, (a, b) in enumerate(zip(saved_paths, like_paths, strict=False)) if a != b),
            min(len(saved_paths), len(like_paths)),
        )
        saved_k = saved_paths[k] if k < len(saved_paths) else "(no more leaves)"
        like_k = like_paths[k] if k < len(like_paths) else "(no more leaves)"
        raise SpmdError(
            f"like= has another structure than the checkpoint: like has {len(like_paths)} "
            f"leaves, the checkpoint {len(saved_paths)}; leaf {k} is {like_k} in like but "
            f"{saved_k} in the checkpoint",
            op=op,
        )
    values = []
    for e, (_, want) in zip(entries, with_path, strict=True):
        values.append(_into(e, want, reader, op))
    return jax.tree_util.tree_unflatten(like_def, values)


def resolve(target: Path, op: str, stacklevel: int) -> Path:
    """The directory to read: ``target``, or the newest complete ``{target}.old-*`` when a save
    was interrupted between its two renames (with a warning at ``stacklevel``)."""
    if target.is_dir():
        return target
    if os.path.lexists(target):
        raise SpmdError(f"{target} is a file, not a checkpoint directory", op=op)
    complete = [p for p in siblings(target, ".old-") if (p / MANIFEST).is_file()]
    if complete:
        newest = max(complete, key=lambda p: (p / MANIFEST).stat().st_mtime_ns)
        warnings.warn(
            f"{prefix(op)}{target} is missing; reading {newest.name}, the checkpoint a save "
            "that was interrupted had moved aside",
            stacklevel=stacklevel,  # the warning points at the caller of load / metadata
        )
        return newest
    raise SpmdError(
        f"no checkpoint at {target}: the directory does not exist (and there is no complete "
        f"{target.name}.old-* to fall back on)",
        op=op,
    )


class Reader:
    """Reads (parts of) saved leaves from their files, checking every file's size and CRC."""

    def __init__(self, directory: Path, swap: bool, op: str) -> None:
        self.directory = directory
        self.swap = swap
        self.op = op

    def full(self, entry: dict[str, Any]) -> np.ndarray[Any, Any]:
        shape = tuple(entry["shape"])
        out = np.empty(shape, jnp.dtype(entry["dtype"]))
        self.fill(entry, tuple((0, g) for g in shape), out)
        return out

    def fill(self, entry: dict[str, Any], region: Index, out: np.ndarray[Any, Any]) -> None:
        """Copy the part ``region`` of the saved array into ``out`` (of the region's shape),
        reading only the files that overlap it."""
        dtype = jnp.dtype(entry["dtype"])
        filled = 0
        for rec in entry["files"]:
            index: Index = tuple((int(a), int(b)) for a, b in rec["index"])
            overlap = tuple(
                (max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, region, strict=True)
            )
            if volume(overlap) == 0:
                continue  # not a part this rank needs (zero-size leaves need no file at all)
            data = self.read(entry, rec, dtype, tuple(b - a for a, b in index))
            src = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(overlap, index, strict=True))
            dst = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(overlap, region, strict=True))
            out[dst] = data[src]
            filled += volume(overlap)
        if filled != volume(region):
            raise SpmdError(
                f"the files of leaf {entry['path']} cover {filled} of the {volume(region)} "
                "elements this rank needs; the manifest is corrupt",
                op=self.op,
            )

    def read(
        self, entry: dict[str, Any], rec: dict[str, Any], dtype: Any, shape: tuple[int, ...]
    ) -> np.ndarray[Any, Any]:
        p = self.directory / rec["file"]
        leaf = f"{p.name} of leaf {entry['path']}"
        expected = int(rec["bytes"])
        if expected != math.prod(shape) * dtype.itemsize:
            raise SpmdError(
                f"the manifest gives {leaf} {expected} bytes, but a {dtype.name} block of shape "
                f"{shape} has {math.prod(shape) * dtype.itemsize}; the manifest is corrupt",
                op=self.op,
            )
        try:
            # Never through a symbolic link: the checkpoint's files are read from inside it.
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SpmdError(
                f"the file {leaf} is missing from {self.directory}; the checkpoint is incomplete",
                op=self.op,
            ) from None
        except OSError as e:
            link = " (a symbolic link, which a load does not follow)" if p.is_symlink() else ""
            raise SpmdError(f"cannot read the file {leaf}{link}: {e}", op=self.op) from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SpmdError(f"the file {leaf} is not a regular file", op=self.op)
            data = f.read(expected + 1)  # one more: a file that grew is wrong too
        if len(data) != expected:
            how = "truncated" if len(data) < expected else "longer than saved"
            raise SpmdError(
                f"the file {leaf} is {how}: it has {os.path.getsize(p)} bytes, expected {expected}",
                op=self.op,
            )
        crc = zlib.crc32(data)
        if crc != rec["crc32"]:
            raise SpmdError(
                f"the file {leaf} is corrupt: its CRC-32 is {crc:#010x}, the manifest expects "
                f"{rec['crc32']:#010x}",
                op=self.op,
            )
        arr = np.frombuffer(data, dtype).reshape(shape)
        return arr.byteswap() if self.swap else arr


def _restore(arr: np.ndarray[Any, Any], kind: str) -> Any:
    """A full saved array as the kind of value ``kind`` names."""
    if kind in ("int", "float", "bool", "complex"):
        return arr.item()
    if kind == "numpy_scalar":
        return arr[()]
    if kind == "numpy":
        return arr
    return _to_jax(arr)


def _to_jax(arr: np.ndarray[Any, Any]) -> Any:
    # jnp.asarray would narrow a dtype this jax cannot hold (float64 without x64) with only a
    # warning; keep such arrays as numpy so that no value changes silently.
    if jax.dtypes.canonicalize_dtype(arr.dtype) != arr.dtype:
        return arr
    return jnp.asarray(arr)


def _into(entry: dict[str, Any], want: Any, reader: Reader, op: str) -> Any:
    """The saved leaf ``entry`` in the form the ``like`` leaf ``want`` asks for."""
    path = entry["path"]
    saved_shape = tuple(entry["shape"])
    saved_dtype = jnp.dtype(entry["dtype"])
    if isinstance(want, ShardedArray | jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
        shape, dtype = tuple(want.shape), np.dtype(want.dtype)
    elif type(want) in SCALARS:
        shape, dtype = (), np.asarray(want).dtype
    else:
        raise SpmdTypeError(
            f"like{path} is a {type(want).__name__}; expected a spmd.ShardedArray, a jax or "
            "numpy array, a jax.ShapeDtypeStruct or a scalar saying how to return the leaf",
            op=op,
        )
    if shape != saved_shape or np.dtype(dtype).newbyteorder("=") != saved_dtype:
        raise SpmdError(
            f"leaf {path} was saved with shape {saved_shape} and dtype {saved_dtype.name}, but "
            f"like= expects shape {shape} and dtype {dtype.name}",
            op=op,
        )
    if isinstance(want, ShardedArray):
        # Only this rank's part: read the files it overlaps straight into its padded shard
        # (zeros in the padding, as spmd.shard makes it), never the whole array.
        local = np.zeros(want.local_shape, saved_dtype)
        region = tuple((s.start, s.stop) for s in want.index())
        # A view, filling it fills local (a 0-d shard's empty index would give a scalar copy).
        part = local[want.valid()] if local.ndim else local[...]
        reader.fill(entry, region, part)
        return ShardedArray(jnp.asarray(local), saved_shape, want.spec, want.mesh)
    arr = reader.full(entry)
    if isinstance(want, jax.Array | jax.ShapeDtypeStruct):
        return _to_jax(arr)
    if isinstance(want, np.ndarray):
        return arr
    if isinstance(want, np.generic):
        return arr[()]
    return type(want)(arr.item())
