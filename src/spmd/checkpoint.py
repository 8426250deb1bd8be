"""Checkpoints: sharded, atomic save and load, readable at any world size and in any layout.

Usage::

    spmd.save("ckpt/step-100", {"params": params, "opt_state": opt_state},
              metadata={"step": 100, "sampler": sampler.state_dict()})
    # later, on any number of ranks, in any sharding:
    state = spmd.load("ckpt/step-100", like={"params": params, "opt_state": opt_state})
    step = spmd.checkpoint.metadata("ckpt/step-100")["step"]

Format (version 1)
------------------
A checkpoint is a directory::

    path/
      manifest.json      what the checkpoint holds; written last
      00000.bin          leaf 0, a replicated leaf: one file, the whole array
      00003.00001.bin    leaf 3, shard 1: a sharded leaf has one file per distinct shard

Leaves are numbered in ``jax.tree_util`` flattening order, with every ShardedArray one leaf.
Each ``.bin`` file holds the raw bytes of a C-ordered array (``ndarray.tobytes()``), no header.
``manifest.json`` says how to read them::

    {"format": "spmd.checkpoint", "version": 1, "byteorder": "little", "checksum": "crc32",
     "world_size": 4, "metadata": {...the user's dict...},
     "treedef": "<base64 of pickle.dumps(PyTreeDef)>" or null, "tree": "<str(PyTreeDef)>",
     "leaves": [{"path": "['params']['w1']", "kind": "jax", "shape": [6, 12],
                 "dtype": "float32", "spec": null,
                 "files": [{"file": "00000.bin", "index": [[0, 6], [0, 12]],
                            "bytes": 288, "crc32": 2874310147}]}, ...]}

``path`` is the leaf's ``jax.tree_util.keystr``; ``dtype`` a name ``jnp.dtype`` understands
(``bfloat16`` and the other ml_dtypes types included); ``index`` the ``[start, stop)`` range of
the global array a file covers in each dimension; ``kind`` what the leaf was (``jax``,
``sharded``, ``numpy``, ``numpy_scalar``, ``int``, ``float``, ``bool``, ``complex``), so that a
load without ``like`` gives back the same kind of value; ``spec`` the PartitionSpec of a sharded
leaf, for information (loading does not need it). Shards are stored unpadded: padding is a
property of a layout, not of the data.

Guarantees
----------
- Atomic replacement. All ranks write into a fresh directory ``{path}.tmp-{id}`` beside the
  target and fsync their files; rank 0 then checks that every file arrived, writes the manifest
  last (fsynced), moves an existing checkpoint aside to ``{path}.old-{id}``, renames the new
  directory to ``path`` and only then deletes the old one. A process killed at any point leaves
  either the previous checkpoint at ``path`` or the new one, never a half-written directory
  there. In the instant between the two renames ``path`` is missing: :func:`load` and
  :func:`metadata` then read the newest complete ``{path}.old-*`` (with a warning). Leftover
  ``{path}.tmp-*`` / ``{path}.old-*`` directories of interrupted saves are removed by the next
  successful save to the same path. Run one save to a given path at a time. A ``path`` that
  is a symbolic link is followed: the directory it points to is replaced, the link stays.
- Each distinct piece of data is written once, and the writing is spread over the ranks: each
  distinct shard of a ShardedArray by the least loaded rank that holds it (ranks whose
  ``index()`` agree hold the same shard, e.g. the dp replicas of a tensor-parallel shard), then
  each replicated leaf of 1 MiB or more, largest first, by the rank with the fewest bytes to
  write so far; smaller replicated leaves by rank 0. A data-parallel model's 4 equal layers
  saved on 2 ranks are 2 files per rank, written at the same time.
- Any world size, any layout. The files describe the global array, not who wrote it: a
  checkpoint saved on 4 ranks with ZeRO stage 3 loads on 1, 2 or 3 ranks as full arrays or in
  another sharding (``like=``), and the reverse. Each rank reads only the files its part
  overlaps; ranks exchange nothing but a final "did everyone succeed".
- Integrity. Every file's size and CRC-32 are in the manifest and checked on read: a truncated
  or corrupt file is an error naming the file and the leaf, never silently wrong numbers. CRC-32
  (``zlib.crc32``) is used because it is in the standard library, runs at memory speed, and
  reliably detects what happens to files by accident (bit flips, truncation, a partial copy); it
  is not meant to resist deliberate tampering, which a checksum next to the data cannot anyway.
- Errors are :class:`spmd.SpmdError`, raised on every rank of the group, naming the rank.

Trust: a load without ``like`` unpickles the saved tree structure (``treedef``), which, like
``pickle`` and ``torch.load``, can run code: load only checkpoints you trust that way. With
``like=`` nothing is unpickled (the structure comes from ``like``). When the structure cannot be
pickled at save time (a custom pytree node whose auxiliary data does not pickle), the manifest
stores ``"treedef": null`` and loading needs ``like=``.

All ranks must see the same file system at ``path`` (a shared one across nodes); rank 0 checks
that every rank's files arrived before it writes the manifest.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import re
import shutil
import sys
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import SpmdError, SpmdTypeError
from .runtime import Communicator, this_rank
from .sharded import ShardedArray, is_sharded

__all__ = ["FORMAT", "VERSION", "load", "metadata", "save"]

FORMAT = "spmd.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"

Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension of the global array
PathLike = str | os.PathLike[str]


# -- API ------------------------------------------------------------------------------------------


def save(
    path: PathLike,
    tree: Any,
    *,
    metadata: dict[str, Any] | None = None,
    group: Any = None,
) -> None:
    """Write ``tree`` to the checkpoint directory ``path``, replacing what is there atomically.

    A collective over ``group`` (default: the default communicator): every rank calls it with a
    tree of the same structure, shapes and dtypes.

    Args:
        path: the checkpoint directory. If it exists it must be a checkpoint (or empty); it is
            replaced only once the new checkpoint is complete.
        tree: a pytree whose leaves are replicated arrays (jax or numpy; the same on every rank:
            each is written by one rank, rank 0 for small ones), Python or numpy scalars, or
            :class:`spmd.ShardedArray` (each distinct shard written once, without its padding).
        metadata: a JSON-serialisable dict with string keys, e.g.
            ``{"step": 10, "sampler": sampler.state_dict()}``; read it back with
            :func:`metadata`. Tuples come back as lists, as JSON has only lists.
        group: the ranks that save together (None: the default communicator; a Communicator;
            or an axis name of the active mesh); they must hold every shard of every
            ShardedArray in ``tree``.

    Raises:
        SpmdTypeError: a leaf that is not an array, a scalar or a ShardedArray (naming its path).
        SpmdError: metadata that JSON cannot hold, ranks whose trees differ, shards that the
            group does not cover, ``path`` that is not a checkpoint, or a failed write. Checks
            happen before anything is written; every rank raises.
    """
    comm = _communicator(group)
    target = _target(path)
    me = this_rank()
    where = f"{me}: spmd.save({str(path)!r})"

    # 1. Local checks, then one exchange: each rank's problem (if any), the description of its
    #    tree, and rank 0's id for the temporary directory. Nothing is written before every rank
    #    knows that every rank is fine, so bad input leaves no trace on disk.
    own: BaseException | None = None
    leaves: list[_Leaf] = []
    summary: list[tuple[Any, ...]] | None = None
    treedef_b64: str | None = None
    treedef_str = ""
    meta: dict[str, Any] = {}
    try:
        leaves, treedef = _flatten(tree, where)
        summary = [leaf.summary() for leaf in leaves]
        meta = _check_metadata(metadata, where)
        if comm.rank == 0:
            _check_target(target, where)
            treedef_b64, treedef_str = _pickle_treedef(treedef), str(treedef)
    except Exception as e:
        own = e
    token = uuid.uuid4().hex if comm.rank == 0 else None
    everyone = _agree(comm, own, (summary, token, str(target)), where, "save")
    summaries = [s for s, _, _ in everyone]
    token = everyone[0][1]
    targets = [t for _, _, t in everyone]
    if len(set(targets)) > 1:
        listed = ", ".join(f"rank {comm.ranks[r]}: {t}" for r, t in enumerate(targets))
        raise SpmdError(
            f"{where}: the ranks passed different paths ({listed}); save is collective and "
            "writes one checkpoint, so every rank must pass the same path (compute it on one "
            "rank and share it, e.g. path = comm.broadcast_object(path)). Nothing was written."
        )
    plan = _plan(summaries, where)

    # 2. Every rank writes its files into the temporary directory and fsyncs them.
    tmp = Path(f"{target}.tmp-{token}")
    written: list[tuple[int, dict[str, Any]]] = []
    own = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)  # every rank: no barrier needed before writing
        for i, leaf in enumerate(leaves):
            for f in plan[i].files:
                if f.writer == comm.rank:
                    written.append((i, {**f.record(), **_write(tmp / f.name, leaf.data())}))
    except Exception as e:  # disk full, permissions, a leaf that will not convert...
        own = SpmdError(f"{where}: writing {tmp} failed: {type(e).__name__}: {e}")
        own.__cause__ = e
    # The exchange is also the barrier: when it returns, every rank's files are on disk.
    try:
        results = _agree(comm, own, written, where, "save")
    except SpmdError:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # 3. Rank 0 checks the files, writes the manifest last and swaps the directories.
    outcome: str | None = None
    if comm.rank == 0:
        try:
            records: dict[int, list[dict[str, Any]]] = {}
            for files in results:
                for i, rec in files:
                    records.setdefault(i, []).append(rec)
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "byteorder": sys.byteorder,
                "checksum": "crc32",
                "world_size": comm.size,
                "metadata": meta,
                "treedef": treedef_b64,
                "tree": treedef_str,
                "leaves": [
                    {
                        **leaf.manifest_entry(plan[i].spec),
                        "files": sorted(records.get(i, []), key=lambda r: r["file"]),
                    }
                    for i, leaf in enumerate(leaves)
                ],
            }
            _check_arrived(tmp, manifest, where)
            _write_manifest(tmp, manifest)
            _commit(tmp, target, token)
        except Exception as e:
            outcome = f"{where}: committing the checkpoint failed: {type(e).__name__}: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
    # Nobody returns before the checkpoint is in place (or everyone raises).
    outcome = comm.broadcast_object(outcome, root=0)
    if outcome is not None:
        raise SpmdError(outcome if comm.rank == 0 else f"{me}: rank 0 failed: {outcome}")


def load(path: PathLike, like: Any = None, *, group: Any = None) -> Any:
    """Read the checkpoint at ``path``, at any world size and in any layout.

    Args:
        path: a directory written by :func:`save`. If it is missing but a complete
            ``{path}.old-*`` exists (a save was interrupted between its two renames), the
            newest of those is read, with a warning.
        like: None, or a pytree of the saved structure whose leaves say what to return:

            - a :class:`spmd.ShardedArray`: a ShardedArray with the same spec and mesh, holding
              this rank's part of the saved array (only the files it overlaps are read);
            - a jax array or ``jax.ShapeDtypeStruct``: the full array, as a jax array;
            - a numpy array, numpy scalar or Python scalar: the same kind of value.

            Global shapes and dtypes must match the saved ones. Without ``like`` the structure
            is unpickled from the checkpoint and every leaf comes back as the kind it was saved
            as: jax arrays and ShardedArrays as full jax arrays (shards reassembled), numpy
            arrays and scalars as numpy, Python scalars as Python scalars. (A dtype this
            process's jax cannot hold, such as float64 without ``jax_enable_x64``, comes back as
            a numpy array rather than silently narrowed.)
        group: the ranks that load together (default: the default communicator). Ranks read
            independently; the group only agrees at the end on success, so that an error any
            rank meets (a corrupt shard only it reads) is raised on every rank.

    Raises:
        SpmdError: no checkpoint at ``path``, no manifest, an unknown format version, a missing,
            truncated or corrupt file (named, with its leaf), or a ``like`` whose structure,
            shapes or dtypes differ from the saved ones (naming the leaf).
    """
    comm = _communicator(group)
    where = f"{this_rank()}: spmd.load({str(path)!r})"
    own: BaseException | None = None
    result: Any = None
    try:
        result = _load(_target(path), like, where)
    except Exception as e:
        own = e
    _agree(comm, own, None, where, "load")
    return result


def metadata(path: PathLike) -> dict[str, Any]:
    """The ``metadata`` dict saved with the checkpoint at ``path`` (``{}`` if none was given).

    Reads only the manifest; not a collective. Falls back to ``{path}.old-*`` as :func:`load`.
    """
    where = f"{this_rank()}: spmd.checkpoint.metadata({str(path)!r})"
    directory = _resolve(_target(path), where, stacklevel=3)
    meta = _read_manifest(directory, where).get("metadata") or {}
    return dict(meta)


# -- leaves ---------------------------------------------------------------------------------------

_SCALARS = {bool: "bool", int: "int", float: "float", complex: "complex"}


@dataclass
class _Leaf:
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


def _flatten(tree: Any, where: str) -> tuple[list[_Leaf], Any]:
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)
    return [_describe(jax.tree_util.keystr(p), x, where) for p, x in with_path], treedef


def _describe(path: str, x: Any, where: str) -> _Leaf:
    if isinstance(x, ShardedArray):
        dtype = _dtype(x.dtype, path, where)
        if tuple(np.shape(x.local)) != x.local_shape:
            raise SpmdError(
                f"{where}: leaf {path} is a ShardedArray of shape {x.shape} and spec {x.spec} "
                f"whose local shard has shape {tuple(np.shape(x.local))}, but that layout gives "
                f"this rank a shard of shape {x.local_shape}; nothing was written"
            )
        index = tuple((s.start, s.stop) for s in x.index())
        return _Leaf(path, "sharded", x.shape, dtype, x, str(x.spec), index)
    if isinstance(x, jax.core.Tracer):
        raise SpmdTypeError(
            f"{where}: leaf {path} is a tracer ({x}); spmd.save writes concrete values: call it "
            "outside jax.jit / jax.grad, on the step's outputs"
        )
    if isinstance(x, jax.Array):
        return _Leaf(path, "jax", tuple(x.shape), _dtype(x.dtype, path, where), x)
    if isinstance(x, np.ndarray | np.generic):
        kind = "numpy" if isinstance(x, np.ndarray) else "numpy_scalar"
        return _Leaf(path, kind, tuple(x.shape), _dtype(x.dtype, path, where), x)
    if type(x) in _SCALARS:
        arr = np.asarray(x)
        if arr.dtype == object:  # a Python int beyond 64 bits
            raise SpmdError(f"{where}: leaf {path} is the int {x}, which does not fit in 64 bits")
        return _Leaf(path, _SCALARS[type(x)], (), arr.dtype, x)
    raise SpmdTypeError(
        f"{where}: leaf {path} is a {type(x).__name__} ({x!r:.80}); expected a jax or numpy "
        "array, a Python or numpy scalar, or a spmd.ShardedArray. Store other values in "
        "metadata= (JSON) or leave them out of the tree"
    )


def _dtype(dtype: Any, path: str, where: str) -> np.dtype[Any]:
    """The leaf's dtype if its name rebuilds it (numbers, bool, ml_dtypes such as bfloat16)."""
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        raise SpmdTypeError(
            f"{where}: leaf {path} is a typed PRNG key array ({dtype}); save "
            "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data"
        )
    d: np.dtype[Any] = np.dtype(dtype).newbyteorder("=")  # data is written in native order
    try:
        ok = d.kind in "biufcV" and d.names is None and jnp.dtype(d.name) == d
    except TypeError:
        ok = False
    if not ok:
        raise SpmdTypeError(
            f"{where}: leaf {path} has dtype {d}; expected a numeric or bool dtype (including "
            "bfloat16 and the other ml_dtypes types)"
        )
    return d


