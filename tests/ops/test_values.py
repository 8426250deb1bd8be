"""Every collective x dtype x grouping form, eager and inside jit, on 1-4 ranks, checked against
NumPy references; pytrees of all dtypes go in one fused call. Plus RAF's allreduce table."""

from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank
from tests import HEAVY

from ._cases import DTYPES, FLOATS, close, forms, inputs, reduce_ref, value, x64


def _expected(form, comm):
    """What each op returns on this rank for the inputs of _run_ops."""
    members, p, g = form.members, form.position, len(form.members)
    exp = {}
    for op in ("sum", "max", "min", "prod"):
        exp[f"allreduce_{op}"] = {d: reduce_ref([value(m, d) for m in members], op) for d in DTYPES}
    exp["allreduce_avg"] = {d: reduce_ref([value(m, d) for m in members], "avg") for d in FLOATS}
    exp["allgather_0"] = {d: np.concatenate([value(m, d) for m in members], 0) for d in DTYPES}
    exp["allgather_1"] = {d: np.concatenate([value(m, d) for m in members], 1) for d in DTYPES}
    rs_in = {d: [value(m, d, (2 * g, 3)) for m in members] for d in DTYPES}
    exp["reduce_scatter"] = {d: reduce_ref(rs_in[d], "sum")[2 * p : 2 * p + 2] for d in DTYPES}
    exp["reduce_scatter_max_1"] = {
        d: reduce_ref([value(m, d, (3, 2 * g)) for m in members], "max")[:, 2 * p : 2 * p + 2]
        for d in DTYPES
    }
    exp["broadcast"] = {d: value(members[-1], d) for d in DTYPES}
    # all_to_all(split 0, concat 1): block p of each member, side by side in member order.
    exp["all_to_all"] = {
        d: np.concatenate([value(m, d, (2 * g, 3))[2 * p : 2 * p + 2] for m in members], 1)
        for d in DTYPES
    }
    sizes = list(range(1, g + 1))
    exp["allgatherv"] = {
        d: np.concatenate([value(m, d, (sizes[i], 3)) for i, m in enumerate(members)], 0)
        for d in DTYPES
    }
    off = sum(sizes[:p])
    exp["reduce_scatterv"] = {
        d: reduce_ref([value(m, d, (sum(sizes), 3)) for m in members], "sum")[off : off + sizes[p]]
        for d in DTYPES
    }
    exp["sendrecv"] = {d: value(members[(p - 1) % g], d) for d in DTYPES}
    return exp


def _run_ops(form, comm):
    """Every op on a dict of all dtypes (one fused call per op)."""
    g, p, r = len(form.members), form.position, comm.rank
    kw = form.kwargs
    x = inputs(r)
    out = {}
    for op in ("sum", "max", "min", "prod"):
        out[f"allreduce_{op}"] = spmd.allreduce(x, op, **kw)
    out["allreduce_avg"] = spmd.allreduce({d: x[d] for d in FLOATS}, "avg", **kw)
    out["allgather_0"] = spmd.allgather(x, **kw)
    out["allgather_1"] = spmd.allgather(x, axis=1, **kw)
    out["reduce_scatter"] = spmd.reduce_scatter(inputs(r, shape=(2 * g, 3)), **kw)
    out["reduce_scatter_max_1"] = spmd.reduce_scatter(
        inputs(r, shape=(3, 2 * g)), "max", axis=1, **kw
    )
    out["broadcast"] = spmd.broadcast(x, root=g - 1, **kw)
    out["all_to_all"] = spmd.all_to_all(
        inputs(r, shape=(2 * g, 3)), split_axis=0, concat_axis=1, **kw
    )
    sizes = list(range(1, g + 1))
    out["allgatherv"] = spmd.allgatherv(inputs(r, shape=(sizes[p], 3)), sizes, **kw)
    out["reduce_scatterv"] = spmd.reduce_scatterv(inputs(r, shape=(sum(sizes), 3)), sizes, **kw)
    out["sendrecv"] = spmd.sendrecv(x, src=(p - 1) % g, dst=(p + 1) % g, **kw)
    spmd.barrier(**kw)
    return out


def _check(out, form, comm, mode):
    for key, per_dtype in _expected(form, comm).items():
        for d, expected in per_dtype.items():
            close(out[key][d], expected, f"{mode} {form.name} {key} {d}")


@multirank(timeout=HEAVY)
def test_every_op_dtype_and_form_eager(comm):
    with x64():
        for form in forms(comm):
            with form.active():
                _check(_run_ops(form, comm), form, comm, "eager")


@multirank()
def test_every_op_dtype_and_form_in_jit(comm):
    with x64():
        for form in forms(comm):
            with form.active():
                # The function closes over the form; its inputs are built inside from the rank.
                out = jax.jit(lambda form=form: _run_ops(form, comm))()
                _check(out, form, comm, "jit")


