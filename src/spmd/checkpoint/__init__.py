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
     "structure": <the tree's structure as data> or null,
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

Trust: nothing in a checkpoint runs code or reads outside it, unless asked. The manifest is
checked against the format before anything is read through it (types, shapes, index ranges, an
allow-list of dtypes, and file names of the pattern above, so that no name leads outside the
directory); data files are read without following symbolic links. A tree of dicts, lists,
tuples, None and namedtuples is described as data (``"structure"``: ``{"dict": [[key, sub],
...]}``, ``{"list": [...]}``, ``{"tuple": [...]}``, ``{"namedtuple": [module, name, [...]]}``,
``null``, ``"*"`` for a leaf) and rebuilt from it; a namedtuple (optax's states) is looked up in
a module the program has imported already, or in optax, flax, equinox, haiku, jax or spmd;
no other module is imported by the load. Other node types (custom
pytree nodes) are stored as a pickled ``treedef``, which ``load`` without ``like`` unpickles
only with ``trust=True``: unpickling, as ``pickle`` and ``torch.load``, runs whatever code the
pickle names. With ``like=`` nothing is unpickled (the structure comes from ``like``). When such
a structure cannot be pickled at save time (a custom node whose auxiliary data does not pickle),
the manifest stores ``"treedef": null`` and loading needs ``like=``. A checkpoint's directory is
created mode 0700 and its files 0600: readable by their owner alone (``chmod -R g+rX`` to share
one).

All ranks must see the same file system at ``path`` (a shared one across nodes); rank 0 checks
that every rank's files arrived before it writes the manifest.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .._errors import SpmdError, SpmdTypeError, prefix
from ..runtime import Communicator
from ..sharded import is_sharded
from ._format import (
    FORMAT,
    VERSION,
    check_metadata,
    describe_structure,
    pickle_treedef,
    read_manifest,
    write_manifest,
)
from ._plan import Leaf, flatten, plan
from ._read import load_tree, resolve
from ._write import check_arrived, check_target, commit, write_file

__all__ = ["FORMAT", "VERSION", "load", "load_safetensors", "metadata", "save", "save_safetensors"]

PathLike = str | os.PathLike[str]
T = TypeVar("T")

DIFFERENT_PATHS = (
    "the ranks passed different paths ({listed}); save is collective and writes one "
    "checkpoint, so every rank must pass the same path (compute it on one rank and share it, "
    "e.g. path = comm.broadcast_object(path)). Nothing was written."
)

TIMED_OUT = (
    "{error} The ranks wait for each other while they read or write their files (each writes "
    "its share): on slow storage, raise SPMD_TIMEOUT."
)


# -- API ------------------------------------------------------------------------------------------


def save(
    path: PathLike,
    tree: Any,
    *,
    metadata: dict[str, Any] | None = None,
    group: Any = None,
    format: str = "spmd",
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
        format: ``"spmd"`` (this format) or ``"orbax"``: an Orbax checkpoint of the full arrays
            (ShardedArrays gathered), which ``orbax.checkpoint.StandardCheckpointer().restore``
            reads in a one-process JAX program; rank 0 gathers the tree and Orbax writes it
            (``metadata`` is not stored). :func:`load` reads both.

    Raises:
        SpmdTypeError: a leaf that is not an array, a scalar or a ShardedArray (naming its path).
        SpmdError: metadata that JSON cannot hold, ranks whose trees differ, shards that the
            group does not cover, ``path`` that is not a checkpoint, or a failed write. Checks
            happen before anything is written; every rank raises.
    """
    comm = _communicator(group)
    target = _target(path)
    op = f"spmd.save({str(path)!r})"
    if format == "orbax":
        from ._external import save_orbax

        if metadata is not None:
            raise SpmdError(
                "metadata= is not stored in an Orbax checkpoint; save it beside the checkpoint "
                "(a JSON file), or use format='spmd'",
                op=op,
            )

        save_orbax(target, tree, comm, op)
        return
    if format != "spmd":
        raise SpmdError(f"format={format!r}; expected 'spmd' or 'orbax'", op=op)

    # 1. Local checks, then one exchange: each rank's description of its tree, and rank 0's id
    #    for the temporary directory. Nothing is written before every rank knows that every
    #    rank is fine, so bad input leaves no trace on disk.
    token = uuid.uuid4().hex if comm.rank == 0 else ""
    local: list[tuple[list[Leaf], dict[str, Any], Any, str | None, str]] = []

    def check() -> tuple[list[tuple[Any, ...]], str, str]:
        leaves, treedef = flatten(tree, op)
        meta = check_metadata(metadata, op)
        structure, treedef_b64, treedef_str = None, None, ""
        if comm.rank == 0:
            check_target(target, op)
            # The structure as data where it can be; a pickle only for other node types.
            structure = describe_structure(tree, is_sharded)
            if structure is None:
                treedef_b64 = pickle_treedef(treedef)
            treedef_str = str(treedef)
        local.append((leaves, meta, structure, treedef_b64, treedef_str))
        return [leaf.summary() for leaf in leaves], token, str(target)

    everyone = _agree(comm, op, check)
    leaves, meta, structure, treedef_b64, treedef_str = local[0]
    summaries = [s for s, _, _ in everyone]
    token = everyone[0][1]
    targets = [t for _, _, t in everyone]
    if len(set(targets)) > 1:
        listed = ", ".join(f"rank {comm.ranks[r]}: {t}" for r, t in enumerate(targets))
        raise SpmdError(DIFFERENT_PATHS.format(listed=listed), op=op)
    layout = plan(summaries, op)

    # 2. Every rank writes its files into the temporary directory and fsyncs them.
    tmp = Path(f"{target}.tmp-{token}")

    def write() -> list[tuple[int, dict[str, Any]]]:
        written = []
        try:
            # Every rank (no barrier needed before writing); the job's user's alone.
            tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
            for i, leaf in enumerate(leaves):
                for f in layout[i].files:
                    if f.writer == comm.rank:
                        written.append((i, {**f.record(), **write_file(tmp / f.name, leaf.data())}))
        except Exception as e:  # disk full, permissions, a leaf that will not convert...
            raise SpmdError(f"writing {tmp} failed: {type(e).__name__}: {e}", op=op) from e
        return written

    # The exchange is also the barrier: when it returns, every rank's files are on disk.
    try:
        results = _agree(comm, op, write)
    except SpmdError:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # 3. Rank 0 checks the files, writes the manifest last and swaps the directories.
    outcome: SpmdError | None = None
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
                "structure": structure,
                "treedef": treedef_b64,
                "tree": treedef_str,
                "leaves": [
                    {
                        **leaf.manifest_entry(layout[i].spec),
                        "files": sorted(records.get(i, []), key=lambda r: r["file"]),
                    }
                    for i, leaf in enumerate(leaves)
                ],
            }
            check_arrived(tmp, manifest, op)
            write_manifest(tmp, manifest)
            commit(tmp, target, token)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            outcome = SpmdError(f"committing the checkpoint failed: {why}", op=op)
            shutil.rmtree(tmp, ignore_errors=True)
    # Nobody returns before the checkpoint is in place (or everyone raises).
    failed = comm.broadcast_object(None if outcome is None else str(outcome), root=0)
    if outcome is not None:
        raise outcome
    if failed is not None:
        raise SpmdError(f"rank 0 failed: {failed}")


def load(path: PathLike, like: Any = None, *, group: Any = None, trust: bool = False) -> Any:
    """Read the checkpoint at ``path``, at any world size and in any layout.

    Args:
        path: a directory written by :func:`save` (in either format), or an Orbax checkpoint
            of a one-process program (``orbax.checkpoint.StandardCheckpointer``; read by
            Orbax, the full arrays on every rank, then each rank keeps its blocks of
            ShardedArrays in ``like``). If it is missing but a complete
            ``{path}.old-*`` exists (a save was interrupted between its two renames), the
            newest of those is read, with a warning.
        like: None, or a pytree of the saved structure whose leaves say what to return:

            - a :class:`spmd.ShardedArray`: a ShardedArray with the same spec and mesh, holding
              this rank's part of the saved array (only the files it overlaps are read);
            - a jax array or ``jax.ShapeDtypeStruct``: the full array, as a jax array;
            - a numpy array, numpy scalar or Python scalar: the same kind of value.

            Global shapes and dtypes must match the saved ones. Without ``like`` the structure
            is rebuilt from the manifest (see ``trust``) and every leaf comes back as the kind
            it was saved as: jax arrays and ShardedArrays as full jax arrays (shards
            reassembled), numpy arrays and scalars as numpy, Python scalars as Python scalars.
            (A dtype this process's jax cannot hold, such as float64 without
            ``jax_enable_x64``, comes back as a numpy array rather than silently narrowed.)
        group: the ranks that load together (default: the default communicator). Ranks read
            independently; the group only agrees at the end on success, so that an error any
            rank meets (a corrupt shard only it reads) is raised on every rank.
        trust: only for a load without ``like`` of a tree with other node types than dict, list,
            tuple, None and namedtuples (custom pytree nodes), whose structure only the pickle
            in the manifest can rebuild: unpickling runs whatever code the pickle names, so it
            happens only with ``trust=True``, for a checkpoint that nobody but people you trust
            could have written.

    Raises:
        SpmdError: no checkpoint at ``path``, no manifest, an unknown format version, a missing,
            truncated or corrupt file (named, with its leaf), or a ``like`` whose structure,
            shapes or dtypes differ from the saved ones (naming the leaf).
    """
    comm = _communicator(group)
    op = f"spmd.load({str(path)!r})"
    result: list[Any] = []

    def read() -> None:  # the tree stays on this rank: only the outcome is exchanged
        from ._external import is_orbax, load_orbax

        if is_orbax(_target(path)):
            result.append(load_orbax(_target(path), like, op))
            return
        # A fallback to {path}.old-* warns at load's caller, 8 frames up: resolve, load_tree,
        # this step, _agree's wrapper of it, Communicator.agree, _agree, load.
        result.append(load_tree(_target(path), like, op, stacklevel=8, trust=trust))

    _agree(comm, op, read)
    return result[0]


def save_safetensors(path: PathLike, tree: Any, *, group: Any = None) -> None:
    """Write ``tree`` as one safetensors file: one tensor per leaf, the full array (ShardedArrays
    gathered), named by its path with the keys joined by dots as Hugging Face names weights
    (``{"params": {"dense": {"w": ..}}}`` -> ``params.dense.w``; list and tuple positions as
    numbers). Collective over ``group``; rank 0 writes, streaming: no rank holds more than its
    shards plus one full tensor. The file appears whole or not at all (a temporary file beside
    it, renamed), mode 0600. For layers' parameters (``spmd.tensor_parallel.linen`` and the
    others) pass ``spmd.tensor_parallel.sharded(params)``.

    Example (a world of one)::

        >>> import jax.numpy as jnp, spmd, tempfile, os
        >>> f = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> spmd.checkpoint.save_safetensors(f, {"dense": {"w": jnp.ones((2, 3))}})
        >>> back = spmd.checkpoint.load_safetensors(f, {"dense": {"w": jnp.zeros((2, 3))}})
        >>> back["dense"]["w"].sum()
        Array(6., dtype=float32)
    """
    from ._external import save_safetensors as write

    comm = _communicator(group)
    op = f"spmd.checkpoint.save_safetensors({str(path)!r})"
    _agree(comm, op, lambda: None)  # every rank is here before rank 0 creates the file
    write(path, tree, comm, op)


def load_safetensors(path: PathLike, like: Any, *, strict: bool = True, group: Any = None) -> Any:
    """Read a safetensors file into the structure and layout of ``like``: a ShardedArray leaf
    gets this rank's block (only its slice of the tensor is read), an array the full tensor,
    converted to the leaf's dtype. Tensors are found by the names :func:`save_safetensors`
    gives (keys joined by dots). ``strict``: tensors in the file that ``like`` does not name
    are an error (False: skipped, as a Hugging Face file's extra buffers). Shapes must match.
    Errors are raised on every rank of ``group``."""
    from ._external import load_safetensors as read

    comm = _communicator(group)
    op = f"spmd.checkpoint.load_safetensors({str(path)!r})"
    result: list[Any] = []
    _agree(comm, op, lambda: result.append(read(path, like, strict, op)))
    return result[0]


def metadata(path: PathLike) -> dict[str, Any]:
    """The ``metadata`` dict saved with the checkpoint at ``path`` (``{}`` if none was given).

    Reads only the manifest; not a collective. Falls back to ``{path}.old-*`` as :func:`load`.
    """
    op = f"spmd.checkpoint.metadata({str(path)!r})"
    directory = resolve(_target(path), op, stacklevel=3)
    meta = read_manifest(directory, op).get("metadata") or {}
    return dict(meta)


# -- helpers --------------------------------------------------------------------------------------


def _communicator(group: Any) -> Communicator:
    """The group that saves or loads together: the collectives' own resolution (None: the
    default communicator; a Communicator; or an axis name of the active mesh)."""
    from ..mesh import resolve_group

    return resolve_group(None, group, op="spmd.checkpoint")


def _target(path: Any) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise SpmdTypeError(
            f"path={path!r} is a {type(path).__name__}; expected a str or os.PathLike naming "
            "the checkpoint directory"
        )
    # Absolute, without a trailing slash: the siblings path.tmp-* / path.old-* sit beside it.
    # Symbolic links are followed (as open() does): saving to a link such as latest -> step-9
    # replaces step-9 and keeps the link, instead of replacing the link with a directory.
    return Path(os.path.realpath(os.fspath(path)))


_OTHERS = "failed because another rank did: "


def _agree(comm: Communicator, op: str, step: Callable[[], T]) -> list[T]:
    """:meth:`Communicator.agree` in this package's words: every rank's result of ``step``, or
    an error on every rank, naming ``op``. This rank's failure is its own error (anything else
    than an :class:`SpmdError` wrapped in one); another rank's is quoted; and an exchange that
    timed out says why the ranks wait for each other here."""
    own: list[SpmdError] = []

    def run() -> T:
        try:
            return step()
        except SpmdError as e:
            own.append(e)
            raise
        except Exception as e:
            wrapped = SpmdError(f"{type(e).__name__}: {e}", op=op)
            own.append(wrapped)
            raise wrapped from e

    try:
        return comm.agree(run)
    except SpmdError as e:
        if own and e is own[0]:
            raise
        # agree's own report of another rank's failure carries this rank's prefix and no op;
        # anything else it raises is the exchange's (a rank slower than SPMD_TIMEOUT, or gone).
        quoted = str(e).removeprefix(prefix())
        if e.op is None and quoted.startswith(_OTHERS):
            raise SpmdError(quoted, op=op) from None
        raise SpmdError(TIMED_OUT.format(error=quoted), op=op) from None