def _check_metadata(meta: Any, where: str) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise SpmdTypeError(
            f"{where}: metadata is a {type(meta).__name__}; expected a dict (JSON object) or None"
        )
    problem = _json_problem(meta, "metadata")
    if problem is None:
        try:
            json.dumps(meta)
        except (TypeError, ValueError, RecursionError) as e:
            problem = f"metadata does not convert to JSON ({e})"
    if problem is not None:
        raise SpmdError(
            f"{where}: {problem}; metadata must be JSON: dicts with string keys, lists, str, "
            "int, float, bool, None (convert numpy scalars with int() or float(), arrays with "
            ".tolist(), or save arrays in the tree instead). Nothing was written"
        )
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


def _pickle_treedef(treedef: Any) -> str | None:
    try:
        return base64.b64encode(pickle.dumps(treedef)).decode("ascii")
    except Exception:
        # A custom node whose auxiliary data does not pickle: the checkpoint is still complete,
        # but loading it needs like= to give the structure (documented in the module).
        return None


# -- the save plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _File:
    name: str
    index: Index
    writer: int  # group rank that writes it

    def record(self) -> dict[str, Any]:
        return {"file": self.name, "index": [list(r) for r in self.index]}


@dataclass(frozen=True)
class _Planned:
    files: tuple[_File, ...]
    spec: str | None