@multirank(nprocs=(2,))
def test_an_eager_call_on_a_pytree_lowers_one_program_per_step_not_per_leaf(comm):
    """Called eagerly, the moves around a gather, scatter or exchange are one program for all
    leaves, and none where the axis stays (jnp.moveaxis alone lowers a program per leaf, even to
    move nothing). Counted as lowerings, which JAX's compilation cache does not skip."""
    lowered = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        # Leaves of shapes no other test uses, so that nothing is in JAX's caches yet.
        tree = {d: jnp.ones((4, 10 + i), d) for i, d in enumerate(("float32", "int32", "uint8"))}
        expected = {
            "allgather axis 0": 1,  # the collective
            "allgather axis 1": 3,  # moves in, the collective, moves out
            "reduce_scatter axis 0": 1,
            "all_to_all": 3,  # blocks, the exchange, the concatenation
        }
        calls = {
            "allgather axis 0": lambda: spmd.allgather(tree),
            "allgather axis 1": lambda: spmd.allgather(tree, axis=1),
            "reduce_scatter axis 0": lambda: spmd.reduce_scatter(tree),
            "all_to_all": lambda: spmd.all_to_all(tree, split_axis=0, concat_axis=1),
        }
        for name, call in calls.items():
            before = len(lowered)
            jax.block_until_ready(call())
            assert len(lowered) - before == expected[name], (name, len(lowered) - before)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@multirank(nprocs=(4,))
def test_raf_allreduce_table(comm):
    """RAF: inputs [1, 2, 3, 4] on ranks 0..3."""
    x = jnp.float32(comm.rank + 1)
    assert float(spmd.allreduce(x)) == 10
    assert float(spmd.allreduce(x, rank_list=[[0, 1], [2, 3]])) == [3, 3, 7, 7][comm.rank]
    assert float(spmd.allreduce(x, rank_list=[[0, 1, 2], [3]])) == [6, 6, 6, 4][comm.rank]
    assert float(spmd.allreduce(x, rank_list=[[0, 1, 2]])) == [6, 6, 6, 4][comm.rank]
    f = jax.jit(lambda x: spmd.allreduce(x, rank_list=[[0, 1], [2, 3]]))
    assert float(f(x)) == [3, 3, 7, 7][comm.rank]


@multirank(nprocs=(2, 3, 4))
def test_send_recv_pairs(comm):
    r, n = comm.rank, comm.size
    x = {"a": jnp.arange(4.0) + r, "b": jnp.int32(r)}
    for mode in ("eager", "jit"):
        if r % 2 == 0 and r + 1 < n:
            f = (
                (lambda v: spmd.send(v, r + 1))
                if mode == "eager"
                else jax.jit(lambda v: spmd.send(v, r + 1))
            )
            assert f(x) is None
        elif r % 2 == 1:
            recv = lambda: spmd.recv(x, r - 1)  # noqa: E731
            got = recv() if mode == "eager" else jax.jit(recv)()
            np.testing.assert_array_equal(got["a"], np.arange(4.0) + r - 1)
            assert int(got["b"]) == r - 1


@multirank(nprocs=(2, 4), env={"SPMD_TIMEOUT": "20"})
def test_a_send_does_not_wait_for_its_receiver(comm):
    """Every rank sends 16 MiB (far past MPI's eager limit) to its right neighbour, then three
    small messages, and only then receives from its left: with sends that waited for their
    receivers, every rank would wait in its first send until SPMD_TIMEOUT. The messages arrive
    whole and in order; each rank's buffer is reused at once (the send copied it)."""
    r, n = comm.rank, comm.size
    big = np.arange(4 << 20, dtype=np.float32) + r
    for mode in ("eager", "jit"):
        send = spmd.send if mode == "eager" else jax.jit(spmd.send, static_argnums=1)

        def recv(like, src, mode=mode):
            return (
                spmd.recv(like, src) if mode == "eager" else jax.jit(lambda: spmd.recv(like, src))()
            )

        x = jnp.asarray(big)
        send(x, (r + 1) % n)
        for k in range(3):
            send(jnp.full(5, 10.0 * k + r), (r + 1) % n)
        del x
        left = (r - 1) % n
        got = np.asarray(recv(jax.ShapeDtypeStruct(big.shape, big.dtype), left))
        np.testing.assert_array_equal(got, np.arange(4 << 20, dtype=np.float32) + left)
        for k in range(3):
            np.testing.assert_array_equal(recv(jnp.zeros(5), left), np.full(5, 10.0 * k + left))


# MPICH reads a large message straight from its sender's memory (CMA) where the kernel lets it;
# where it may not (a container that forbids ptrace), the message crosses shared memory in cells
# that only the sender's MPI calls fill.
_NO_DIRECT_COPY = {"MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD": "1000000000", "SPMD_TIMEOUT": "20"}


@multirank(nprocs=(2,), env=_NO_DIRECT_COPY, fresh=True)
def test_a_send_moves_while_its_sender_waits_in_a_collective(comm):
    """Rank 1 sends 32 MiB to rank 0 and then waits in a collective over shared memory, which
    calls no MPI; rank 0 starts receiving only then, and joins the collective once it has the
    whole message. Sends that
    moved only inside their sender's MPI calls left rank 0 waiting for the rest of the message
    and rank 1 waiting for rank 0, until SPMD_TIMEOUT (the progress thread moves them)."""
    big = np.arange(8 << 20, dtype=np.float32)
    assert int(spmd.allreduce(jnp.int32(1))) == 2  # (shared memory set up: it calls MPI)
    if comm.rank == 1:
        spmd.send(jnp.asarray(big), dst=0)
    else:
        time.sleep(0.5)  # rank 1 is in the collective by now
        got = spmd.recv(jax.ShapeDtypeStruct(big.shape, big.dtype), src=1)
        np.testing.assert_array_equal(np.asarray(got), big)
    assert int(spmd.allreduce(jnp.int32(comm.rank + 1))) == 3
    assert spmd.ops.get_transport() == "shm"


