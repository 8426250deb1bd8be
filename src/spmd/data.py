"""Feeding data to every rank: which samples each rank reads, and its slice of a global batch.

Two ways to split a data set over the ranks of a data-parallel job:

- :class:`DistributedSampler` gives each rank its own share of the sample indices for an epoch.
  Every rank builds the same epoch order (a permutation seeded by ``(seed, epoch)``, or the
  natural order), pads it by repeating its beginning to a multiple of the number of replicas
  (or, with ``drop_last``, drops the tail), and takes every ``num_replicas``-th index starting
  at its rank. Its :meth:`~DistributedSampler.state_dict` records how far the current epoch has
  gone, so that a restarted job resumes where it stopped.
- :func:`shard_batch` takes a global batch that every rank holds in full (an array or a pytree
  of arrays) and returns this rank's contiguous block of rows.

Usage::

    import spmd
    from spmd.data import DistributedSampler, shard_batch

    comm = spmd.init()
    sampler = DistributedSampler(len(dataset), shuffle=True, seed=0)  # replicas/rank from comm
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)            # a new order each epoch, the same on every rank
        for idx in sampler.batches(32):     # numpy int arrays of this rank's indices
            params, opt_state, loss = train_step(params, opt_state, dataset[idx])

    # Or: every rank loads the same global batch and keeps its rows.
    local = shard_batch({"x": x_global, "y": y_global})   # rows [rank*b, (rank+1)*b)

Importing this module does not import JAX; :func:`shard_batch` imports it for pytrees.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._errors import SpmdError, SpmdTypeError

if TYPE_CHECKING:
    from .runtime import Communicator

__all__ = ["DistributedSampler", "shard_batch"]

IndexArray = npt.NDArray[np.int64]


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _who(rank: object) -> dict[str, Any]:
    """How an error names this process (:class:`SpmdError`'s keywords): its sampler rank if
    valid, else its world rank."""
    return {"rank": int(rank)} if _is_int(rank) else {}  # type: ignore[call-overload]


# ------------------------------------------------------------------------------------------------
# DistributedSampler
# ------------------------------------------------------------------------------------------------


class DistributedSampler:
    """This rank's share of ``range(num_samples)``, epoch by epoch.

    Every rank builds the same epoch order: a permutation drawn from
    ``np.random.default_rng((seed, epoch))`` if ``shuffle``, else ``0, 1, ..., num_samples - 1``.
    Without ``drop_last`` the order is padded to a multiple of ``num_replicas`` by repeating its
    beginning (cyclically, when the padding is longer than the data), so that every sample is
    read at least once per epoch and a few are read twice. With ``drop_last`` its tail is dropped
    down to a multiple of ``num_replicas`` instead, so no sample is read twice and up to
    ``num_replicas - 1`` are not read that epoch. Rank ``r`` then takes positions
    ``r, r + num_replicas, r + 2 * num_replicas, ...`` of it.

    Args:
        num_samples: the size of the data set (``len(dataset)``), a non-negative int.
        shuffle: draw a fresh order each epoch (default True); False keeps the natural order.
        seed: a non-negative int seeding the order (default 0); must be the same on every rank.
        drop_last: drop the tail instead of padding (default False).
        num_replicas: the number of ranks sharing the data set; default: the world size from
            :func:`spmd.init`.
        rank: this rank's position among them, ``0 <= rank < num_replicas``; default: the
            world rank from :func:`spmd.init`.

    Iterating yields this rank's indices (Python ints) for the current epoch, ``len(sampler)``
    of them; :meth:`batches` yields them in numpy arrays. Call :meth:`set_epoch` before each
    epoch, or every epoch repeats the order of epoch 0.

    Raises :class:`spmd.SpmdTypeError` for an argument of the wrong type and
    :class:`spmd.SpmdError` for one out of range.
    """

    def __init__(
        self,
        num_samples: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if num_replicas is None or rank is None:
            from .runtime import init

            world = init()
            num_replicas = world.size if num_replicas is None else num_replicas
            rank = world.rank if rank is None else rank
        valid = _is_int(rank) and _is_int(num_replicas) and 0 <= rank < num_replicas
        me = _who(rank if valid else None)
        _check_int(me, "num_replicas", num_replicas, 1, "a positive number of ranks")
        _check_int(me, "rank", rank, 0, f"a rank with 0 <= rank < num_replicas={num_replicas}")
        if rank >= num_replicas:
            raise SpmdError(
                f"DistributedSampler got rank={rank}, expected 0 <= rank < "
                f"num_replicas={num_replicas}; pass a rank below num_replicas, or leave both to "
                "spmd.init()",
                **me,
            )
        _check_int(me, "num_samples", num_samples, 0, "a non-negative size, e.g. len(dataset)")
        _check_int(me, "seed", seed, 0, "a non-negative int, the same on every rank")
        self._num_samples = int(num_samples)
        self._num_replicas = int(num_replicas)
        self._rank = int(rank)
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._drop_last = bool(drop_last)
        self._epoch = 0
        # Indices yielded so far this epoch by the newest iterator.
        self._offset = 0
        # Indices the next iterator skips (set by load_state_dict; used once).
        self._resume = 0
        # Bumped by every new iterator and by set_epoch, so that only the newest iterator of the
        # current epoch moves the offset.
        self._generation = 0

    # -- attributes -----------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def epoch(self) -> int:
        return self._epoch

    def __len__(self) -> int:
        """The number of indices this rank reads per epoch (the same on every rank)."""
        return _per_rank(self._num_samples, self._num_replicas, self._drop_last)

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(num_samples={self._num_samples}, shuffle={self._shuffle}, "
            f"seed={self._seed}, drop_last={self._drop_last}, "
            f"num_replicas={self._num_replicas}, rank={self._rank}; epoch={self._epoch})"
        )

    # -- epochs ---------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` (a non-negative int) the current epoch; call it on every rank.

        Moving to another epoch restarts its offset at 0 and cancels a pending resume. Setting
        the current epoch again changes nothing, so a loop that resumes from
        :meth:`load_state_dict` may call ``set_epoch(sampler.epoch)`` before iterating.
        """
        _check_int(_who(self._rank), "epoch", epoch, 0, "a non-negative int")
        if int(epoch) != self._epoch:
            self._epoch = int(epoch)
            self._offset = 0
            self._resume = 0
            self._generation += 1

    def indices(self) -> IndexArray:
        """This rank's indices for the current epoch, all of them (int64, ``len(self)`` long)."""
        n, replicas = self._num_samples, self._num_replicas
        if self._shuffle:
            order = np.random.default_rng((self._seed, self._epoch)).permutation(n)
        else:
            order = np.arange(n)
        order = order.astype(np.int64, copy=False)
        if self._drop_last:
            order = order[: n - n % replicas]
        else:
            pad = -n % replicas
            if pad:
                # np.resize repeats the order from its beginning, as often as it takes.
                order = np.concatenate([order, np.resize(order, pad)])
        return order[self._rank :: replicas]

    def _start(self) -> tuple[IndexArray, int, int]:
        """Begin an iterator: this rank's indices, where to start, and the iterator's id."""
        mine = self.indices()
        start, self._resume = self._resume, 0
        self._offset = start
        self._generation += 1
        return mine, start, self._generation

    def _advance(self, generation: int, count: int) -> None:
        if generation == self._generation:
            self._offset += count

    def __iter__(self) -> Iterator[int]:
        mine, start, generation = self._start()
        return self._iterate(mine[start:].tolist(), generation)

    def _iterate(self, mine: list[int], generation: int) -> Iterator[int]:
        for index in mine:
            # Counted before it is handed out: a state_dict taken while the caller works on this
            # index resumes after it.
            self._advance(generation, 1)
            yield index

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[IndexArray]:
        """This rank's indices for the current epoch in numpy int64 arrays of ``batch_size``.

        The last batch is shorter when ``len(self)`` is not a multiple of ``batch_size``, or left
        out with ``drop_last=True``. Every rank gets the same number of batches (of the same
        sizes), so ranks stay in step. A resumed epoch (:meth:`load_state_dict`) starts its
        batches at the saved offset.
        """
        _check_int(_who(self._rank), "batch_size", batch_size, 1, "a positive int")
        mine, start, generation = self._start()
        return self._iterate_batches(mine[start:], int(batch_size), drop_last, generation)

    def _iterate_batches(
        self, mine: IndexArray, batch_size: int, drop_last: bool, generation: int
    ) -> Iterator[IndexArray]:
        stop = len(mine) - len(mine) % batch_size if drop_last else len(mine)
        for begin in range(0, stop, batch_size):
            batch = mine[begin : begin + batch_size]
            self._advance(generation, len(batch))
            yield batch

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler stands: the epoch, and ``offset``, the number of indices of that
        epoch the newest iterator has yielded (``len(self)`` once it has finished). The other
        entries describe the sampler, so that :meth:`load_state_dict` can tell a checkpoint of
        another configuration. Every rank's offset is the same when the ranks step together.
        """
        return {
            "epoch": self._epoch,
            "offset": self._offset,
            "num_samples": self._num_samples,
            "num_replicas": self._num_replicas,
            "shuffle": self._shuffle,
            "seed": self._seed,
            "drop_last": self._drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: set the epoch, and make the next iterator (of
        ``iter`` or :meth:`batches`) skip the first ``offset`` indices of that epoch, once.

        The sampler's configuration (num_samples, num_replicas, shuffle, seed, drop_last) must
        match the saved one where the state records it: an offset means nothing in another
        epoch order. At an epoch boundary (offset 0, or the whole epoch read) the number of
        replicas and drop_last may differ: the job resumes at that boundary on any world size.
        """
        me = _who(self._rank)
        if not isinstance(state, dict) or "epoch" not in state or "offset" not in state:
            raise SpmdTypeError(
                f"DistributedSampler.load_state_dict got {type(state).__name__} "
                f"{state!r:.200}, expected the dict of state_dict() with 'epoch' and 'offset'",
                **me,
            )
        mine = self.state_dict()
        layout = ("num_replicas", "drop_last")
        if any(k in state and state[k] != mine[k] for k in layout) and _at_boundary(state):
            state = {k: v for k, v in state.items() if k not in layout}
            if state["offset"] != 0:  # the saved epoch was read whole: so is this rank's
                state["offset"] = len(self)
        for key in ("num_samples", "num_replicas", "shuffle", "seed", "drop_last"):
            if key in state and state[key] != mine[key]:
                raise SpmdError(
                    f"DistributedSampler.load_state_dict: the state was saved with "
                    f"{key}={state[key]!r} but this sampler has {key}={mine[key]!r}; create the "
                    f"sampler with {key}={state[key]!r} to resume, or start the epoch afresh",
                    **me,
                )
        epoch, offset = state["epoch"], state["offset"]
        _check_int(me, "state['epoch']", epoch, 0, "a non-negative int")
        _check_int(me, "state['offset']", offset, 0, f"an int in [0, {len(self)}]")
        if offset > len(self):
            raise SpmdError(
                f"DistributedSampler.load_state_dict got offset={offset}, expected an "
                f"int in [0, {len(self)}] (this rank's indices per epoch)",
                **me,
            )
        self._epoch = int(epoch)
        self._offset = int(offset)
        self._resume = int(offset)
        self._generation += 1


def _per_rank(num_samples: int, num_replicas: int, drop_last: bool) -> int:
    """Indices each rank reads per epoch."""
    if drop_last:
        return num_samples // num_replicas
    return math.ceil(num_samples / num_replicas)


def _at_boundary(state: dict[str, Any]) -> bool:
    """Whether a saved state stands at the start or the end of its epoch."""
    offset, n, replicas = state.get("offset"), state.get("num_samples"), state.get("num_replicas")
    if offset == 0:
        return True
    if not (type(n) is int and type(replicas) is int and replicas >= 1):
        return False
    return offset == _per_rank(n, replicas, bool(state.get("drop_last")))


def _check_int(me: dict[str, Any], name: str, value: object, low: int, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise SpmdTypeError(
            f"DistributedSampler got {name}={value!r} ({type(value).__name__}), "
            f"expected {expected}",
            **me,
        )
    if value < low:
        raise SpmdError(f"DistributedSampler got {name}={value}, expected {expected}", **me)


# ------------------------------------------------------------------------------------------------
# shard_batch
# ------------------------------------------------------------------------------------------------


def shard_batch(global_batch: Any, comm: Communicator | None = None) -> Any:
    """This rank's rows of a global batch that every rank holds in full.

    ``global_batch`` is an array or a pytree of arrays (numpy or JAX), all with the same number
    of rows (axis 0), divisible by ``comm.size``. With ``b = rows // comm.size``, rank ``r``
    gets rows ``[r * b, (r + 1) * b)`` of every leaf, in a pytree of the same structure. Leaves
    keep their type: numpy arrays come back as numpy views, JAX arrays as JAX arrays.

    Args:
        global_batch: the batch, identical on every rank.
        comm: the communicator whose ranks share the batch; default: :func:`spmd.init`'s world.

    Raises :class:`spmd.SpmdTypeError` for a leaf that is not an array with at least one axis,
    and :class:`spmd.SpmdError` when leaves disagree on their row count or it does not divide
    by the number of ranks.
    """
    if comm is None:
        from .runtime import init

        comm = init()
    if isinstance(global_batch, np.ndarray):
        rows = _rows(comm, "global_batch", global_batch)
        return global_batch[_my_rows(comm, rows, "global_batch")]

    import jax

    with_path, treedef = jax.tree_util.tree_flatten_with_path(global_batch)
    if not with_path:
        return global_batch
    first = "global_batch" + jax.tree_util.keystr(with_path[0][0])
    rows = _rows(comm, first, with_path[0][1])
    for path, leaf in with_path[1:]:
        name = "global_batch" + jax.tree_util.keystr(path)
        if _rows(comm, name, leaf) != rows:
            raise SpmdError(
                f"{name} has {leaf.shape[0]} rows but "
                f"{first} has {rows}; every leaf of the batch needs the same number of rows "
                "(axis 0)",
                op="shard_batch",
            )
    mine = _my_rows(comm, rows, first)
    return jax.tree_util.tree_unflatten(treedef, [leaf[mine] for _, leaf in with_path])


def _rows(comm: Communicator, name: str, leaf: Any) -> int:
    shape = getattr(leaf, "shape", None)
    if not isinstance(shape, tuple) or not hasattr(leaf, "__getitem__"):
        raise SpmdTypeError(
            f"{name} has type {type(leaf).__name__}, "
            "expected an array; pass numpy or JAX arrays (np.asarray(...)) or pytrees of them",
            op="shard_batch",
        )
    if not shape:
        raise SpmdTypeError(
            f"{name} is a scalar (shape ()), expected an "
            "array with a batch axis 0 to split over the ranks",
            op="shard_batch",
        )
    return int(shape[0])


def _my_rows(comm: Communicator, rows: int, name: str) -> slice:
    if rows % comm.size:
        raise SpmdError(
            f"{name} has {rows} rows, which do not divide "
            f"evenly over the {comm.size} ranks; drop the last {rows % comm.size} rows or pad "
            f"the batch to {rows + -rows % comm.size} rows (a multiple of {comm.size})",
            op="shard_batch",
        )
    per_rank = rows // comm.size
    return slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
