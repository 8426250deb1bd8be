"""all_to_allv: uneven counts (zeros, a rank that sends nothing) on shared memory and MPI, eager
and under jit; traced counts and the padding; gradients against finite differences of the global
objective; vmap; bad counts as the same error on every rank.

Every rank's input and counts are functions of its rank, so each rank computes what it must
receive without communication."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank

from ._cases import close, np_dtype
from .test_autodiff import _fd_gradient

CASES = (("float32", (2, 3)), ("int8", ()), ("bfloat16", (3,)), ("bool", (2,)))


def _send(r: int, n: int) -> list[int]:
    """Rank r's send counts: zeros among them, and the last rank of several sends nothing."""
    if n > 1 and r == n - 1:
        return [0] * n
    return [(2 * r + j + 1) % 3 for j in range(n)]


def _recv(r: int, n: int) -> list[int]:
    return [_send(j, n)[r] for j in range(n)]


def _x(r: int, n: int, dtype: str = "float32", trail: tuple[int, ...] = ()) -> np.ndarray:
    rows = sum(_send(r, n))
    v = (np.arange(rows * int(np.prod(trail))).reshape(rows, *trail) + 1 + 16 * r) % 120
    return v % 2 == 1 if dtype == "bool" else v.astype(np_dtype(dtype))


def _exchange(xs: list[np.ndarray], sends: list[list[int]]) -> list[np.ndarray]:
    """NumPy all_to_allv: every rank's output from every rank's rows and send counts."""
    n = len(xs)
    start = [np.cumsum([0, *s]) for s in sends]
    return [
        np.concatenate([xs[j][start[j][r] : start[j][r + 1]] for j in range(n)]) for r in range(n)
    ]


def _expected(r: int, n: int, dtype: str = "float32", trail: tuple[int, ...] = ()) -> np.ndarray:
    return _exchange([_x(j, n, dtype, trail) for j in range(n)], [_send(j, n) for j in range(n)])[r]