@multirank(nprocs=(3,), fresh=True)
def test_point_to_point_on_the_world_needs_no_call_from_other_ranks(comm):
    """In a fresh process, before any collective: rank 0 sends to rank 1 while rank 2 makes no
    call at all (registering the world for point to point involves no other rank); the first
    collective then sets up shared memory with every rank."""
    if comm.rank == 0:
        spmd.send(jnp.arange(3.0), dst=1)
        spmd.send(jnp.arange(3.0) * 2, dst=1)
    elif comm.rank == 1:
        np.testing.assert_array_equal(spmd.recv(jnp.zeros(3), src=0), [0, 1, 2])
        got = jax.jit(lambda: spmd.recv(jnp.zeros(3), src=0))()
        np.testing.assert_array_equal(got, [0, 2, 4])
    assert int(spmd.allreduce(jnp.int32(comm.rank + 1))) == 6
    assert spmd.ops.get_transport() == "shm"


@multirank(nprocs=(2, 3))
def test_results_identical_on_every_rank(comm):
    """Fixed reduction order: float sums are bit-identical everywhere, both algorithms."""
    rng = np.random.default_rng(comm.rank)
    for n in (17, 1 << 20):  # one-shot and two-shot
        x = jnp.asarray(rng.standard_normal(n).astype(np.float32))
        y = np.asarray(jax.jit(spmd.allreduce)(x))
        for other in comm.allgather_object(y.tobytes()):
            assert other == y.tobytes()


@multirank(nprocs=(2, 3))
def test_collectives_run_in_program_order(comm):
    """Many independent collectives of different shapes in one jit: XLA may run independent
    custom calls in any order; the chain keeps them ordered (a mismatch would raise)."""

    def many(xs):
        return [spmd.allreduce(x) for x in xs] + [spmd.allgather(x) for x in xs]

    xs = [jnp.full((1000 + 7 * i,), float(comm.rank + i)) for i in range(24)]
    out = jax.jit(many)(xs)
    n = comm.size
    for i in range(24):
        np.testing.assert_allclose(out[i], sum(k + i for k in range(n)))
        assert out[24 + i].shape == ((1000 + 7 * i) * n,)


@multirank(nprocs=(2, 3), env={"SPMD_TIMEOUT": "20"})
def test_nested_jit_keeps_program_order_in_programs_that_differ_by_rank(comm):
    """A collective inside a nested ``jax.jit`` runs in its place in the caller's order. Ranks
    whose programs differ (pipeline stages) depend on it: rank 0 sends from a jitted helper and
    then all-reduces, rank 1 receives and then all-reduces. Run out of order, rank 0 would wait
    in the allreduce while rank 1 waits for the message (a timeout); or, when only one rank nests
    its call, the ranks would pair different collectives (a mismatch)."""
    r, n = comm.rank, comm.size
    big = 1 << 20  # 4 MiB: past MPI's eager limit, a send waits for its receive
    send_helper = jax.jit(lambda y: spmd.send(y, dst=1))

    @jax.jit
    def stage0(x, w):
        send_helper(jnp.tanh(x) * 2.0)
        return spmd.allreduce(w)

    @jax.jit
    def stage1(w):
        return spmd.recv(jnp.zeros(big, jnp.float32), src=0), spmd.allreduce(w)

    w = jnp.full(8, float(r + 1))
    total = n * (n + 1) / 2
    if r == 0:
        np.testing.assert_array_equal(stage0(jnp.ones(big), w), np.full(8, total))
    elif r == 1:
        y, s = stage1(w)
        np.testing.assert_allclose(y, np.full(big, np.tanh(1.0) * 2.0), rtol=1e-6)
        np.testing.assert_array_equal(s, np.full(8, total))
    else:
        np.testing.assert_array_equal(jax.jit(spmd.allreduce)(w), np.full(8, total))

    # The same calls in the same order; only rank 0 wraps the second in a jitted helper (and in
    # a helper of a helper). Big enough that XLA would rather start it first.
    inner = jax.jit(lambda v: spmd.allreduce(v, op="max"))
    nested = jax.jit(lambda v: inner(v) * 1.0)
    a, b = jnp.full(1 << 16, float(r)), jnp.arange(1000.0) + r

    @jax.jit
    def calls(a, b):
        first = spmd.allreduce(a)
        return first, (nested(b) if r == 0 else spmd.allreduce(b, op="max"))

    first, second = calls(a, b)
    np.testing.assert_array_equal(first, np.full(1 << 16, n * (n - 1) / 2))
    np.testing.assert_array_equal(second, np.arange(1000.0) + n - 1)

    # A helper's result used on some ranks only: where it is discarded, the call still runs.
    helper = jax.jit(lambda v: spmd.allreduce(v))

    @jax.jit
    def discard(v):
        s = helper(v)
        t = spmd.allgather(v)
        return (t, s) if r else (t,)

    out = discard(jnp.float32(r).reshape(1))
    np.testing.assert_array_equal(out[0], np.arange(n, dtype=np.float32))
    if r:
        np.testing.assert_array_equal(out[1], [n * (n - 1) / 2])


@multirank(nprocs=(2,))
def test_loops_and_branches_holding_collectives_are_never_dead_code(comm):
    """As a collective whose result is unused stays in the program, so does a scan, loop or
    branch holding one: removed on the ranks that discard its result, it would leave the others
    waiting."""
    x = jnp.ones(3)

    def scan(v):
        jax.lax.scan(lambda c, _: (spmd.allreduce(c), None), v, None, length=2)
        return v * 2

    def loop(v):
        jax.lax.fori_loop(0, 2, lambda i, c: spmd.allreduce(c), v)
        return v * 2

    def branch(v):
        jax.lax.cond(v[0] > 0, lambda c: spmd.allreduce(c), lambda c: c, v)
        return v * 2

    for fn in (scan, loop, branch):
        assert "spmd_allreduce" in jax.jit(fn).lower(x).as_text(), fn.__name__
        np.testing.assert_array_equal(jax.jit(fn)(x), 2 * np.ones(3))


