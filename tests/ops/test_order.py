"""Program order through ``lax`` control flow: a scan, while loop, fori_loop or cond holding
collectives runs in its place among the collectives around it, also when ranks run different
programs, and XLA's optimisation keeps that order (checked on the compiled HLO)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import spmd
from spmd.testing import multirank

BIG = 1 << 20  # 4 MiB of float32: past MPI's eager limit, a send waits for its receive


def _entry_graph(hlo: str) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """The ENTRY computation of compiled HLO text: each instruction's operands (names defined in
    ENTRY), and (name, line) in order."""
    entry = hlo[hlo.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    lines = [ln.strip() for ln in entry.splitlines()[1:] if " = " in ln]
    names = [re.match(r"(?:ROOT )?(%[\w.\-]+) = ", ln).group(1) for ln in lines]  # type: ignore[union-attr]
    defined = set(names)
    graph = {
        name: {t for t in re.findall(r"%[\w.\-]+", ln.split(" = ", 1)[1]) if t in defined}
        for name, ln in zip(names, lines, strict=True)
    }
    return graph, list(zip(names, lines, strict=True))


def _depends(graph: dict[str, set[str]], later: str, earlier: str) -> bool:
    seen, todo = set(), [later]
    while todo:
        for op in graph[todo.pop()]:
            if op == earlier:
                return True
            if op not in seen:
                seen.add(op)
                todo.append(op)
    return False


def _one(lines: list[tuple[str, str]], pattern: str) -> str:
    found = [name for name, ln in lines if re.search(pattern, ln)]
    assert len(found) == 1, (pattern, found)
    return found[0]


@multirank(nprocs=(2,))
def test_loops_and_branches_stay_between_their_neighbours_after_optimisation(comm):
    """allgather, then a loop or branch holding collectives, then broadcast: the data of the
    three are independent, so only the order value ties them. In the compiled program the loop
    must take the allgather's order value and the broadcast the loop's."""
    x = jnp.arange(4.0)

    def around(block):
        def fn(v):
            first = spmd.allgather(v)
            mid = block(v)
            return first, mid, spmd.broadcast(jnp.ones(3))

        return fn

    blocks = {
        "scan": (lambda v: lax.scan(lambda c, _: (spmd.allreduce(c), None), v, None, length=3)[0],
                 r" while\(%"),
        "fori_loop": (lambda v: lax.fori_loop(0, 2, lambda i, c: c + spmd.allreduce(c), v),
                      r" while\(%"),
        "while_loop": (lambda v: lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, spmd.allreduce(c[1])), (0, v))[1],
            r" while\(%"),
        "cond": (lambda v: lax.cond(v[0] > 0, spmd.allreduce, lambda c: c * 2, v),
                 r" conditional\(%"),
        "predicate-only loop": (lambda v: lax.while_loop(
            lambda c: spmd.allreduce(c[0]) < 3.0 * comm.size,
            lambda c: (c[0] + 1.0, c[1] * 2), (0.0, v))[1],
            r" while\(%"),
        "loop over a vmapped loop": (lambda v: lax.fori_loop(
            0, 2, lambda i, c: jax.vmap(lambda x, k: lax.while_loop(
                lambda d: d[0] < k, lambda d: (d[0] + 1, spmd.allreduce(d[1])), (0, x))[1])(
                    c, jnp.array([1, 2, 3, 4])), v),
            r" while\(%"),
        "send-only loop": (lambda v: lax.fori_loop(
            0, 2, lambda i, c: (spmd.send(c, dst=1 - comm.rank), c)[1], v),
            r" while\(%"),
    }  # fmt: skip
    for name, (block, pattern) in blocks.items():
        graph, lines = _entry_graph(jax.jit(around(block)).lower(x).compile().as_text())
        gather = _one(lines, r'custom_call_target="spmd_allgather"')
        loop = _one(lines, pattern)
        bcast = _one(lines, r'custom_call_target="spmd_broadcast"')
        assert _depends(graph, loop, gather), f"{name}: the loop does not wait for the allgather"
        assert _depends(graph, bcast, loop), f"{name}: the broadcast does not wait for the loop"

    # A loop without collectives is lowered as JAX lowers it: nothing added to its carry.
    plain = jax.jit(lambda v: lax.fori_loop(0, 2, lambda i, c: c * 2, v)).lower(x).as_text()
    assert "ui8" not in plain


@multirank(nprocs=(2, 3), env={"SPMD_TIMEOUT": "20"})
def test_loops_and_branches_keep_program_order_in_programs_that_differ_by_rank(comm):
    """Pipeline-style programs: rank 0 sends from a loop (or a branch) and then all-reduces;
    rank 1 receives (plainly, or in a loop of its own) and then all-reduces. Run out of order,
    rank 0 would wait in the allreduce while rank 1 waits for the message (a timeout)."""
    r, n = comm.rank, comm.size
    total = n * (n + 1) / 2
    w = jnp.full(8, float(r + 1))

    @jax.jit
    def send_loop(x, w):
        before = spmd.allreduce(w)
        lax.fori_loop(0, 3, lambda i, c: (spmd.send(c + i, dst=1), c)[1], x)
        return before, spmd.allreduce(w)

    @jax.jit
    def recv_loop(w):
        before = spmd.allreduce(w)
        got = lax.fori_loop(
            0, 3, lambda i, c: c + spmd.recv(jnp.zeros(BIG, jnp.float32), src=0), jnp.zeros(BIG)
        )
        return got, before, spmd.allreduce(w)

    @jax.jit
    def send_after_predicate(x, w):
        lax.while_loop(lambda c: spmd.allreduce(c) < 3.0 * n, lambda c: c + 1.0, jnp.float32(0))
        spmd.send(x, dst=1)
        return spmd.allreduce(w)

    @jax.jit
    def recv_after_allreduces(w):
        for k in range(4):  # what rank 0's predicate makes: sums 0, n, 2n, 3n
            spmd.allreduce(jnp.float32(k))
        return spmd.recv(jnp.zeros(BIG, jnp.float32), src=0), spmd.allreduce(w)

    @jax.jit
    def others_after_allreduces(w):
        for k in range(4):
            spmd.allreduce(jnp.float32(k))
        return spmd.allreduce(w)

    @jax.jit
    def send_branch(x, w):
        lax.cond(x[0] > 0, lambda v: spmd.send(v, dst=1), lambda v: spmd.send(-v, dst=1), x)
        return spmd.allreduce(w)

    @jax.jit
    def recv_plain(w):
        return spmd.recv(jnp.zeros(BIG, jnp.float32), src=0), spmd.allreduce(w)

    @jax.jit
    def others(w):
        return spmd.allreduce(w), spmd.allreduce(w)

    if r == 0:
        before, after = send_loop(jnp.ones(BIG), w)
        np.testing.assert_array_equal(after, np.full(8, total))
        np.testing.assert_array_equal(send_branch(jnp.ones(BIG), w), np.full(8, total))
        np.testing.assert_array_equal(send_after_predicate(jnp.ones(BIG), w), np.full(8, total))
    elif r == 1:
        got, before, after = recv_loop(w)
        np.testing.assert_array_equal(got, np.full(BIG, 1.0 + 2.0 + 3.0))
        np.testing.assert_array_equal(after, np.full(8, total))
        got, s = recv_plain(w)
        np.testing.assert_array_equal(got, np.ones(BIG))
        np.testing.assert_array_equal(s, np.full(8, total))
        got, s = recv_after_allreduces(w)
        np.testing.assert_array_equal(got, np.ones(BIG))
        np.testing.assert_array_equal(s, np.full(8, total))
    else:
        before, after = others(w)
        np.testing.assert_array_equal(after, np.full(8, total))
        np.testing.assert_array_equal(jax.jit(spmd.allreduce)(w), np.full(8, total))
        np.testing.assert_array_equal(others_after_allreduces(w), np.full(8, total))
    np.testing.assert_array_equal(before, np.full(8, total))


@multirank(nprocs=(2,))
def test_threaded_loops_compute_what_they_did(comm):
    """The rewrite adds only the order value: nested control flow, a collective in a loop's
    predicate, a predicate batched by vmap, effects, PRNG keys, unrolling and the transpose of
    a scan give the values they give without it."""
    r, n = comm.rank, comm.size

    def nested(x):
        def body(c):
            k, v = c
            v = lax.cond(
                k % 2 == 0,
                lambda u: lax.scan(lambda s, _: (spmd.allreduce(s), None), u, None, length=2)[0],
                lambda u: u + 1.0,
                v,
            )
            return k + 1, v

        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    # k=0: x * n^2; k=1: + 1; k=2: (x n^2 + 1) n^2.
    np.testing.assert_array_equal(jax.jit(nested)(jnp.ones(2)), np.full(2, (n * n + 1) * n * n))

    def in_predicate(x):
        return lax.while_loop(
            lambda c: spmd.allreduce(c[0]) < 10.0 * n,
            lambda c: (c[0] + 1.0, spmd.allreduce(c[1])),
            (x, jnp.ones(2)),
        )

    k, v = jax.jit(in_predicate)(jnp.float32(0))
    assert float(k) == 10.0
    np.testing.assert_array_equal(v, np.full(2, float(n**10)))

    def batched(limit):
        return lax.while_loop(
            lambda c: c[0] < c[1],
            lambda c: (c[0] + 1.0, c[1], spmd.allreduce(c[2])),
            (jnp.float32(0), limit, jnp.float32(1)),
        )[2]

    np.testing.assert_array_equal(jax.jit(jax.vmap(batched))(jnp.array([1.0, 2.0])), [n, n * n])

    def batched_predicate_holding_a_collective(limit):
        return lax.while_loop(
            lambda c: spmd.allreduce(c[0]) < c[1] * n,
            lambda c: (c[0] + 1.0, c[1], c[2] * 2.0),
            (jnp.float32(0), limit, jnp.float32(1)),
        )

    k, _, v = jax.jit(jax.vmap(batched_predicate_holding_a_collective))(jnp.array([1.0, 3.0]))
    np.testing.assert_array_equal(k, [1.0, 3.0])
    np.testing.assert_array_equal(v, [2.0, 8.0])

    def with_effect(x):
        def pred(c):
            jax.debug.callback(lambda: None, ordered=True)
            return c[0] < 2

        return lax.while_loop(pred, lambda c: (c[0] + 1, spmd.allreduce(c[1])), (0, x))[1]

    np.testing.assert_array_equal(jax.jit(with_effect)(jnp.ones(2)), np.full(2, n * n))

    def keys(key):
        def body(c, _):
            key, s = c
            key, sub = jax.random.split(key)
            return (key, s + spmd.allreduce(jax.random.normal(sub, ()) * (r + 1))), None

        return lax.scan(body, (key, 0.0), None, length=3)[0][1]

    expected = 0.0
    key = jax.random.key(0)
    for _ in range(3):
        key, sub = jax.random.split(key)
        expected += float(jax.random.normal(sub, ())) * n * (n + 1) / 2
    np.testing.assert_allclose(jax.jit(keys)(jax.random.key(0)), expected, rtol=1e-5)

    unrolled = jax.jit(
        lambda x: lax.scan(lambda c, _: (spmd.allreduce(c), None), x, None, length=4, unroll=2)[0]
    )
    np.testing.assert_array_equal(unrolled(jnp.ones(2)), np.full(2, float(n**4)))

    # The transposed scan runs its allreduces in reverse: the gradient against finite
    # differences of the global objective (the sum of every rank's), computed here in NumPy.
    def loss(w):
        c, _ = lax.scan(lambda c, _: (spmd.allreduce(c * w), None), jnp.ones(2), None, length=2)
        return c.sum()

    ws = np.arange(1.0, n + 1.0)

    def global_objective(ws):
        c = np.ones(2)
        for _ in range(2):
            c = sum(c * w for w in ws)
        return n * c.sum()

    eps = 1e-3
    bumped = ws.copy()
    bumped[r] += eps
    lowered = ws.copy()
    lowered[r] -= eps
    fd = (global_objective(bumped) - global_objective(lowered)) / (2 * eps)
    g = jax.jit(jax.grad(loss))(jnp.float32(ws[r]))
    np.testing.assert_allclose(float(g), fd, rtol=1e-4)
