"""DistributedSampler (coverage, padding, drop_last, epochs, seeds, resume, batches, errors) and
shard_batch, in one process with explicit ranks and on 2-3 ranks under the launcher."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.data import DistributedSampler, shard_batch
from spmd.testing import multirank


def per_rank(num_samples, replicas, **kw):
    """Every rank's indices for one sampler configuration, as lists."""
    epoch = kw.pop("epoch", 0)
    out = []
    for r in range(replicas):
        s = DistributedSampler(num_samples, num_replicas=replicas, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def interleave(parts):
    """The epoch order the ranks were dealt from: position i belongs to rank i % replicas."""
    return [parts[i % len(parts)][i // len(parts)] for i in range(sum(map(len, parts)))]


# -- coverage, padding, drop_last ------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 6])
def test_divisible_covers_every_index_exactly_once(shuffle, replicas):
    for drop_last in (False, True):
        parts = per_rank(12, replicas, shuffle=shuffle, drop_last=drop_last)
        assert all(len(p) == 12 // replicas for p in parts)
        assert sorted(i for p in parts for i in p) == list(range(12))
        assert all(type(i) is int for p in parts for i in p)


def test_unshuffled_order_is_dealt_round_robin():
    assert per_rank(12, 3, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def test_padding_repeats_the_beginning():
    # 10 samples on 4 ranks: order 0..9 padded with 0, 1 to 12 positions.
    parts = per_rank(10, 4, shuffle=False)
    assert parts == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    s = DistributedSampler(10, shuffle=False, num_replicas=4, rank=2)
    assert len(s) == 3


def test_padding_longer_than_the_data_repeats_cyclically():
    assert per_rank(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]
    assert per_rank(3, 8, shuffle=False) == [[0], [1], [2], [0], [1], [2], [0], [1]]


@pytest.mark.parametrize("n, replicas", [(10, 4), (7, 3), (3, 5), (1, 2), (13, 6)])
def test_shuffled_padding_repeats_the_start_of_the_permutation(n, replicas):
    parts = per_rank(n, replicas, shuffle=True, seed=5, epoch=2)
    order = interleave(parts)
    perm = np.random.default_rng((5, 2)).permutation(n).tolist()
    padded = (perm * replicas)[: -(-n // replicas) * replicas]
    assert order == padded
    assert set(order) == set(range(n))
    assert all(len(p) == len(parts[0]) for p in parts)


@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last_drops_the_tail(shuffle):
    parts = per_rank(10, 4, shuffle=shuffle, drop_last=True, seed=3)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    order = interleave(parts)
    full = np.random.default_rng((3, 0)).permutation(10).tolist() if shuffle else list(range(10))
    assert order == full[:8]
    assert len(set(order)) == 8
    # Fewer samples than ranks: nobody reads anything.
    assert per_rank(3, 4, drop_last=True) == [[], [], [], []]


def test_empty_data_set():
    for drop_last in (False, True):
        s = DistributedSampler(0, drop_last=drop_last, num_replicas=3, rank=1)
        assert len(s) == 0
        assert list(s) == []
        assert list(s.batches(4)) == []


# -- epochs and seeds ------------------------------------------------------------------------------


def test_shuffle_follows_seed_and_epoch_and_agrees_between_ranks():
    n, replicas = 50, 4
    orders = {}
    for seed in (0, 1):
        for epoch in (0, 1, 2):
            parts = per_rank(n, replicas, seed=seed, epoch=epoch)
            # Every rank dealt from the same permutation, the one of (seed, epoch).
            expected = np.random.default_rng((seed, epoch)).permutation(n).tolist()
            padded = expected + expected[: -n % replicas]
            assert interleave(parts) == padded
            orders[seed, epoch] = interleave(parts)
    assert len({tuple(o) for o in orders.values()}) == len(orders)  # all different
    # The same configuration gives the same order again.
    assert interleave(per_rank(n, replicas, seed=1, epoch=2)) == orders[1, 2]


def test_without_shuffle_every_epoch_is_the_same():
    assert per_rank(9, 2, shuffle=False, epoch=0) == per_rank(9, 2, shuffle=False, epoch=7)


def test_set_epoch_changes_the_order_of_one_sampler():
    s = DistributedSampler(40, seed=9, num_replicas=2, rank=1)
    first = list(s)
    assert list(s) == first  # the same epoch again
    s.set_epoch(1)
    assert s.epoch == 1
    second = list(s)
    assert second != first
    assert len(second) == len(first) == 20


# -- state_dict / load_state_dict -----------------------------------------------------------------


def test_state_dict_counts_what_the_iterator_yielded():
    s = DistributedSampler(20, seed=1, num_replicas=2, rank=0)
    s.set_epoch(3)
    assert s.state_dict()["epoch"] == 3 and s.state_dict()["offset"] == 0
    it = iter(s)
    got = [next(it) for _ in range(4)]
    state = s.state_dict()
    assert state["epoch"] == 3 and state["offset"] == 4
    assert got == list(s)[:4]  # a new iterator starts the epoch over...
    assert s.state_dict()["offset"] == 10  # ...and finished it: the offset is its own
    next(it)  # the older iterator no longer moves the offset
    assert s.state_dict()["offset"] == 10
    s.set_epoch(4)
    assert s.state_dict()["offset"] == 0


@pytest.mark.parametrize("stop", [0, 1, 7, 13])
def test_resume_continues_exactly(stop):
    kw = {"seed": 4, "num_replicas": 3, "rank": 1}
    s = DistributedSampler(40, **kw)
    s.set_epoch(2)
    full = list(s)
    it = iter(s)
    head = [next(it) for _ in range(stop)]
    state = s.state_dict()

    resumed = DistributedSampler(40, **kw)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2
    assert resumed.state_dict()["offset"] == stop
    resumed.set_epoch(2)  # re-setting the saved epoch keeps the resume
    tail = list(resumed)
    assert head + tail == full
    assert resumed.state_dict()["offset"] == len(full)
    assert list(resumed) == full  # the skip applies once
    resumed.set_epoch(3)
    assert resumed.state_dict() == {**state, "epoch": 3, "offset": 0}


def test_resume_with_batches_and_new_epoch_cancels_resume():
    kw = {"seed": 0, "num_replicas": 2, "rank": 0}
    s = DistributedSampler(30, **kw)
    full = list(s)
    batches = s.batches(4)
    head = [next(batches), next(batches)]
    state = s.state_dict()
    assert state["offset"] == 8

    resumed = DistributedSampler(30, **kw)
    resumed.load_state_dict(state)
    rest = list(resumed.batches(4))
    assert [len(b) for b in rest] == [4, 3]
    assert np.concatenate(head + rest).tolist() == full

    again = DistributedSampler(30, **kw)
    again.load_state_dict(state)
    again.set_epoch(1)
    assert len(list(again)) == 15


def test_load_state_dict_refuses_another_configuration():
    state = DistributedSampler(20, seed=1, num_replicas=2, rank=0).state_dict()
    other = DistributedSampler(20, seed=2, num_replicas=2, rank=1)
    with pytest.raises(spmd.SpmdError, match=r"rank 1: .*seed=1 .*seed=2"):
        other.load_state_dict(state)
    with pytest.raises(spmd.SpmdError, match=r"offset=11, expected an int in \[0, 10\]"):
        DistributedSampler(20, seed=1, num_replicas=2, rank=0).load_state_dict(
            {**state, "offset": 11}
        )
    with pytest.raises(spmd.SpmdTypeError, match="expected the dict of state_dict"):
        DistributedSampler(20, num_replicas=2, rank=0).load_state_dict({"epoch": 0})
    # The two required entries alone are enough.
    s = DistributedSampler(20, seed=1, num_replicas=2, rank=0)
    s.load_state_dict({"epoch": 1, "offset": 9})
    assert len(list(s)) == 1


def test_an_epoch_boundary_resumes_on_another_world_size():
    """A checkpoint saved at an epoch boundary on 2 ranks loads on 3 (it raised 'saved with
    num_replicas=2'); mid-epoch it still refuses, since the offset means nothing there."""
    saved = DistributedSampler(20, seed=1, num_replicas=2, rank=0)
    saved.set_epoch(3)
    start = saved.state_dict()  # nothing read yet
    list(saved)
    end = saved.state_dict()  # the whole epoch read
    for rank in range(3):
        fresh = DistributedSampler(20, seed=1, num_replicas=3, rank=rank)
        fresh.load_state_dict(start)
        want = DistributedSampler(20, seed=1, num_replicas=3, rank=rank)
        want.set_epoch(3)
        assert list(fresh) == list(want) and fresh.state_dict()["epoch"] == 3
        done = DistributedSampler(20, seed=1, num_replicas=3, rank=rank, drop_last=True)
        done.load_state_dict(end)
        assert list(done) == [] and done.state_dict()["offset"] == len(done)
    with pytest.raises(spmd.SpmdError, match=r"rank 0: .*num_replicas=2 but this sampler has "
                       r"num_replicas=3"):  # fmt: skip
        DistributedSampler(20, seed=1, num_replicas=3, rank=0).load_state_dict(
            {**start, "offset": 4}
        )


# -- batches ---------------------------------------------------------------------------------------


def test_batches_group_this_ranks_indices():
    s = DistributedSampler(23, seed=2, num_replicas=2, rank=1)  # 12 indices on each rank
    full = list(s)
    batches = list(s.batches(5))
    assert [len(b) for b in batches] == [5, 5, 2]
    assert all(isinstance(b, np.ndarray) and b.dtype == np.int64 for b in batches)
    assert np.concatenate(batches).tolist() == full
    assert [len(b) for b in s.batches(5, drop_last=True)] == [5, 5]
    assert [len(b) for b in s.batches(12)] == [12]
    assert [len(b) for b in s.batches(100)] == [12]
    assert list(s.batches(100, drop_last=True)) == []
    assert np.array_equal(s.indices(), full)


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, pattern",
    [
        ((-1,), {}, spmd.SpmdError, r"rank 0: .*num_samples=-1, expected a non-negative"),
        ((2.5,), {}, spmd.SpmdTypeError, r"rank 0: .*num_samples=2\.5 \(float\)"),
        ((True,), {}, spmd.SpmdTypeError, r"num_samples=True \(bool\)"),
        ((10,), {"num_replicas": 0}, spmd.SpmdError, r"rank [?0]: .*num_replicas=0, expected a po"),
        ((10,), {"rank": -1}, spmd.SpmdError, r"^rank [?0]: .*rank=-1, expected .*0 <= rank < "),
        # an invalid sampler rank does not name the process: its world rank does
        ((10,), {"rank": 2}, spmd.SpmdError, r"^rank [?0]: .*rank=2, expected 0 <= rank < num_re"),
        ((10,), {"rank": "0"}, spmd.SpmdTypeError, r"rank='0' \(str\)"),
        ((10,), {"seed": -3}, spmd.SpmdError, r"seed=-3, expected a non-negative int"),
    ],
)
def test_bad_arguments(args, kwargs, error, pattern):
    kwargs = {"num_replicas": 2, "rank": 0, **kwargs}
    with pytest.raises(error, match=pattern):
        DistributedSampler(*args, **kwargs)


def test_bad_batch_size_and_epoch():
    s = DistributedSampler(10, num_replicas=2, rank=1)
    with pytest.raises(spmd.SpmdError, match=r"rank 1: .*batch_size=0, expected a positive int"):
        s.batches(0)
    with pytest.raises(spmd.SpmdTypeError, match=r"batch_size=None"):
        s.batches(None)
    with pytest.raises(spmd.SpmdError, match=r"rank 1: .*epoch=-1, expected a non-negative"):
        s.set_epoch(-1)
    assert issubclass(spmd.SpmdTypeError, TypeError) and issubclass(spmd.SpmdError, ValueError)


def test_numpy_integers_are_accepted():
    s = DistributedSampler(np.int64(8), num_replicas=np.int32(2), rank=np.int64(1))
    assert list(s) == list(DistributedSampler(8, num_replicas=2, rank=1))
    assert "num_samples=8" in repr(s)


# -- on several ranks ------------------------------------------------------------------------------


@multirank(nprocs=(2, 3))
def test_default_sampler_covers_every_index_once_across_ranks(comm):
    for n, drop_last in ((30, False), (30, True), (31, True)):
        s = DistributedSampler(n, seed=11, drop_last=drop_last)
        assert (s.num_replicas, s.rank) == (comm.size, comm.rank)
        for epoch in (0, 1):
            s.set_epoch(epoch)
            mine = list(s)
            everyone = comm.allgather_object(mine)
            assert [len(p) for p in everyone] == [len(s)] * comm.size
            seen = [i for p in everyone for i in p]
            assert len(set(seen)) == len(seen)
            assert len(seen) == n - n % comm.size
            if n % comm.size == 0:
                assert sorted(seen) == list(range(n))
    # Padded: every index at least once, and the ranks stay in step.
    s = DistributedSampler(31, seed=11)
    everyone = comm.allgather_object(list(s))
    assert {i for p in everyone for i in p} == set(range(31))
    assert len({len(p) for p in everyone}) == 1


@multirank(nprocs=(2, 3))
def test_shard_batch_of_a_pytree(comm):
    n, rows = comm.size, 4 * comm.size
    batch = {
        "x": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3),
        "y": (jnp.arange(rows, dtype=jnp.int32), jnp.ones((rows, 2, 2))),
    }
    got = shard_batch(batch)
    lo, hi = 4 * comm.rank, 4 * comm.rank + 4
    assert isinstance(got["x"], np.ndarray)
    assert np.array_equal(got["x"], batch["x"][lo:hi])
    y0, y1 = got["y"]
    assert isinstance(y0, jnp.ndarray) and not isinstance(y0, np.ndarray)
    assert np.array_equal(np.asarray(y0), np.arange(lo, hi))
    assert y1.shape == (4, 2, 2)
    # One array, numpy or JAX, and an explicit communicator.
    assert np.array_equal(shard_batch(batch["x"], comm), batch["x"][lo:hi])
    assert np.array_equal(np.asarray(shard_batch(batch["y"][0], comm)), np.arange(lo, hi))
    # Gathering the shards gives the batch back.
    gathered = comm.allgather_object(got["x"])
    assert np.array_equal(np.concatenate(gathered), batch["x"])
    assert n == len(gathered)


@multirank(nprocs=(2, 3))
def test_shard_batch_errors(comm):
    r, n = comm.world_rank, comm.size
    rows = 2 * n + 1
    with pytest.raises(spmd.SpmdError) as info:
        shard_batch({"x": np.zeros((rows, 2))})
    msg = str(info.value)
    assert f"rank {r}: " in msg and f"{rows} rows" in msg and f"{n} ranks" in msg
    assert "drop the last 1 rows" in msg and f"pad the batch to {rows + n - 1} rows" in msg
    assert "global_batch['x']" in msg

    with pytest.raises(spmd.SpmdError, match=r"global_batch\['b'\]\[1\] has 3 rows but"):
        shard_batch({"a": np.zeros((2 * n,)), "b": [jnp.zeros(2 * n), jnp.zeros(3)]})
    with pytest.raises(spmd.SpmdTypeError, match=r"global_batch\['s'\] is a scalar"):
        shard_batch({"s": jnp.float32(1.0)})
    with pytest.raises(spmd.SpmdTypeError, match=r"global_batch\[0\] has type int, expected an"):
        shard_batch([1, 2])
