"""Checkpoints other programs read: safetensors files and Orbax checkpoints.

safetensors (``save_safetensors`` / ``load_safetensors``): one tensor per leaf, the full array,
named by its path with the keys joined by dots (``{"params": {"dense": {"w": ..}}}`` ->
``params.dense.w``; list and tuple positions as numbers), as Hugging Face names weights.
Writing streams: the header is known from the shapes alone, so rank 0 writes it and then each
tensor as it is gathered, one at a time (no rank holds more than its shards plus one full
tensor). The ``safetensors`` package has no streaming writer (its ``save_file`` takes every
tensor at once), so the file is laid out here after the format's specification (8 bytes of
header length, the JSON header padded to 8 bytes, the raw little-endian data); reading goes
through ``safetensors.safe_open``, whose slices read only this rank's block of each tensor.

Orbax (``spmd.save(path, tree, format="orbax")``, ``spmd.load`` of an Orbax directory): Orbax
and TensorStore do the storage; spmd's ranks are separate JAX programs (no
``jax.distributed``), so rank 0 gathers the tree (one tensor at a time on the other ranks) and
saves it with ``orbax.checkpoint`` as a one-process program would, and a load restores the
full arrays with Orbax on each rank and keeps each rank's block. Rank 0 therefore holds the
whole model while saving, and every rank while loading.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._errors import SpmdError
from ..runtime import Communicator
from ..sharded import ShardedArray, is_sharded
from ._plan import check_no_blocks

_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


def tensor_name(path: Any) -> str:
    """A pytree path as Hugging Face names weights: keys joined by dots."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "local":  # a ShardedArray's own node
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k).strip(".[]'\""))
    return ".".join(parts)


def _named(tree: Any, op: str) -> list[tuple[str, Any]]:
    check_no_blocks(tree, op)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]
    named = [(tensor_name(p), x) for p, x in leaves]
    seen: dict[str, int] = {}
    for name, _ in named:
        seen[name] = seen.get(name, 0) + 1
    twice = [n for n, c in seen.items() if c > 1]
    if twice:
        raise SpmdError(f"the leaves' names collide: {twice} (rename the keys)", op=op)
    return named


def _meta(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    if is_sharded(x):
        return tuple(x.shape), np.dtype(x.dtype)
    a = np.asarray(x) if not hasattr(x, "dtype") else x
    return tuple(np.shape(a)), np.dtype(a.dtype)


def save_safetensors(path: Any, tree: Any, comm: Communicator, op: str) -> None:
    named = _named(tree, op)
    header: dict[str, Any] = {}
    offset = 0
    for name, x in named:
        shape, dtype = _meta(x)
        if dtype.name not in _ST_DTYPES:
            raise SpmdError(f"{name} has dtype {dtype}, which safetensors cannot hold", op=op)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype.name], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    target = Path(os.path.realpath(os.fspath(path)))
    token = comm.broadcast_object(uuid.uuid4().hex if comm.rank == 0 else None, root=0)
    tmp = target.with_name(f".{target.name}.tmp-{token}")
    out, error = None, ""

    def attempt(step: Any) -> None:  # rank 0's writing; a failure stops the writing only
        nonlocal error
        if error:
            return
        try:
            step()
        except Exception as e:
            error = f"writing {target} failed: {type(e).__name__}: {e}"

    def start() -> None:
        nonlocal out
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        out = os.fdopen(fd, "wb")
        out.write(struct.pack("<Q", len(text)) + text)

    def finish() -> None:
        assert out is not None
        out.flush()
        os.fsync(out.fileno())
        out.close()
        os.replace(tmp, target)

    if comm.rank == 0:
        attempt(start)
    for _, x in named:  # every rank takes part in every gather, in order, whatever rank 0 met
        full = x.gather() if is_sharded(x) else x
        if comm.rank == 0:
            attempt(lambda full=full: _write_tensor(out, full))
        del full
    if comm.rank == 0:
        attempt(finish)
        if error:
            if out is not None and not out.closed:
                out.close()
            tmp.unlink(missing_ok=True)
    failed = comm.broadcast_object(error, root=0)
    if failed:
        raise SpmdError(failed if comm.rank == 0 else f"rank 0 failed: {failed}", op=op)


def _write_tensor(out: Any, full: Any) -> None:
    """The tensor's bytes, little-endian, C order, without a copy where it is one already."""
    a = np.asarray(jax.device_get(full))
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    out.write(a.reshape(-1).view(np.uint8).data)