# Replicated leaves smaller than this are written by rank 0: spreading them saves less time than
# it costs to open one more file on another rank.
SPREAD_MIN_BYTES = 1 << 20


def _plan(summaries: list[Any], where: str) -> list[_Planned]:
    """Which files each leaf becomes and which rank writes each: the same on every rank, since
    every rank computes it from the same exchanged summaries. Writers are chosen to even out the
    bytes each rank writes: shards first (each among the ranks that hold it), then the large
    replicated leaves (any rank holds them), largest first, each to the least loaded rank."""
    mine = summaries[0]
    for r, other in enumerate(summaries[1:], start=1):
        _check_same_tree(mine, other, r, where)
    load = [0] * len(summaries)

    def least_loaded(candidates: list[int], nbytes: int) -> int:
        r = min(candidates, key=lambda c: (load[c], c))
        load[r] += nbytes
        return r

    plan: list[_Planned | None] = [None] * len(mine)
    spread: list[tuple[int, int]] = []  # (bytes, leaf) of the replicated leaves to spread
    for i, (path, kind, shape, dtype, spec, _) in enumerate(mine):
        if kind != "sharded":
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            if nbytes >= SPREAD_MIN_BYTES:
                spread.append((nbytes, i))
            else:
                plan[i] = _Planned((_File(f"{i:05d}.bin", tuple((0, g) for g in shape), 0),), None)
            continue
        # Ranks whose index() agree hold the same shard. Empty shards (more ranks than rows)
        # hold nothing and get no file.
        holders: dict[Index, list[int]] = {}
        for r, s in enumerate(summaries):
            holders.setdefault(tuple(s[i][5]), []).append(r)
        shards = [(idx, rs) for idx, rs in holders.items() if _volume(idx) > 0]
        covered = sum(_volume(idx) for idx, _ in shards)
        if covered != math.prod(shape):
            raise SpmdError(
                f"{where}: the {len(summaries)} ranks of the group hold {covered} of the "
                f"{math.prod(shape)} elements of the ShardedArray {path} (spec {spec}); save "
                "over a group that holds every shard (group=None: the default communicator)"
            )
        itemsize = np.dtype(dtype).itemsize
        files = tuple(
            _File(f"{i:05d}.{k:05d}.bin", idx, least_loaded(rs, _volume(idx) * itemsize))
            for k, (idx, rs) in enumerate(sorted(shards, key=lambda t: t[0]))
        )
        plan[i] = _Planned(files, spec)
    everyone = list(range(len(summaries)))
    for nbytes, i in sorted(spread, key=lambda t: (-t[0], t[1])):
        full: Index = tuple((0, g) for g in mine[i][2])
        plan[i] = _Planned((_File(f"{i:05d}.bin", full, least_loaded(everyone, nbytes)),), None)
    return [p for p in plan if p is not None]


