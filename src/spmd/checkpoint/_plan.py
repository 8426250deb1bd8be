"""The write plan: what each leaf of a tree being saved is, which files it becomes, and which
rank of the group writes each, so that every distinct piece of data is written once and the
bytes are spread evenly over the ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError, SpmdTypeError
from ..sharded import ShardedArray, is_sharded
from ._format import Index, savable, volume

SCALARS = {bool: "bool", int: "int", float: "float", complex: "complex"}

# Replicated leaves smaller than this are written by rank 0: spreading them saves less time than
# it costs to open one more file on another rank.
SPREAD_MIN_BYTES = 1 << 20


# -- leaves ---------------------------------------------------------------------------------------


@dataclass
class Leaf:
    """One leaf of a tree being saved: what it is, and (for a shard) which part this rank holds."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    value: Any
    spec: str | None = None
    index: Index | None = None  # this rank's shard of a ShardedArray

    def summary(self) -> tuple[Any, ...]:
        """What the other ranks need to know about this leaf (small and picklable)."""
        return (self.path, self.kind, self.shape, self.dtype.name, self.spec, self.index)

    def data(self) -> np.ndarray[Any, Any]:
        """The bytes to write: the whole array, or (for a shard) the valid part of ``local``."""
        if isinstance(self.value, ShardedArray):
            # only the unpadded part: padding belongs to a layout, not to the data
            local = np.asarray(self.value.local)[self.value.valid()]
            return _native(local)
        return _native(np.asarray(self.value))

    def manifest_entry(self, spec: str | None) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": self.dtype.name,
            "spec": spec,
        }


def _native(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """C-ordered, native byte order (the manifest records the machine's byte order)."""
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    return np.ascontiguousarray(x)


def flatten(tree: Any, op: str) -> tuple[list[Leaf], Any]:
    check_no_blocks(tree, op)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)
    return [_describe(jax.tree_util.keystr(p), x, op) for p, x in with_path], treedef


def _block(x: Any) -> str:
    """What makes ``x`` one rank's block of a framework layer's parameter (spmd.tensor_parallel's
    linen, NNX and Equinox layers), or "" (told by duck typing: this layer is below them)."""
    names = getattr(x, "names", None)
    if type(x).__name__ in ("Partitioned", "FusedPartitioned") and names and any(names):
        return f"a flax Partitioned box split over {tuple(names)}"
    meta = getattr(x, "get_metadata", None)
    if type(x).__module__.startswith("flax") and callable(meta):
        m = meta()
        if isinstance(m, dict) and "tp_axis" in m:
            return f"an nnx.Param split over {m.get('tp_group')!r}"
    if getattr(type(x), "spmd_tp_blocks", False):
        return f"a tensor-parallel {type(x).__name__} layer"
    return ""


def check_no_blocks(tree: Any, op: str) -> None:
    """Refuse a tree that holds the framework layers' blocks as they are: saved as replicated
    leaves, only rank 0's block would be written, silently."""
    found = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_sharded(x) or bool(_block(x))
    )[0]
    for path, x in found:
        what = "" if is_sharded(x) else _block(x)
        if what:
            raise SpmdError(
                f"leaf {jax.tree_util.keystr(path)} is this rank's block of a tensor-parallel "
                f"parameter ({what}): written as a replicated leaf, only one rank's block would "
                "be saved. Pass spmd.tensor_parallel.sharded(params) (ShardedArrays of the dense "
                "layout; spmd.tensor_parallel.unsharded puts a loaded tree back)",
                op=op,
            )


def _describe(path: str, x: Any, op: str) -> Leaf:
    if isinstance(x, ShardedArray):
        dtype = _dtype(x.dtype, path, op)
        if tuple(np.shape(x.local)) != x.local_shape:
            raise SpmdError(
                f"leaf {path} is a ShardedArray of shape {x.shape} and spec {x.spec} whose "
                f"local shard has shape {tuple(np.shape(x.local))}, but that layout gives this "
                f"rank a shard of shape {x.local_shape}; nothing was written",
                op=op,
            )
        index = tuple((s.start, s.stop) for s in x.index())
        return Leaf(path, "sharded", x.shape, dtype, x, str(x.spec), index)
    if isinstance(x, jax.core.Tracer):
        raise SpmdTypeError(
            f"leaf {path} is a tracer ({x}); spmd.save writes concrete values: call it outside "
            "jax.jit / jax.grad, on the step's outputs",
            op=op,
        )
    if isinstance(x, jax.Array):
        return Leaf(path, "jax", tuple(x.shape), _dtype(x.dtype, path, op), x)
    if isinstance(x, np.ndarray | np.generic):
        kind = "numpy" if isinstance(x, np.ndarray) else "numpy_scalar"
        return Leaf(path, kind, tuple(x.shape), _dtype(x.dtype, path, op), x)
    if type(x) in SCALARS:
        arr = np.asarray(x)
        if arr.dtype == object:  # a Python int beyond 64 bits
            raise SpmdError(f"leaf {path} is the int {x}, which does not fit in 64 bits", op=op)
        return Leaf(path, SCALARS[type(x)], (), arr.dtype, x)
    raise SpmdTypeError(
        f"leaf {path} is a {type(x).__name__} ({x!r:.80}); expected a jax or numpy array, a "
        "Python or numpy scalar, or a spmd.ShardedArray. Store other values in metadata= "
        "(JSON) or leave them out of the tree",
        op=op,
    )