def _padded(a: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


@contextlib.contextmanager
def _transport(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    spmd.ops.set_transport(name)
    try:
        yield
    finally:
        spmd.ops.set_transport("auto")


def _transports(comm) -> tuple[str | None, ...]:
    return ("shm", "mpi") if comm.size > 1 else (None,)


# -- values -------------------------------------------------------------------------------------


def _values(comm) -> None:
    r, n = comm.rank, comm.size
    send, recv = _send(r, n), _recv(r, n)
    most = 2 * n + 1  # more than any rank receives
    for dtype, trail in CASES:
        x, want = _x(r, n, dtype, trail), _expected(r, n, dtype, trail)
        what = f"{dtype}{trail}"
        close(spmd.all_to_allv(x, send), want, f"eager, counts exchanged {what}")
        close(spmd.all_to_allv(x, send, recv), want, f"eager {what}")
        close(jax.jit(lambda x: spmd.all_to_allv(x, send, recv))(x), want, f"jit {what}")
        got = jax.jit(lambda x: spmd.all_to_allv(x, send, out_rows=most))(x)
        close(got, _padded(want, most), f"jit, counts exchanged {what}")


def _large(comm) -> None:
    """Blocks of up to 1.2 MiB: several pipeline steps through the shared-memory slots, and the
    staging probe."""
    r, n = comm.rank, comm.size
    sends = [[150 * ((k + j) % 3) for j in range(n)] for k in range(n)]
    xs = [
        ((np.arange(sum(s))[:, None] * 7 + 1000 * k + np.arange(1024)) % 4093).astype(np.float32)
        for k, s in enumerate(sends)
    ]
    recv = [sends[j][r] for j in range(n)]
    got = jax.jit(lambda x: spmd.all_to_allv(x, sends[r], recv))(xs[r])
    np.testing.assert_array_equal(got, _exchange(xs, sends)[r])


@multirank(nprocs=(1, 2, 3, 4))
def test_uneven_counts_on_shared_memory_and_mpi(comm):
    for name in _transports(comm):
        with _transport(name):
            assert spmd.ops.get_transport() == (name or "self")
            _values(comm)
            _large(comm)


@multirank(nprocs=(4,), env={"SPMD_SIMULATE_NODES": "2"})
def test_uneven_counts_across_nodes(comm):
    assert spmd.ops.get_transport() == "hier"
    r, n = comm.rank, comm.size
    x = _x(r, n, "float32", (2,))
    got = jax.jit(lambda x: spmd.all_to_allv(x, _send(r, n), _recv(r, n)))(x)
    close(got, _expected(r, n, "float32", (2,)), "hier")


@multirank(nprocs=(3, 4))
def test_groups(comm):
    """Counts are per member of the group, in group order."""
    r = comm.rank
    pairs = [list(range(i, min(i + 2, comm.size))) for i in range(0, comm.size, 2)]
    members = next(p for p in pairs if r in p)
    m, g = members.index(r), len(members)
    for kw in ({"rank_list": pairs}, {"group": spmd.get_communicator(pairs)}):
        got = spmd.all_to_allv(_x(m, g, "int32", (2,)) + 100 * r, _send(m, g), **kw)
        xs = [_x(k, g, "int32", (2,)) + 100 * w for k, w in enumerate(members)]
        want = _exchange(xs, [_send(k, g) for k in range(g)])[m]
        close(got, want, str(kw))


@multirank(nprocs=(2, 3))
def test_traced_counts_pad_with_zeros(comm):
    r, n = comm.rank, comm.size
    send, recv = _send(r, n), _recv(r, n)
    x = _x(r, n, "float32", (3,))
    want = _expected(r, n, "float32", (3,))
    f = jax.jit(lambda x, s, c: spmd.all_to_allv(x, s, c, out_rows=2 * n + 2))
    got = f(x, jnp.asarray(send), np.asarray(recv, np.int64))
    close(got, _padded(want, 2 * n + 2), "traced send and receive counts")
    g = jax.jit(lambda x, s: spmd.all_to_allv(x, s, out_rows=2 * n + 2))
    close(g(x, jnp.asarray(send)), _padded(want, 2 * n + 2), "traced, exchanged")
    # Without out_rows: room for size * x.shape[0] rows. Here every rank has 2n rows and sends
    # two to each member, then, with other counts through the same program, everything to
    # member 0.
    x = np.arange(2 * n, dtype=np.float32) + 10 * r
    h = jax.jit(lambda x, s: spmd.all_to_allv(x, s))
    got = h(x, jnp.full(n, 2, jnp.int32))
    want = np.concatenate([np.arange(2 * r, 2 * r + 2) + 10 * j for j in range(n)])
    close(got, _padded(want.astype(np.float32), 2 * n * n), "default out_rows")
    got = h(x, jnp.asarray([2 * n] + [0] * (n - 1)))
    if r == 0:
        want = np.concatenate([np.arange(2 * n) + 10 * j for j in range(n)]).astype(np.float32)
    else:
        want = np.zeros(0, np.float32)
    close(got, _padded(want, 2 * n * n), "default out_rows, other counts")


# -- autodiff and vmap --------------------------------------------------------------------------


@multirank(nprocs=(1, 2, 3, 4))
def test_gradient_is_the_reverse_exchange(comm):
    """Against finite differences of G = sum_r <w_r, y_r>, with a different w on every rank."""
    r, n = comm.rank, comm.size
    sends = [_send(k, n) for k in range(n)]
    xs = [np.random.default_rng(100 + k).standard_normal((sum(s), 2)) for k, s in enumerate(sends)]
    ys = _exchange(xs, sends)
    ws = [np.random.default_rng(200 + k).standard_normal(y.shape) for k, y in enumerate(ys)]
    expected = _fd_gradient(lambda xs: _exchange(xs, sends), xs, ws)[r]
    send, recv = sends[r], _recv(r, n)
    x, w = jnp.asarray(xs[r], jnp.float32), jnp.asarray(ws[r], jnp.float32)

    def fn(x):
        return spmd.all_to_allv(x, send, recv)

    y, vjp = jax.vjp(fn, x)
    np.testing.assert_allclose(y, ys[r], rtol=1e-6)
    np.testing.assert_allclose(vjp(w)[0], expected, rtol=1e-3, atol=1e-3)
    (got,) = jax.linear_transpose(fn, x)(w)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
    # JVP: the same exchange of the tangents.
    ts = [np.random.default_rng(300 + k).standard_normal(v.shape) for k, v in enumerate(xs)]
    _, t_out = jax.jvp(fn, (x,), (jnp.asarray(ts[r], jnp.float32),))
    np.testing.assert_allclose(t_out, _exchange(ts, sends)[r], rtol=1e-6)
    # Traced counts, padded output: the padding's cotangent reaches no input.
    pad = 3
    w_pad = jnp.concatenate([w, jnp.asarray(np.random.default_rng(r).standard_normal((pad, 2)))])

    def objective(x, s, c, w):
        return jnp.sum(w * spmd.all_to_allv(x, s, c, out_rows=sum(recv) + pad))

    g = jax.jit(jax.grad(objective))(x, jnp.asarray(send), jnp.asarray(recv), w_pad)
    np.testing.assert_allclose(g, expected, rtol=1e-3, atol=1e-3)


@multirank(nprocs=(2, 3))
def test_vmap(comm):
    r, n = comm.rank, comm.size
    send, recv = _send(r, n), _recv(r, n)
    batch = np.stack([_x(r, n, "float32", (2,)) + 1000 * b for b in range(3)])
    want = np.stack([_expected(r, n, "float32", (2,)) + 1000 * b for b in range(3)])
    for axis in (0, 1, 2):
        moved = np.moveaxis(batch, 0, axis)
        got = jax.vmap(lambda x: spmd.all_to_allv(x, send, recv), in_axes=axis)(moved)
        close(got, want, f"batched x, axis {axis}")
    got = jax.jit(jax.vmap(lambda x: spmd.all_to_allv(x, send, out_rows=2 * n)))(batch)
    close(got, np.stack([_padded(w, 2 * n) for w in want]), "batched x, counts exchanged")

    # Counts that differ per element: every rank has 2n rows and sends two to each member,
    # except that element b moves one row from member b % n to member (b + 1) % n.
    def counts(b: int) -> list[int]:
        c = [2] * n
        c[b % n] -= 1
        c[(b + 1) % n] += 1
        return c

    x = np.stack([np.arange(2 * n, dtype=np.float32) + 10 * r + 100 * b for b in range(3)])
    sends = jnp.asarray([counts(b) for b in range(3)])
    recvs = jnp.asarray([[counts(b)[r]] * n for b in range(3)])
    rows = 3 * n
    expected = np.stack(
        [spmd.all_to_allv(x[b], counts(b), [counts(b)[r]] * n, out_rows=rows) for b in range(3)]
    )
    got = jax.vmap(lambda x, s, c: spmd.all_to_allv(x, s, c, out_rows=rows))(x, sends, recvs)
    close(got, expected, "batched counts")
    got = jax.jit(jax.vmap(lambda x, s: spmd.all_to_allv(x, s, out_rows=rows)))(x, sends)
    close(got, expected, "batched counts, exchanged")
    # Unbatched x, batched counts.
    got = jax.vmap(lambda s, c: spmd.all_to_allv(x[0], s, c, out_rows=rows))(sends, recvs)
    expected = [
        spmd.all_to_allv(x[0], counts(b), [counts(b)[r]] * n, out_rows=rows) for b in range(3)
    ]
    close(got, np.stack(expected), "batched counts only")


# -- errors -------------------------------------------------------------------------------------


def _raises(fn, *fragments, exc=spmd.SpmdError):
    with pytest.raises(exc) as info:
        jax.block_until_ready(fn())
    text = str(info.value)
    for f in fragments:
        assert f in text, (f, text)
    return text


def _bad_counts(comm) -> None:
    r, n = comm.rank, comm.size
    me = f"rank {r}: all_to_allv: "
    x = jnp.ones((n + 1, 2))
    ok = [n + 1] + [0] * (n - 1)  # every row to member 0
    # Checked where the call is made when the counts are known (here the same on every rank).
    _raises(lambda: spmd.all_to_allv(x, [1] * n), me, f"add up to {n} rows", f"x has {n + 1}")
    _raises(lambda: spmd.all_to_allv(x, [n + 1] * (n + 1)), me, f"{n + 1} entries", f"{n} ranks")
    _raises(lambda: spmd.all_to_allv(x, jnp.ones(n - 1, jnp.int32)), me, f"shape ({n - 1},)")
    _raises(lambda: spmd.all_to_allv(x, [-1, n + 2] + [0] * (n - 2)), me, "holds -1")
    _raises(lambda: spmd.all_to_allv(x, ok, [-1] * n), me, "holds -1")
    _raises(lambda: spmd.all_to_allv(x, [1.5] * n), me, "holds 1.5", exc=spmd.SpmdTypeError)
    _raises(lambda: spmd.all_to_allv(x, jnp.ones(n)), me, "float32", exc=spmd.SpmdTypeError)
    _raises(lambda: spmd.all_to_allv(x, ok, [0] * n, out_rows=-1), me, "out_rows=-1")
    _raises(lambda: spmd.all_to_allv(x, ok, [n + 1] * n, out_rows=n), me, f"out_rows={n}")
    _raises(lambda: spmd.all_to_allv({"a": x}, ok), me, "one array", exc=spmd.SpmdTypeError)

    # Checked by every rank from every rank's counts before any row moves: one rank's bad counts
    # are the same error on every rank, traced or not.
    f = jax.jit(lambda x, s, c: spmd.all_to_allv(x, s, c, out_rows=n + 1))
    mine = np.zeros(n, np.int32)
    mine[r] = n + 1  # every row to itself
    bad = mine.copy()
    if r == 1:
        bad[0], bad[1] = -1, n + 2
    runtime = jax.errors.JaxRuntimeError
    _raises(lambda: f(x, bad, mine), me, "rank 1 passed send_counts=[-1, ", "negative", exc=runtime)
    short = mine.copy()
    short[r] -= r == 0
    _raises(lambda: f(x, short, short), me, "rank 0 passed send_counts=[", "add up to", exc=runtime)
    wrong = mine.copy()
    if r == 0:
        wrong[1] = 1
    expect = "rank 0 expects 1 rows from rank 1 (its recv_counts[1]), but rank 1 sends 0"
    _raises(lambda: spmd.all_to_allv(x, mine, wrong), me, expect)
    _raises(lambda: f(x, jnp.asarray(mine), jnp.asarray(wrong)), me, expect, exc=runtime)
    g = jax.jit(lambda x, s, c: spmd.all_to_allv(x, s, c, out_rows=n if r == n - 1 else n + 1))
    text = f"rank {n - 1} receives {n + 1} rows, but its output holds out_rows={n}"
    _raises(lambda: g(x, jnp.asarray(mine), jnp.asarray(mine)), me, text, exc=runtime)
    # The group still works.
    close(f(x, mine, mine), np.ones((n + 1, 2), np.float32), "after the errors")


@multirank(nprocs=(2, 3))
def test_bad_counts_raise_on_every_rank(comm):
    for name in _transports(comm):
        with _transport(name):
            _bad_counts(comm)


def test_world_of_one_checks_what_it_can():
    r = spmd.init().rank
    assert spmd.get_communicator().size == 1 and r == 0
    x = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(spmd.all_to_allv(x, [3], out_rows=5)[3:], np.zeros((2, 2)))
    with pytest.raises(spmd.SpmdError, match="expects 2 rows from this rank itself"):
        spmd.all_to_allv(x, [3], [2])
    with pytest.raises(spmd.SpmdError, match="out_rows=2"):
        jax.jit(lambda x, s: spmd.all_to_allv(x, s, out_rows=2))(x, jnp.asarray([3]))


# -- indexed: rows gathered on send and placed on receive (spmd.moe's exchanges) ----------------


def _indexed_case(r: int, n: int, repeat: int, seed: int = 0):
    """Rank r's x, its send_index and recv_index (each with entries past the counts, which are
    not read), and the output NumPy expects."""
    rng = np.random.default_rng([seed, r])
    sent = sum(_send(r, n))
    rows = -(-sent // repeat) + 1  # x's rows: enough for sent // repeat, and one never sent
    x = (np.arange(rows * 2).reshape(rows, 2) + 100 * r).astype(np.float32)
    send_index = np.concatenate([rng.permutation(sent), [7] * 3]).astype(np.int32)
    received = sum(_recv(r, n))
    recv_index = np.concatenate([rng.permutation(received), [-1] * 2]).astype(np.int32)
    return x, send_index, recv_index


def _indexed_expected(r: int, n: int, repeat: int, out_rows: int) -> np.ndarray:
    cases = [_indexed_case(j, n, repeat) for j in range(n)]
    seqs = [x[si[: sum(_send(j, n))] // repeat] for j, (x, si, _) in enumerate(cases)]
    got = _exchange(seqs, [_send(j, n) for j in range(n)])[r]
    out = np.zeros((out_rows, 2), np.float32)
    out[cases[r][2][: got.shape[0]]] = got
    return out


@multirank(nprocs=(1, 2, 3))
def test_indexed_gathers_and_places_rows(comm):
    from spmd.ops import all_to_allv_indexed

    r, n = comm.rank, comm.size
    send, recv = _send(r, n), _recv(r, n)
    out_rows = sum(recv) + 2
    for name in _transports(comm):
        with _transport(name):
            for repeat in (1, 2):
                what = f"{name} repeat={repeat}"
                x, si, ri = _indexed_case(r, n, repeat)

                def f(x, si=si, ri=ri, repeat=repeat):
                    return all_to_allv_indexed(
                        x, send, recv, send_index=si, repeat=repeat, recv_index=ri,
                        out_rows=out_rows,
                    )  # fmt: skip

                want = _indexed_expected(r, n, repeat, out_rows)
                close(f(jnp.asarray(x)), want, f"eager {what}")
                close(jax.jit(f)(jnp.asarray(x)), want, f"jit {what}")
                close(jax.vmap(f)(jnp.stack([x, 2 * x]))[1], 2 * want, f"vmap {what}")

                w = jnp.asarray(_indexed_weights(r, out_rows))

                def objective(x, f=f, w=w):
                    return jnp.sum(f(x) * w)

                want = _indexed_grad(r, n, repeat, out_rows)
                close(jax.jit(jax.grad(objective))(jnp.asarray(x)), want, f"grad {what}")
                close(jax.grad(objective)(jnp.asarray(x)), want, f"eager grad {what}")


def _indexed_weights(r: int, out_rows: int) -> np.ndarray:
    return np.random.default_rng([5, r]).standard_normal((out_rows, 2)).astype(np.float32)


def _indexed_grad(r: int, n: int, repeat: int, out_rows: int) -> np.ndarray:
    """NumPy: the gradient of every rank's sum(y * w) for rank r's x. Each rank's weights of the
    rows it received (in arrival order) travel back to their senders, and add up into the rows
    of x they were gathered from."""
    cases = [_indexed_case(j, n, repeat) for j in range(n)]
    arrived = [_indexed_weights(j, out_rows)[cases[j][2][: sum(_recv(j, n))]] for j in range(n)]
    back = _exchange(arrived, [_recv(j, n) for j in range(n)])[r]
    x, si, _ = cases[r]
    g = np.zeros_like(x)
    np.add.at(g, si[: back.shape[0]] // repeat, back)
    return g


@multirank(nprocs=(2,))
def test_indexed_bad_index_is_an_error_on_every_rank(comm):
    from spmd.ops import all_to_allv_indexed

    r, n = comm.rank, comm.size
    send, recv = _send(r, n), _recv(r, n)
    f = jax.jit(
        lambda x, si, ri: all_to_allv_indexed(
            x, send, recv, send_index=si, repeat=2, recv_index=ri, out_rows=sum(recv) + 2
        )
    )
    for name in _transports(comm):
        with _transport(name):
            x, si, ri = _indexed_case(r, n, 2)
            # Rank 0 sends rows and rank 1 receives some (the last rank sends none, _send).
            bad = si.copy()
            if r == 0:
                bad[1] = bad[0]
            own = f"rank 0: all_to_allv: send_index[1] = {si[0]} repeats an earlier entry"
            peer = "rank 1: all_to_allv: rank 0 passed a send_index or recv_index that is out"
            _raises(lambda x=x, bad=bad, ri=ri: f(x, bad, ri), own if r == 0 else peer,
                    exc=jax.errors.JaxRuntimeError)  # fmt: skip
            far = ri.copy()
            if r == 1:
                far[0] = sum(recv) + 5
            text = f"rank 1: all_to_allv: recv_index[0] = {sum(recv) + 5} is out of range"
            _raises(lambda x=x, si=si, far=far: f(x, si, far),
                    text if r == 1 else "rank 1 passed a send_index",
                    exc=jax.errors.JaxRuntimeError)  # fmt: skip
            close(f(x, si, ri), _indexed_expected(r, n, 2, sum(recv) + 2), f"after, {name}")
