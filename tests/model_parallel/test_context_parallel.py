"""spmd.context_parallel: ring attention over a cp axis of 2 and 4 ranks gives, for each rank's
part of the sequence, the outputs and the gradients of dense attention over the whole sequence
computed in one process (rtol 1e-5, float32), causal (with the load-balanced split) and not,
with a padding mask; split_sequence and join_sequence are inverses; bad input is a named
error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank

B, S, H, D = 2, 16, 2, 8  # batch, whole sequence, heads, head_dim


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v, c = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32) for _ in range(4))
    mask = np.ones((B, S), bool)
    mask[1, 5:9] = False  # padding in the middle of the second example (its key 0 stays)
    mask[1, 13:] = False
    return q, k, v, c, jnp.asarray(mask)


def dense(q, k, v, causal, mask):
    """One process, the whole sequence: softmax(q k^T / sqrt(d)) v."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    allowed = mask[:, None, None, :]
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((S, S), bool))[None, None]
    weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _matches_dense(mine, want, want_grads, causal, what):
    """Ring attention on this rank's part ``mine`` (q, k, v, cotangent, mask) gives dense
    attention's outputs ``want`` and gradients ``want_grads`` at that part. The collectives'
    convention: each rank's gradient is that of the objective summed over the ranks, i.e. the
    dense objective's, at this rank's part of the sequence. Returns the outputs."""
    cp = spmd.context_parallel

    def objective(q, k, v):
        return jnp.sum(cp.attention(q, k, v, causal=causal, mask=mine[4]) * mine[3])

    out = cp.attention(*mine[:3], causal=causal, mask=mine[4])
    np.testing.assert_allclose(out, cp.split_sequence(want, causal=causal), rtol=1e-5,
                               atol=1e-6, err_msg=f"outputs, {what}")  # fmt: skip
    grads = jax.grad(objective, argnums=(0, 1, 2))(*mine[:3])
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        np.testing.assert_allclose(g, cp.split_sequence(w, causal=causal), rtol=1e-5,
                                   atol=1e-5, err_msg=f"d{name}, {what}")  # fmt: skip
    return out


@multirank(nprocs=(2, 4))
def test_ring_attention_gives_dense_attention_s_outputs_and_gradients(comm):
    q, k, v, c, mask = _inputs()
    if comm.size == 4:  # cp placed where it is written: innermost here, its ring inside a node
        lists = spmd.Mesh(dp=2, cp=2).rank_lists("cp")
        assert [list(g) for g in lists] == [[0, 1], [2, 3]]
    with spmd.Mesh(cp=-1):
        for causal in (False, True):

            def dense_objective(q, k, v, causal=causal):
                return jnp.sum(dense(q, k, v, causal, mask) * c)

            want = dense(q, k, v, causal, mask)
            want_grads = jax.grad(dense_objective, argnums=(0, 1, 2))(q, k, v)
            mine = spmd.context_parallel.split_sequence((q, k, v, c, mask), causal=causal)

            out = _matches_dense(
                mine, want, want_grads, causal, f"causal={causal} on {comm.size} ranks"
            )
            joined = spmd.context_parallel.join_sequence(out, causal=causal)
            np.testing.assert_allclose(
                joined, want, rtol=1e-5, atol=1e-6, err_msg=f"joined, causal={causal}"
            )


@multirank(nprocs=(2,))
def test_the_causal_split_gives_each_rank_an_early_and_a_late_chunk(comm):
    with spmd.Mesh(cp=2):
        x = jnp.arange(8)[None]
        mine = spmd.context_parallel.split_sequence(x, causal=True)
        assert mine.tolist() == [[[0, 1, 6, 7], [2, 3, 4, 5]][comm.rank]]
        assert spmd.context_parallel.positions(4, causal=True).tolist() == mine[0].tolist()
        assert spmd.context_parallel.join_sequence(mine, causal=True).tolist() == x.tolist()
        with pytest.raises(spmd.SpmdError, match=r"length 6, which does not split into 4"):
            spmd.context_parallel.split_sequence(jnp.ones((1, 6)), causal=True)
        with pytest.raises(spmd.SpmdError, match=r"expected \(batch, seq_local\) = \(1, 4\)"):
            q = jnp.ones((1, 4, 1, 2))
            spmd.context_parallel.attention(q, q, q, mask=jnp.ones((1, 3), bool))


@multirank(nprocs=(4,))
def test_ring_attention_inside_dp_and_tp(comm):
    """Mesh(dp=2, cp=2): each dp replica attends its own examples over its cp pair; Mesh(cp=2,
    tp=2): each tp rank its heads (the tensor-parallel layout). Outputs and gradients are dense
    attention's, for those examples and heads, at this rank's part of the sequence."""
    q, k, v, c, mask = _inputs()
    for axes, mine_of in (
        ({"dp": 2, "cp": 2}, lambda t, m: t[m.index("dp") : m.index("dp") + 1]),  # examples
        ({"cp": 2, "tp": 2}, lambda t, m: t[:, :, m.index("tp") : m.index("tp") + 1]),  # heads
    ):
        with spmd.Mesh(**axes) as m:
            part = [mine_of(t, m) for t in (q, k, v, c)]
            keep = mask[m.index("dp") : m.index("dp") + 1] if "dp" in axes else mask
            want = dense(*part[:3], True, keep)

            def dense_objective(q, k, v, keep=keep, c=part[3]):
                return jnp.sum(dense(q, k, v, True, keep) * c)

            want_grads = jax.grad(dense_objective, argnums=(0, 1, 2))(*part[:3])
            cut = spmd.context_parallel.split_sequence((*part, keep), causal=True)

            _matches_dense(cut, want, want_grads, True, str(axes))