def _check_same_tree(mine: list[Any], other: list[Any], r: int, where: str) -> None:
    if len(mine) != len(other):
        raise SpmdError(
            f"{where}: rank {r} of the group passes a tree of {len(other)} leaves, rank 0 one "
            f"of {len(mine)}; every rank must save the same tree structure"
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
                f"{where}: the trees differ between ranks: rank 0 has {fmt(key_a)}, rank {r} "
                f"has {fmt(key_b)}; every rank must save the same tree structure"
            )


def _volume(index: Index) -> int:
    return math.prod(max(0, b - a) for a, b in index)


# -- writing --------------------------------------------------------------------------------------


def _write(path: Path, data: np.ndarray[Any, Any]) -> dict[str, Any]:
    """Write an array's bytes and fsync them; returns its size and checksum."""
    # A byte view of the array: no copy of what may be hundreds of megabytes.
    raw = data.reshape(-1).view(np.uint8)
    with open(path, "xb") as f:
        f.write(raw.data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": int(raw.size), "crc32": zlib.crc32(raw.data)}


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    with open(directory / MANIFEST, "x", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    # Make the directory's entries (every rank's files and the manifest) durable before the
    # rename publishes it.
    _fsync_dir(directory)


def _check_arrived(directory: Path, manifest: dict[str, Any], where: str) -> None:
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
                    f"{where}: rank 0 does not see {p} {seen}; every rank must write to the "
                    "same (shared) file system"
                )


def _commit(tmp: Path, target: Path, token: str) -> None:
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
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # What interrupted saves left behind is obsolete now that target is complete.
    for sibling in _siblings(target, ".tmp-") + _siblings(target, ".old-"):
        shutil.rmtree(sibling, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
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


def _siblings(target: Path, infix: str) -> list[Path]:
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


def _check_target(target: Path, where: str) -> None:
    # Replacing whatever sits at path would delete it: only a checkpoint (or an empty directory)
    # may be replaced.
    if not os.path.lexists(target):
        return
    if target.is_dir() and ((target / MANIFEST).exists() or not any(target.iterdir())):
        return
    what = "a directory without manifest.json" if target.is_dir() else "a file"
    raise SpmdError(
        f"{where}: {target} exists and is {what}, not an spmd checkpoint; refusing to replace "
        "it. Choose another path or remove it. Nothing was written"
    )


# -- reading --------------------------------------------------------------------------------------


def _load(target: Path, like: Any, where: str) -> Any:
    directory = _resolve(target, where, stacklevel=4)
    manifest = _read_manifest(directory, where)
    entries = manifest["leaves"]
    swap = manifest.get("byteorder", sys.byteorder) != sys.byteorder
    reader = _Reader(directory, swap, where)
    if like is None:
        treedef = _unpickle_treedef(manifest, where)
        if treedef.num_leaves != len(entries):
            raise SpmdError(
                f"{where}: the manifest lists {len(entries)} leaves but its tree structure has "
                f"{treedef.num_leaves}; the manifest is corrupt"
            )
        values = [_restore(e, reader.full(e), e["kind"]) for e in entries]
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
            f"{where}: like= has another structure than the checkpoint: like has "
            f"{len(like_paths)} leaves, the checkpoint {len(saved_paths)}; leaf {k} is "
            f"{like_k} in like but {saved_k} in the checkpoint"
        )
    values = []
    for e, (_, want) in zip(entries, with_path, strict=True):
        values.append(_into(e, want, reader, where))
    return jax.tree_util.tree_unflatten(like_def, values)


def _resolve(target: Path, where: str, stacklevel: int) -> Path:
    if target.is_dir():
        return target
    if os.path.lexists(target):
        raise SpmdError(f"{where}: {target} is a file, not a checkpoint directory")
    # A save interrupted between its two renames leaves the previous checkpoint here.
    complete = [p for p in _siblings(target, ".old-") if (p / MANIFEST).is_file()]
    if complete:
        newest = max(complete, key=lambda p: (p / MANIFEST).stat().st_mtime_ns)
        warnings.warn(
            f"{where}: {target} is missing; reading {newest.name}, the checkpoint a save that "
            "was interrupted had moved aside",
            stacklevel=stacklevel,  # the warning points at the caller of load / metadata
        )
        return newest
    raise SpmdError(
        f"{where}: no checkpoint at {target}: the directory does not exist (and there is no "
        f"complete {target.name}.old-* to fall back on)"
    )


def _read_manifest(directory: Path, where: str) -> dict[str, Any]:
    p = directory / MANIFEST
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpmdError(
            f"{where}: {directory} has no {MANIFEST}, so it is not a complete spmd checkpoint "
            "(save writes the manifest last; an interrupted save never leaves its directory "
            "at the checkpoint's path)"
        ) from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise SpmdError(f"{where}: {p} is not valid JSON ({e}); the manifest is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise SpmdError(
            f"{where}: {p} has format {got!r}, expected {FORMAT!r}: not an spmd checkpoint"
        )
    version = manifest.get("version")
    if version != VERSION:
        raise SpmdError(
            f"{where}: {p} has format version {version!r}; this spmd reads version {VERSION}. "
            "Load it with the spmd version that wrote it"
        )
    return manifest


def _unpickle_treedef(manifest: dict[str, Any], where: str) -> Any:
    data = manifest.get("treedef")
    if data is None:
        raise SpmdError(
            f"{where}: the checkpoint's tree structure ({manifest.get('tree', '?')}) could not "
            "be pickled when it was saved; pass like= (a tree of the same structure) to load it"
        )
    try:
        return pickle.loads(base64.b64decode(data))
    except Exception as e:
        raise SpmdError(
            f"{where}: the checkpoint's tree structure ({manifest.get('tree', '?')}) does not "
            f"unpickle here ({type(e).__name__}: {e}); import the modules that define its node "
            "types, or pass like= (a tree of the same structure)"
        ) from None


class _Reader:
    """Reads (parts of) saved leaves from their files, checking every file's size and CRC."""

    def __init__(self, directory: Path, swap: bool, where: str) -> None:
        self.directory = directory
        self.swap = swap
        self.where = where

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
            if _volume(overlap) == 0:
                continue  # not a part this rank needs (zero-size leaves need no file at all)
            data = self.read(entry, rec, dtype, tuple(b - a for a, b in index))
            src = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(overlap, index, strict=True))
            dst = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(overlap, region, strict=True))
            out[dst] = data[src]
            filled += _volume(overlap)
        if filled != _volume(region):
            raise SpmdError(
                f"{self.where}: the files of leaf {entry['path']} cover {filled} of the "
                f"{_volume(region)} elements this rank needs; the manifest is corrupt"
            )

    def read(
        self, entry: dict[str, Any], rec: dict[str, Any], dtype: Any, shape: tuple[int, ...]
    ) -> np.ndarray[Any, Any]:
        p = self.directory / rec["file"]
        expected = int(rec["bytes"])
        if expected != math.prod(shape) * dtype.itemsize:
            raise SpmdError(
                f"{self.where}: the manifest gives {p.name} of leaf {entry['path']} {expected} "
                f"bytes, but a {dtype.name} block of shape {shape} has "
                f"{math.prod(shape) * dtype.itemsize}; the manifest is corrupt"
            )
        try:
            with open(p, "rb") as f:
                data = f.read(expected + 1)  # one more: a file that grew is wrong too
        except FileNotFoundError:
            raise SpmdError(
                f"{self.where}: the file {p.name} of leaf {entry['path']} is missing from "
                f"{self.directory}; the checkpoint is incomplete"
            ) from None
        if len(data) != expected:
            how = "truncated" if len(data) < expected else "longer than saved"
            raise SpmdError(
                f"{self.where}: the file {p.name} of leaf {entry['path']} is {how}: it has "
                f"{os.path.getsize(p)} bytes, expected {expected}"
            )
        crc = zlib.crc32(data)
        if crc != rec["crc32"]:
            raise SpmdError(
                f"{self.where}: the file {p.name} of leaf {entry['path']} is corrupt: its CRC-32 "
                f"is {crc:#010x}, the manifest expects {rec['crc32']:#010x}"
            )
        arr = np.frombuffer(data, dtype).reshape(shape)
        return arr.byteswap() if self.swap else arr