def load_safetensors(path: Any, like: Any, strict: bool, op: str) -> Any:
    from safetensors import safe_open

    named = _named(like, op)
    leaves, structure = jax.tree_util.tree_flatten(like, is_leaf=is_sharded)
    out = []
    with safe_open(os.fspath(path), framework="numpy") as f:
        stored = set(f.keys())
        missing = [n for n, _ in named if n not in stored]
        extra = sorted(stored - {n for n, _ in named})
        if missing or (strict and extra):
            raise SpmdError(
                f"{path} holds {len(stored)} tensors; like names {len(named)}: "
                + (f"missing {missing[:8]}" if missing else "")
                + ("; " if missing and strict and extra else "")
                + (
                    f"not in like {extra[:8]} (strict=False skips them)" if strict and extra else ""
                ),
                op=op,
            )
        for (name, x), _ in zip(named, leaves, strict=True):
            part = f.get_slice(name)
            shape, dtype = _meta(x)
            got = tuple(part.get_shape())
            if got != shape:
                raise SpmdError(f"{name} has shape {got} in {path}; like has {shape}", op=op)
            if is_sharded(x):
                index = x.index()
                empty = any(i.stop <= i.start for i in index)  # (safetensors refuses those)
                block = np.zeros(0, dtype) if empty else np.asarray(part[index])
                local = np.zeros(x.local_shape, block.dtype)
                if not empty:
                    local[x.valid()] = block
                value: Any = ShardedArray.placed(
                    jax.numpy.asarray(local, dtype), x.shape, x.spec, x.mesh
                )
            else:
                full = np.asarray(part[tuple(slice(None) for _ in shape)]).reshape(shape)
                value = full.astype(dtype) if isinstance(x, np.ndarray | np.generic) else (
                    jax.numpy.asarray(full, dtype))  # fmt: skip
            out.append(value)
    return jax.tree_util.tree_unflatten(structure, out)


# -- Orbax ----------------------------------------------------------------------------------------


def is_orbax(path: Path) -> bool:
    """An Orbax checkpoint directory (rather than spmd's format, which has a manifest.json)."""
    return (
        path.is_dir()
        and not (path / "manifest.json").exists()
        and any((path / n).exists() for n in ("_CHECKPOINT_METADATA", "_METADATA", "_sharding"))
    )


def save_orbax(path: Path, tree: Any, comm: Communicator, op: str) -> None:
    import orbax.checkpoint as ocp

    check_no_blocks(tree, op)
    leaves, structure = jax.tree_util.tree_flatten(tree, is_leaf=is_sharded)
    gathered = []
    for x in leaves:  # one tensor at a time on the ranks other than 0
        full = x.gather() if is_sharded(x) else x
        gathered.append(np.asarray(jax.device_get(full)) if comm.rank == 0 else None)
    error = ""
    if comm.rank == 0:
        try:
            whole = jax.tree_util.tree_unflatten(structure, gathered)
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(path, whole, force=True)
                ckptr.wait_until_finished()
        except Exception as e:
            error = f"orbax failed to write {path}: {type(e).__name__}: {e}"
    failed = comm.broadcast_object(error, root=0)
    if failed:
        raise SpmdError(failed if comm.rank == 0 else f"rank 0 failed: {failed}", op=op)


def load_orbax(path: Path, like: Any, op: str) -> Any:
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as ckptr:
            if like is None:
                return ckptr.restore(path)
            leaves, structure = jax.tree_util.tree_flatten(like, is_leaf=is_sharded)
            target = jax.tree_util.tree_unflatten(
                structure, [jax.ShapeDtypeStruct(*_meta(x)) for x in leaves]
            )
            restored = ckptr.restore(path, target)
    except Exception as e:
        raise SpmdError(f"orbax failed to read {path}: {type(e).__name__}: {e}", op=op) from e
    out: list[Any] = []
    for x, full in zip(leaves, jax.tree_util.tree_leaves(restored), strict=True):
        if is_sharded(x):
            block = np.asarray(full)[x.index()]
            local = np.zeros(x.local_shape, block.dtype)
            local[x.valid()] = block
            out.append(ShardedArray.placed(jax.numpy.asarray(local), x.shape, x.spec, x.mesh))
        elif isinstance(x, np.ndarray | np.generic):
            out.append(np.asarray(full).astype(x.dtype))
        else:
            out.append(full)
    return jax.tree_util.tree_unflatten(structure, out)