@multirank(nprocs=(2,))
def test_eager_calls_compile_once(comm):
    from jax._src import dispatch

    x = jnp.ones((3,))
    spmd.allreduce(x)
    before = dispatch.xla_primitive_callable.cache_info().misses
    for _ in range(5):
        spmd.allreduce(x + 1)
    assert dispatch.xla_primitive_callable.cache_info().misses == before


def _large_outputs(comm):
    """Outputs over 16 MiB are written with streaming stores: odd leaf sizes (so leaves start
    off 16-byte boundaries inside the fused buffer) must still land exactly. Calls from 1 MiB
    also stage streamed or cached (SPMD_SHM_STAGING; automatic: as a probe decides)."""
    r, n = comm.rank, comm.size
    sizes = (5, (1 << 22) + 3, 1 << 21)  # ~24 MiB of float32 in one fused allreduce
    x = [(jnp.arange(s) % 1024).astype(jnp.float32) * (r + 1) + r for s in sizes]  # exact
    out = jax.jit(lambda t: spmd.allreduce(t))(x)
    tri = n * (n + 1) // 2
    for s, got in zip(sizes, out, strict=True):
        np.testing.assert_array_equal(
            np.asarray(got), (np.arange(s) % 1024).astype(np.float32) * tri + n * (n - 1) // 2
        )
    # Every element distinct, so that a byte landing one place off shows. The allgather's own
    # block is staged and streamed in one pass; rank 1's starts 4 bytes off a 16-byte boundary.
    k = (1 << 22) + 5  # int32: 16 MiB + 20 bytes per block
    big = jnp.arange(k, dtype=jnp.int32) * 3 + r
    g = np.asarray(jax.jit(spmd.allgather)(big))
    np.testing.assert_array_equal(
        g, np.concatenate([np.arange(k, dtype=np.int32) * 3 + q for q in range(n)])
    )
    b = np.asarray(jax.jit(lambda v: spmd.broadcast(v, root=n - 1))(big))
    np.testing.assert_array_equal(b, np.arange(k, dtype=np.int32) * 3 + n - 1)
    # reduce_scatter of a block over 16 MiB, staged pieces and a short last one.
    rb = (1 << 22) + 3
    mine = jnp.arange(n * rb, dtype=jnp.int32) + 7 * r
    rs = np.asarray(jax.jit(spmd.reduce_scatter)(mine))
    want = n * np.arange(r * rb, (r + 1) * rb, dtype=np.int32) + 7 * n * (n - 1) // 2
    np.testing.assert_array_equal(rs, want)
    blocks = jnp.arange(n * ((1 << 22) + 1), dtype=jnp.int32) + r * 7
    a = np.asarray(jax.jit(spmd.all_to_all)(blocks)).reshape(n, -1)
    blk = (1 << 22) + 1
    for j in range(n):
        np.testing.assert_array_equal(a[j], np.arange(r * blk, (r + 1) * blk) + j * 7)
    # all_to_allv zeros the rows past those received, streamed in an output over 16 MiB: rows
    # of 12 bytes, so that the zeros start off a 32-byte boundary. The first call fills the
    # output but for its last out_rows % n rows; it is freed before the second, which receives
    # 1001-1003 rows from each rank. The allocator tends to hand the second call the same
    # memory (a mutation that zeroed half the rows failed this test).
    out_rows = (16 << 20) // 12 + 3
    full = n * (out_rows // n)
    a2av = jax.jit(lambda v, c: spmd.all_to_allv(v, c, out_rows=out_rows))
    for rows in (full, 1001 + r):
        v = (jnp.arange(rows * 3, dtype=jnp.float32).reshape(rows, 3) + 1) * (r + 1)
        counts = jnp.full((n,), rows // n, jnp.int32).at[0].add(rows % n)
        got = np.asarray(a2av(v, counts))
        sent = [(full if rows == full else 1001 + q) for q in range(n)]
        want, at = [], 0
        for q in range(n):  # rank q's block for this rank: its rows [off, off + count)
            cq = [sent[q] // n + (sent[q] % n if j == 0 else 0) for j in range(n)]
            off = sum(cq[:r])
            vq = (np.arange(sent[q] * 3, dtype=np.float32).reshape(-1, 3) + 1) * (q + 1)
            want.append(vq[off : off + cq[r]])
            at += cq[r]
        np.testing.assert_array_equal(got[:at], np.concatenate(want))
        np.testing.assert_array_equal(got[at:], 0)
        del got


@multirank(nprocs=(2, 3))
def test_large_outputs(comm):
    _large_outputs(comm)


@multirank(nprocs=(2, 3), env={"SPMD_SHM_STAGING": "cached"})
def test_large_outputs_staged_cached(comm):
    _large_outputs(comm)


@multirank(nprocs=(2, 4), env={"SPMD_SHM_STAGING": "streamed"})
def test_large_outputs_staged_streamed(comm):
    """Streamed staging: slots written with non-temporal stores, fenced before each sync; 4
    ranks on fewer cores stream too when told to (the automatic mode would not)."""
    _large_outputs(comm)
    _mid_size_copies(comm)


@multirank(nprocs=(2, 3))
def test_mid_size_copies_in_pieces(comm):
    """Broadcast and allgather between 512 KiB and 8 MiB move in pieces smaller than the staging
    chunk, several per call: blocks that end inside a piece, and ranks whose block runs out
    pieces before the others', must land exactly."""
    _mid_size_copies(comm)


def _mid_size_copies(comm):
    r, n = comm.rank, comm.size
    k = (1 << 18) + 7  # int32: 1 MiB + 28 bytes, pieces of 128 KiB + a short last one
    b = np.asarray(jax.jit(lambda v: spmd.broadcast(v, root=n - 1))(jnp.arange(k) * (r + 1)))
    np.testing.assert_array_equal(b, np.arange(k) * n)
    m = 200003  # float32 blocks of 800 KB: pieces of 100 KB
    g = np.asarray(jax.jit(spmd.allgather)(jnp.arange(m, dtype=jnp.float32) + r))
    want = np.concatenate([np.arange(m, dtype=np.float32) + q for q in range(n)])
    np.testing.assert_array_equal(g, want)
    sizes = [(1 << 19) + 3, 5, (1 << 16) + 1, 1 << 17][:n]  # the largest: pieces of 256 KiB
    mine = jnp.arange(sizes[r], dtype=jnp.int32) + 1000 * r
    v = np.asarray(jax.jit(lambda x: spmd.allgatherv(x, sizes))(mine))
    np.testing.assert_array_equal(
        v, np.concatenate([np.arange(s, dtype=np.int32) + 1000 * q for q, s in enumerate(sizes)])
    )


def _half_inputs(rank: int, dtype) -> np.ndarray:
    """Values over a wide range of magnitudes, float16's subnormals included, and round halfway
    cases: their sums exercise every branch of the rounding back to the half type."""
    rng = np.random.default_rng(100 + rank)
    wide = rng.standard_normal(4093) * 2.0 ** rng.integers(-26, 12, 4093)
    ties = np.array([1.0, 2.0**-11, 2.0**-24, 3 * 2.0**-24, 2.0**-15, 6.0e4, -(2.0**-17), 0.0])
    return np.concatenate([wide, ties]).astype(dtype)


@multirank(nprocs=(2, 3, 4))
def test_half_precision_sums_round_once_to_nearest_even(comm):
    """float16/bfloat16 reductions widen to float32, combine in rank order and round once (to
    nearest even, subnormals kept, overflow to inf): bit for bit what NumPy computes that way.
    MPI adds the float32 values in an order of its own beyond 2 ranks (the same on every rank):
    there the result is checked to be identical everywhere and within rounding of it."""
    r, n = comm.rank, comm.size
    try:
        for transport in ("shm", "mpi"):
            spmd.ops.set_transport(transport)
            for dtype in (np.float16, jnp.bfloat16):
                ins = [_half_inputs(k, dtype) for k in range(n)]
                acc = ins[0].astype(np.float32)
                for x in ins[1:]:
                    acc = acc + x.astype(np.float32)
                want = acc.astype(dtype)
                got = np.asarray(jax.jit(spmd.allreduce)(jnp.asarray(ins[r])))
                if transport == "shm" or n == 2:
                    bad = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
                    assert bad.size == 0, (transport, dtype, bad[:5], got[bad[:5]], want[bad[:5]])
                else:
                    assert len(set(comm.allgather_object(got.tobytes()))) == 1
                    np.testing.assert_allclose(
                        got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=2.0**-24
                    )
                most = np.asarray(jax.jit(lambda v: spmd.allreduce(v, "max"))(jnp.asarray(ins[r])))
                np.testing.assert_array_equal(  # as values: the sign of a zero max may differ
                    most.astype(np.float32), np.maximum.reduce(ins).astype(np.float32)
                )
    finally:
        spmd.ops.set_transport("auto")


@multirank(nprocs=(2, 3))
def test_half_precision_averages_divide_before_rounding(comm):
    """op="avg" of float16/bfloat16: the float32 sum is divided by the group size and rounded
    once, so an average within range never overflows on the way (40000 + 40000 is beyond
    float16's 65504) and matches NumPy bit for bit."""
    r, n = comm.rank, comm.size
    big = jnp.full((2 * n,), 40000, jnp.float16)
    np.testing.assert_array_equal(spmd.allreduce(big, "avg"), np.full(2 * n, 40000, np.float16))
    np.testing.assert_array_equal(spmd.reduce_scatter(big, "avg"), np.full(2, 40000, np.float16))
    sizes = [1] * (n - 1) + [n + 1]
    np.testing.assert_array_equal(
        spmd.reduce_scatterv(big, sizes, "avg"), np.full(sizes[r], 40000, np.float16)
    )
    for dtype in (np.float16, jnp.bfloat16):
        ins = [_half_inputs(k, dtype)[: 1024 * n] for k in range(n)]
        acc = ins[0].astype(np.float32)
        for x in ins[1:]:
            acc = acc + x.astype(np.float32)
        want = (acc / np.float32(n)).astype(dtype)
        got = np.asarray(jax.jit(lambda v: spmd.allreduce(v, "avg"))(jnp.asarray(ins[r])))
        bad = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
        assert bad.size == 0, (dtype, bad[:5], got[bad[:5]], want[bad[:5]])
        part = np.asarray(spmd.reduce_scatter(jnp.asarray(ins[r]), "avg"))
        mine = want[r * 1024 : (r + 1) * 1024]
        assert part.view(np.uint16).tobytes() == mine.view(np.uint16).tobytes(), dtype


@multirank(nprocs=(3, 4), env={"SPMD_SIMULATE_NODES": "2"})
def test_half_precision_sums_round_once_hierarchical(comm):
    """Across nodes float16/bfloat16 sums stay in float32 until the end: each node adds its
    ranks in order, the two nodes' partial sums are added over MPI, and the total is rounded once,
    bit for bit what NumPy computes that way (rounding each node's partial sum to the half type
    first would round twice). A pytree mixing half and float32 leaves takes both paths."""
    assert spmd.ops.get_transport() == "hier"
    r, n = comm.rank, comm.size
    nodes: list[list[int]] = []  # consecutive ranks; a node starts at each local rank 0
    for k, local in enumerate(comm.allgather_object(comm.local_rank)):
        nodes.append([k]) if local == 0 else nodes[-1].append(k)
    assert len(nodes) == 2, nodes
    for dtype in (np.float16, jnp.bfloat16):
        ins = [_half_inputs(k, dtype) for k in range(n)]
        parts = []
        for node in nodes:
            acc = ins[node[0]].astype(np.float32)
            for k in node[1:]:
                acc = acc + ins[k].astype(np.float32)
            parts.append(acc)
        want = (parts[0] + parts[1]).astype(dtype)
        other = np.full(5, r + 1, np.float32)
        got, got_other = jax.jit(spmd.allreduce)((jnp.asarray(ins[r]), jnp.asarray(other)))
        got = np.asarray(got)
        bad = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
        assert bad.size == 0, (dtype, bad[:5], got[bad[:5]], want[bad[:5]])
        np.testing.assert_array_equal(np.asarray(got_other), np.full(5, n * (n + 1) / 2))


def _compressed_case(comm, exact_order: bool) -> None:
    """allreduce(compression=...) of float32 leaves: each rank's values (times the float32
    reciprocal of the group size for avg) rounded once to the half type, summed in float32
    in rank order, the sum rounded once and widened: bit for bit what NumPy computes that
    way. Edge values, then distinct random ones. One call small enough for shared memory's
    one-shot path, one large enough for its two-shot path, in jit and eagerly; a bfloat16
    leaf in the same call is reduced exactly. Without `exact_order` (MPI beyond 2 ranks) the
    float32 sum runs in MPI's order: identical on every rank and within rounding of NumPy's."""
    r, n = comm.rank, comm.size
    edges = [_half_inputs(k, np.float32) * np.float32(3.7) for k in range(n)]
    noise = [np.random.default_rng(k).standard_normal(300_001).astype(np.float32) for k in range(n)]

    def values(k, m):  # the edge cases, then distinct random values
        return np.concatenate([edges[k], noise[k]])[:m] if m > len(edges[k]) else edges[k][:m]

    scale = np.float32(1.0 / n)  # avg: each rank's values times the float32 reciprocal of n
    for comp, half in (("bf16", jnp.bfloat16), ("fp16", np.float16)):
        for op in ("sum", "avg"):
            for lengths in ((5, 700), (3, 4101, 300_001)):
                mine = [values(r, m) for m in lengths]
                want = []
                for m in lengths:
                    sent = [values(k, m) for k in range(n)]
                    sent = [(x * scale if op == "avg" else x).astype(half) for x in sent]
                    acc = sent[0].astype(np.float32)  # -0 + -0 is -0: start from rank 0's
                    for x in sent[1:]:
                        acc = acc + x.astype(np.float32)
                    want.append(acc.astype(half).astype(np.float32))
                fused = [jnp.asarray(x) for x in mine] + [jnp.full(3, r + 1, jnp.bfloat16)]
                for got in (
                    jax.jit(lambda v, op=op, comp=comp: spmd.allreduce(v, op, compression=comp))(
                        fused
                    ),
                    spmd.allreduce(fused, op, compression=comp),
                ):
                    assert all(g.dtype == jnp.float32 for g in got[:-1])
                    for g, w in zip(got[:-1], want, strict=True):
                        g = np.asarray(g)
                        if exact_order:
                            bad = np.flatnonzero(g.view(np.uint32) != w.view(np.uint32))
                            assert bad.size == 0, (comp, op, lengths, bad[:5], g[bad[:5]])
                        else:
                            np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-6)
                    assert (
                        len(
                            set(
                                comm.allgather_object(
                                    b"".join(np.asarray(g).tobytes() for g in got)
                                )
                            )
                        )
                        == 1
                    )
                    expect = n * (n + 1) / 2 if op == "sum" else (n + 1) / 2
                    assert got[-1].dtype == jnp.bfloat16
                    np.testing.assert_array_equal(got[-1], np.full(3, expect, np.float32))


@contextlib.contextmanager
def _native_compression(native: bool):
    """Small calls cast in XLA around an exact allreduce; force the native rounding (or
    not) whatever the size, so that the test sizes take both paths."""
    from spmd.ops import _allreduce

    before = _allreduce.NATIVE_COMPRESSION_MIN_BYTES
    _allreduce.NATIVE_COMPRESSION_MIN_BYTES = 0 if native else 1 << 62
    jax.clear_caches()  # the choice is made when a call is compiled: eager calls are cached
    try:
        yield
    finally:
        _allreduce.NATIVE_COMPRESSION_MIN_BYTES = before
        jax.clear_caches()


@multirank(nprocs=(2, 3))
def test_compressed_allreduce_rounds_each_rank_once_and_the_sum_once(comm):
    try:
        for transport in ("shm", "mpi"):
            spmd.ops.set_transport(transport)
            for native in (True, False):
                with _native_compression(native):
                    _compressed_case(comm, exact_order=transport == "shm" or comm.size == 2)
    finally:
        spmd.ops.set_transport("auto")


@multirank(nprocs=(3,), env={"SPMD_SIMULATE_NODES": "2"})
def test_compressed_allreduce_hierarchical(comm):
    """Nodes {0, 1} and {2}: the rounded values are summed in float32 inside the node and
    between the nodes, and rounded once at the end, which for 3 ranks is rank order."""
    assert spmd.ops.get_transport() == "hier"
    for native in (True, False):
        with _native_compression(native):
            _compressed_case(comm, exact_order=True)


@multirank(nprocs=(2,))
def test_compression_takes_the_native_path_from_its_threshold(comm):
    """What each size compiles to: below the threshold an exact bfloat16 allreduce between
    XLA casts, from it one float32 allreduce that rounds inside (the `wire` attribute)."""
    from spmd.ops import _allreduce

    limit = _allreduce.NATIVE_COMPRESSION_MIN_BYTES
    for floats, native in ((limit // 4 - 1, False), (limit // 4, True)):
        f = jax.jit(lambda v: spmd.allreduce(v, "avg", compression="bf16"))
        text = f.lower(jax.ShapeDtypeStruct((floats,), jnp.float32)).as_text()
        calls = [line for line in text.splitlines() if "@spmd_allreduce" in line]
        assert len(calls) == 1, text
        assert ("wire = 2" in calls[0]) is native, calls[0]
        assert ("wire = 0" in calls[0]) is not native, calls[0]


@multirank(nprocs=(2,))
def test_compressed_allreduce_errors_and_transforms(comm):
    r, n = comm.rank, comm.size
    x = jnp.arange(4.0, dtype=jnp.float32) + r
    with pytest.raises(spmd.SpmdError, match=f"rank {r}: allreduce: compression='int8'"):
        spmd.allreduce(x, compression="int8")
    with pytest.raises(spmd.SpmdError, match="needs op='sum' or op='avg', got op='max'"):
        spmd.allreduce(x, "max", compression="bf16")
    for native in (True, False):
        with _native_compression(native):
            # grad: the transpose of a compressed average is a compressed average of the
            # cotangents.
            w = jnp.asarray([1.0, 2.0, 3.0, 4.0]) * (r + 1)
            g = jax.grad(lambda v, w=w: jnp.sum(w * spmd.allreduce(v, "avg", compression="bf16")))(
                x
            )
            np.testing.assert_array_equal(g, (w / (r + 1)) * sum(range(1, n + 1)) / n)
            # The cotangents are scaled before they are summed in float16: a sum over the ranks
            # beyond float16's range (120000) whose average is within it (60000) stays finite.
            big = jnp.full(4, 40000.0) * (r + 1)
            g = jax.grad(
                lambda v, big=big: jnp.sum(big * spmd.allreduce(v, "avg", compression="fp16"))
            )(x)
            np.testing.assert_array_equal(g, np.full(4, 60000.0, np.float32))
            # vmap: each batch element is reduced on its own, batch axis in any position.
            xs = jnp.stack([x, 2 * x, 4 * x], axis=1)  # (4, 3)
            got = jax.vmap(lambda v: spmd.allreduce(v, "sum", compression="bf16"), in_axes=1)(xs)
            total = sum(jnp.arange(4.0) + k for k in range(n))
            np.testing.assert_array_equal(got, jnp.stack([total, 2 * total, 4 * total]))
            # The mismatch message names the compression (natively) or the wire dtypes.
            with pytest.raises(
                spmd.SpmdError, match="compression=bf16" if native else "of bfloat16\\[4\\]"
            ):
                spmd.allreduce(x, "avg", compression="bf16" if r else None)


@multirank(nprocs=(2,))
def test_mpi_half_precision_after_a_larger_reduce_scatter(comm):
    """Over MPI, float16 goes through float32 scratch buffers kept between calls: an allreduce
    after a reduce_scatter of a larger total must not outgrow the output one."""
    n = comm.size
    try:
        spmd.ops.set_transport("mpi")
        big = jnp.full((n << 20,), comm.rank + 1, jnp.float16)
        part = np.asarray(jax.jit(spmd.reduce_scatter)(big))
        np.testing.assert_array_equal(part, np.full(1 << 20, n * (n + 1) // 2, np.float16))
        summed = np.asarray(jax.jit(spmd.allreduce)(big))
        np.testing.assert_array_equal(summed, np.full(n << 20, n * (n + 1) // 2, np.float16))
    finally:
        spmd.ops.set_transport("auto")


def _max_min_specials(comm):
    """max/min with a NaN on one rank and zeros of both signs: NaN everywhere, +0 for max and -0
    for min, bit-identical on every rank, whatever the path."""
    r, n = comm.rank, comm.size
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
        x = np.arange(8, dtype=np.float64) + r  # ordinary values: the max is at rank n - 1
        x[1] = np.nan if r == (n - 1) // 2 else r  # a NaN on one rank only
        x[2] = -0.0 if r % 2 == 0 else 0.0  # -0 on even ranks, +0 on odd ones
        x[3] = -0.0  # -0 everywhere
        x = jnp.asarray(x, dtype)
        for op in ("max", "min"):
            got = np.asarray(jax.jit(lambda v, op=op: spmd.allreduce(v, op))(x), np.float64)
            assert np.isnan(got[1]), (dtype, op, got)
            assert got[3] == 0 and np.signbit(got[3]), (dtype, op, got)
            if n > 1:  # both signs present
                assert got[2] == 0 and np.signbit(got[2]) == (op == "min"), (dtype, op, got)
            ordinary = np.r_[0, 4:8]
            want = ordinary + (n - 1 if op == "max" else 0)
            np.testing.assert_array_equal(got[ordinary], want)
            same = comm.allgather_object(
                np.asarray(jax.jit(lambda v, op=op: spmd.allreduce(v, op))(x)).tobytes()
            )
            assert len(set(same)) == 1, (dtype, op)


@multirank(nprocs=(1, 2, 3, 4))
def test_float_max_min_with_nan_and_signed_zeros_over_shm_and_mpi(comm):
    try:
        with x64():
            for transport in ("shm", "mpi"):
                spmd.ops.set_transport(transport)
                _max_min_specials(comm)
    finally:
        spmd.ops.set_transport("auto")


@multirank(nprocs=(3, 4), env={"SPMD_SIMULATE_NODES": "2"})
def test_float_max_min_with_nan_and_signed_zeros_hierarchical(comm):
    assert spmd.ops.get_transport() == "hier"
    with x64():
        _max_min_specials(comm)


@multirank(nprocs=(2,))
def test_recv_under_vmap_receives_the_whole_batch(comm):
    """A recv whose like is batched receives one value per batch element (the sender's batch,
    batch axis first), eagerly, in jit, in nested vmaps and along any in_axes; a like that is
    not batched receives one value, as outside vmap; under grad the received value is a
    constant (zero gradient)."""
    batch = np.arange(24.0, dtype=np.float32).reshape(4, 2, 3)
    if comm.rank == 0:
        jax.vmap(lambda v: spmd.send(v, dst=1))(batch)  # the batch, sent at once
        jax.jit(jax.vmap(lambda v: spmd.send(v, dst=1), in_axes=1))(batch.transpose(1, 0, 2))
        spmd.send(batch, dst=1)  # received by a nested vmap
        spmd.send(batch[0], dst=1)  # received once, in a vmap whose like is not batched
        spmd.send(np.float32(5.0), dst=1)  # received under grad
    else:
        got = jax.vmap(lambda v: spmd.recv(v, src=0))(jnp.zeros((4, 2, 3)))
        np.testing.assert_array_equal(got, batch)
        got = jax.jit(jax.vmap(lambda v: spmd.recv({"a": v}, src=0)["a"], in_axes=2))(
            jnp.zeros((2, 3, 4))
        )
        np.testing.assert_array_equal(got, batch)  # like batched along axis 2: received first
        got = jax.vmap(jax.vmap(lambda v: spmd.recv(v, src=0)))(jnp.zeros((4, 2, 3)))
        np.testing.assert_array_equal(got, batch)
        got = jax.vmap(lambda v: v + spmd.recv(jnp.zeros((2, 3)), src=0))(jnp.ones((3, 2, 3)))
        np.testing.assert_array_equal(got, np.broadcast_to(batch[0] + 1, (3, 2, 3)))
        g = jax.grad(lambda v: v * spmd.recv(v, src=0))(3.0)
        assert float(g) == 5.0  # d/dv of v * (a constant 5)
    spmd.barrier()


@multirank(nprocs=(2,))
def test_vmap_axes_point_to_point_dtypes_and_weak_types(comm):
    """Ranks may vmap along different axes (the batch axis was passed through as laid out, so
    ranks combined different layouts); recv takes the dtype send uses (numpy's float64 is
    float32 without x64); a short message is an error, not garbage; weak types are kept."""
    r = comm.rank
    base = jnp.arange(9.0).reshape(3, 3) + 10 * r
    mine = base if r == 0 else base.T  # the same examples, laid out along another axis
    axis = 0 if r == 0 else 1
    want = np.asarray(jnp.arange(9.0).reshape(3, 3) * 2 + 10)
    got = jax.vmap(spmd.allreduce, in_axes=axis)(mine)
    np.testing.assert_array_equal(got, want)
    got = jax.vmap(lambda v: spmd.broadcast(v, root=1), in_axes=axis)(mine)
    np.testing.assert_array_equal(got, np.asarray(jnp.arange(9.0).reshape(3, 3) + 10))
    got = jax.vmap(lambda v: spmd.sendrecv(v, src=1 - r, dst=1 - r), in_axes=axis)(mine)
    np.testing.assert_array_equal(got, np.asarray(jnp.arange(9.0).reshape(3, 3) + 10 * (1 - r)))
    if r == 0:
        jax.vmap(lambda v: spmd.send(v, dst=1), in_axes=1)(jnp.arange(6.0).reshape(2, 3))
        spmd.send(np.arange(4.0), dst=1)  # float64 in numpy: sent as float32
        spmd.send(jnp.ones(2), dst=1)
    else:
        np.testing.assert_array_equal(spmd.recv(jnp.zeros((3, 2)), src=0), [[0, 3], [1, 4], [2, 5]])
        got = spmd.recv(np.zeros(4), src=0)
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(got, [0, 1, 2, 3])
        with pytest.raises(
            spmd.SpmdError,
            match=r"rank 1: recv: rank 0 sent float32\[2\] \(8 bytes\), but this rank "
            r"receives into float32\[4\] \(16 bytes\)",
        ):
            spmd.recv(jnp.zeros(4), src=0)
    spmd.barrier()
    half = jnp.ones(3, jnp.bfloat16)
    assert (spmd.allreduce(1.0) * half).dtype == jnp.bfloat16
    assert (spmd.broadcast(1.0) * half).dtype == jnp.bfloat16
    with pytest.raises(spmd.SpmdError, match=r"allreduce\(op='max'\) is not linear"):
        jax.linear_transpose(lambda v: spmd.allreduce(v, "max"), jnp.ones(3))(jnp.ones(3))