def _restore(entry: dict[str, Any], arr: np.ndarray[Any, Any], kind: str) -> Any:
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


def _into(entry: dict[str, Any], want: Any, reader: _Reader, where: str) -> Any:
    """The saved leaf ``entry`` in the form the ``like`` leaf ``want`` asks for."""
    path = entry["path"]
    saved_shape = tuple(entry["shape"])
    saved_dtype = jnp.dtype(entry["dtype"])
    if isinstance(want, ShardedArray | jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
        shape, dtype = tuple(want.shape), np.dtype(want.dtype)
    elif type(want) in _SCALARS:
        shape, dtype = (), np.asarray(want).dtype
    else:
        raise SpmdTypeError(
            f"{where}: like{path} is a {type(want).__name__}; expected a spmd.ShardedArray, a jax "
            "or numpy array, a jax.ShapeDtypeStruct or a scalar saying how to return the leaf"
        )
    if shape != saved_shape or np.dtype(dtype).newbyteorder("=") != saved_dtype:
        raise SpmdError(
            f"{where}: leaf {path} was saved with shape {saved_shape} and dtype "
            f"{saved_dtype.name}, but like= expects shape {shape} and dtype {dtype.name}"
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


# -- helpers --------------------------------------------------------------------------------------


def _communicator(group: Any) -> Communicator:
    """The group that saves or loads together: the collectives' own resolution (None: the
    default communicator; a Communicator; or an axis name of the active mesh)."""
    from .mesh import resolve_group

    return resolve_group(None, group, op="spmd.checkpoint")


def _target(path: Any) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise SpmdTypeError(
            f"{this_rank()}: path={path!r} is a {type(path).__name__}; expected a str or "
            "os.PathLike naming the checkpoint directory"
        )
    # Absolute, without a trailing slash: the siblings path.tmp-* / path.old-* sit beside it.
    # Symbolic links are followed (as open() does): saving to a link such as latest -> step-9
    # replaces step-9 and keeps the link, instead of replacing the link with a directory.
    return Path(os.path.realpath(os.fspath(path)))


def _agree(
    comm: Communicator, own: BaseException | None, payload: Any, where: str, op: str
) -> list[Any]:
    """Exchange every rank's outcome and ``payload``; raise on every rank if any rank failed.

    A rank that failed raises its own error (its message names it); the others raise an error
    that quotes the first failing rank's message, so that no rank goes on to a collective that
    the failed ones will never join.
    """
    if own is not None and not isinstance(own, SpmdError):
        wrapped = SpmdError(f"{where}: {type(own).__name__}: {own}")
        wrapped.__cause__ = own
        own = wrapped
    message = None if own is None else str(own)
    try:
        gathered = (
            comm.allgather_object((message, payload)) if comm.size > 1 else [(message, payload)]
        )
    except SpmdError as e:  # a rank slower than SPMD_TIMEOUT (writing, reading) or gone
        raise SpmdError(
            f"{where}: {e} The ranks wait for each other while they read or write their files "
            "(each writes its share): on slow storage, raise SPMD_TIMEOUT."
        ) from None
    if own is not None:
        raise own
    first = next((m for m, _ in gathered if m is not None), None)
    if first is not None:
        raise SpmdError(f"{where}: failed because another rank did: {first}")
    return [p for _, p in gathered]