def _dtype(dtype: Any, path: str, op: str) -> np.dtype[Any]:
    """The leaf's dtype if its name rebuilds it (numbers, bool, ml_dtypes such as bfloat16)."""
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        raise SpmdTypeError(
            f"leaf {path} is a typed PRNG key array ({dtype}); save jax.random.key_data(key) "
            "and rebuild it with jax.random.wrap_key_data",
            op=op,
        )
    d: np.dtype[Any] = np.dtype(dtype).newbyteorder("=")  # data is written in native order
    if not savable(d):
        raise SpmdTypeError(
            f"leaf {path} has dtype {d}; expected a numeric or bool dtype (including bfloat16 "
            "and the other ml_dtypes types)",
            op=op,
        )
    return d


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class File:
    name: str
    index: Index
    writer: int  # group rank that writes it

    def record(self) -> dict[str, Any]:
        return {"file": self.name, "index": [list(r) for r in self.index]}


@dataclass(frozen=True)
class Planned:
    files: tuple[File, ...]
    spec: str | None


def plan(summaries: list[Any], op: str) -> list[Planned]:
    """Which files each leaf becomes and which rank writes each: the same on every rank, since
    every rank computes it from the same exchanged summaries. Writers are chosen to even out the
    bytes each rank writes: shards first (each among the ranks that hold it), then the large
    replicated leaves (any rank holds them), largest first, each to the least loaded rank."""
    mine = summaries[0]
    for r, other in enumerate(summaries[1:], start=1):
        _check_same_tree(mine, other, r, op)
    load = [0] * len(summaries)

    def least_loaded(candidates: list[int], nbytes: int) -> int:
        r = min(candidates, key=lambda c: (load[c], c))
        load[r] += nbytes
        return r

    planned: list[Planned | None] = [None] * len(mine)
    spread: list[tuple[int, int]] = []  # (bytes, leaf) of the replicated leaves to spread
    for i, (path, kind, shape, dtype, spec, _) in enumerate(mine):
        if kind != "sharded":
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            if nbytes >= SPREAD_MIN_BYTES:
                spread.append((nbytes, i))
            else:
                planned[i] = Planned((File(f"{i:05d}.bin", tuple((0, g) for g in shape), 0),), None)
            continue
        # Ranks whose index() agree hold the same shard. Empty shards (more ranks than rows)
        # hold nothing and get no file.
        holders: dict[Index, list[int]] = {}
        for r, s in enumerate(summaries):
            holders.setdefault(tuple(s[i][5]), []).append(r)
        shards = [(idx, rs) for idx, rs in holders.items() if volume(idx) > 0]
        covered = sum(volume(idx) for idx, _ in shards)
        if covered != math.prod(shape):
            raise SpmdError(
                f"the {len(summaries)} ranks of the group hold {covered} of the "
                f"{math.prod(shape)} elements of the ShardedArray {path} (spec {spec}); save "
                "over a group that holds every shard (group=None: the default communicator)",
                op=op,
            )
        itemsize = np.dtype(dtype).itemsize
        files = tuple(
            File(f"{i:05d}.{k:05d}.bin", idx, least_loaded(rs, volume(idx) * itemsize))
            for k, (idx, rs) in enumerate(sorted(shards, key=lambda t: t[0]))
        )
        planned[i] = Planned(files, spec)
    everyone = list(range(len(summaries)))
    for nbytes, i in sorted(spread, key=lambda t: (-t[0], t[1])):
        full: Index = tuple((0, g) for g in mine[i][2])
        planned[i] = Planned((File(f"{i:05d}.bin", full, least_loaded(everyone, nbytes)),), None)
    return [p for p in planned if p is not None]


def _check_same_tree(mine: list[Any], other: list[Any], r: int, op: str) -> None:
    if len(mine) != len(other):
        raise SpmdError(
            f"rank {r} of the group passes a tree of {len(other)} leaves, rank 0 one of "
            f"{len(mine)}; every rank must save the same tree structure",
            op=op,
        )
    for a, b in zip(mine, other, strict=True):
        # path, sharded or not, shape, dtype, spec (the index differs by design)
        key_a = (a[0], a[1] == "sharded", tuple(a[2]), a[3], a[4])
        key_b = (b[0], b[1] == "sharded", tuple(b[2]), b[3], b[4])
        if key_a != key_b:

            def fmt(k: tuple[Any, ...]) -> str:
                kind = f"ShardedArray (spec {k[4]})" if k[1] else "replicated"
                return f"{k[0]}: {kind}, shape {k[2]}, dtype {k[3]}"

            raise SpmdError(
                f"the trees differ between ranks: rank 0 has {fmt(key_a)}, rank {r} has "
                f"{fmt(key_b)}; every rank must save the same tree structure",
                op=op,
            )
