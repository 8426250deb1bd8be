"""Context parallelism: attention over a sequence split across the ranks of a ``cp`` mesh axis
(ring attention). ``spmd.context_parallel``.

Each rank holds a part of the sequence (``split_sequence``): its queries, keys and values. The
key and value blocks travel around the group's ring, one neighbour exchange per step
(``spmd.sendrecv``), while each rank attends its queries to the block it holds; the softmax is
combined across the blocks online (a running maximum and sum per query, as flash attention
combines tiles), so no rank ever holds more than two blocks of keys and values and the result
equals attention over the whole sequence.

Causal attention with a contiguous split leaves the first rank little to do (its queries see
only its own keys) and the last most: ``split_sequence(..., causal=True)`` cuts the sequence
into ``2 * cp`` chunks and gives rank r chunks r and ``2 * cp - 1 - r``, an early and a late
one, so that every rank has the same causal work. ``attention(..., causal=True)`` expects that
layout (it masks by the chunks' global positions), and ``join_sequence(..., causal=True)``
undoes it.

Gradients: a custom VJP. The forward pass keeps only this rank's q, k, v, mask, output and each
query's log-sum-exp; the backward pass sends the key and value blocks around the ring again,
recomputes each block's softmax from the log-sum-exp (as flash attention's backward pass
does), and the blocks' key and value gradients travel with them and go home at the end. So a
rank holds O(S / cp) of keys and values, differentiated too. Each rank's gradients are those of
the objective summed over the ranks (the collectives' convention).

Example (a world of one: the whole sequence on one rank, plain attention)::

    >>> import jax, jax.numpy as jnp, spmd
    >>> q = k = v = jnp.ones((1, 4, 2, 8))   # (batch, sequence, heads, head_dim)
    >>> with spmd.Mesh(cp=-1):
    ...     spmd.context_parallel.attention(q, k, v, causal=True).shape
    (1, 4, 2, 8)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError
from ..mesh import resolve_group
from ..ops import allgather, sendrecv

__all__ = ["attention", "join_sequence", "positions", "split_sequence"]

_OP = "context_parallel"


def _group(group: Any, op: str) -> Any:
    return resolve_group(None, group, op=op)


def positions(length: int, *, causal: bool = False, group: Any = "cp") -> Any:
    """The global positions (in the whole sequence) of this rank's ``length`` positions, as
    :func:`split_sequence` lays them out: a contiguous block, or with ``causal`` an early and a
    late chunk (rank r: chunks r and ``2 * cp - 1 - r`` of ``2 * cp``)."""
    comm = _group(group, f"{_OP}.positions")
    return jnp.asarray(_positions(length, comm.rank, comm.size, causal))


def _positions(length: int, rank: int, size: int, causal: bool) -> np.ndarray:
    if not causal:
        return np.arange(rank * length, (rank + 1) * length)
    half = length // 2
    early = np.arange(rank * half, (rank + 1) * half)
    late = np.arange((2 * size - 1 - rank) * half, (2 * size - rank) * half)
    return np.concatenate([early, late])


def _check_length(n: int, parts: int, what: str, op: str) -> None:
    if n % parts:
        raise SpmdError(
            f"{what} has length {n}, which does not split into {parts} equal parts; pad the "
            "sequence to a multiple of that",
            op=op,
        )


def split_sequence(x: Any, axis: int = 1, *, causal: bool = False, group: Any = "cp") -> Any:
    """This rank's part of the whole sequence ``x`` (the same on every rank) along ``axis``: a
    contiguous block, or with ``causal`` the load-balanced early and late chunks (module doc).
    Works on a pytree of arrays with the sequence on the same axis."""
    op = f"{_OP}.split_sequence"
    comm = _group(group, op)

    def one(a: Any) -> Any:
        a = jnp.asarray(a)
        n = a.shape[axis]
        parts = 2 * comm.size if causal else comm.size
        _check_length(n, parts, f"the sequence (axis {axis} of {a.shape})", op)
        if not causal:
            return jax.lax.slice_in_dim(a, comm.rank * (n // parts), (comm.rank + 1) * (n // parts),
                                        axis=axis)  # fmt: skip
        c = n // parts
        early = jax.lax.slice_in_dim(a, comm.rank * c, (comm.rank + 1) * c, axis=axis)
        late_at = (parts - 1 - comm.rank) * c
        late = jax.lax.slice_in_dim(a, late_at, late_at + c, axis=axis)
        return jnp.concatenate([early, late], axis=axis)

    return jax.tree_util.tree_map(one, x)


def join_sequence(x: Any, axis: int = 1, *, causal: bool = False, group: Any = "cp") -> Any:
    """The whole sequence from every rank's part (:func:`split_sequence`'s inverse), on every
    rank: an allgather over the group, reordered where ``causal`` split it in chunks."""
    op = f"{_OP}.join_sequence"
    comm = _group(group, op)

    def one(a: Any) -> Any:
        a = jnp.asarray(a)
        whole = allgather(a, axis=axis, group=comm)
        if not causal or comm.size == 1:
            return whole
        n = a.shape[axis]
        _check_length(n, 2, f"this rank's part (axis {axis} of {a.shape})", op)
        order = np.argsort(
            np.concatenate([_positions(n, r, comm.size, True) for r in range(comm.size)])
        )
        return jnp.take(whole, jnp.asarray(order), axis=axis)

    return jax.tree_util.tree_map(one, x)


def attention(
    q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None, group: Any = "cp"
) -> Any:
    """Softmax attention of this rank's queries over the whole sequence's keys and values.

    ``q``, ``k``, ``v``: ``(batch, seq_local, heads, head_dim)``, this rank's part of the
    sequence (:func:`split_sequence`; with ``causal``, its load-balanced layout). ``mask``:
    None, or ``(batch, seq_local)`` booleans, True where this rank's keys may be attended
    (padding: False), split like the sequence. Returns ``(batch, seq_local, heads, head_dim)``,
    ``softmax(q k^T / sqrt(head_dim)) v`` for this rank's queries; a query with no key to
    attend (every key masked) gets zeros. Scores and the softmax are computed in float32."""
    op = f"{_OP}.attention"
    comm = _group(group, op)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise SpmdError(
            f"q, k, v have shapes {q.shape}, {k.shape}, {v.shape}; expected (batch, seq_local, "
            "heads, head_dim) for all three (v's head_dim may differ)",
            op=op,
        )
    b, s, _, d = q.shape
    if causal:
        _check_length(s, 2, f"this rank's part of the sequence (q of shape {q.shape})", op)
    keep = jnp.ones((b, s), bool) if mask is None else jnp.asarray(mask, bool)
    if keep.shape != (b, s):
        raise SpmdError(f"mask has shape {keep.shape}; expected (batch, seq_local) = {(b, s)}",
                        op=op)  # fmt: skip
    ring = _Ring(comm, s, causal, 1.0 / math.sqrt(d))

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, keep: Any) -> Any:
        return ring.forward(q, k, v, keep)[0]

    def forward(q: Any, k: Any, v: Any, keep: Any) -> tuple[Any, Any]:
        out, lse = ring.forward(q, k, v, keep)
        return out, (q, k, v, keep, out, lse)

    run.defvjp(forward, ring.backward)
    return run(q, k, v, keep)


class _Ring:
    """The ring's passes over one group: the forward pass (outputs and each query's log-sum-exp
    of its scores) and a backward pass that recomputes each block's scores from those rather
    than keeping them, as flash attention's does: a rank holds two blocks of keys and values at
    a time, and their gradients travel around the ring with them back to their owner."""

    def __init__(self, comm: Any, length: int, causal: bool, scale: float) -> None:
        self.comm, self.causal, self.scale = comm, causal, scale
        self.p, self.r = comm.size, comm.rank
        self.mine = _positions(length, self.r, self.p, causal)
        self.length = length

    def _shift(self, block: Any) -> Any:
        """``block`` to the next rank; the previous rank's in return."""
        return sendrecv(block, src=(self.r - 1) % self.p, dst=(self.r + 1) % self.p,
                        group=self.comm, note="context_parallel")  # fmt: skip

    def _allowed(self, keep: Any, step: int) -> Any:
        """(batch, 1, q, k) booleans: which of the block's keys each query may attend."""
        allowed = keep[:, None, None, :]
        if self.causal:
            owner = (self.r - step) % self.p  # whose keys this rank holds at this step
            theirs = _positions(self.length, owner, self.p, True)
            allowed = allowed & jnp.asarray(theirs[None, :] <= self.mine[:, None])[None, None]
        return allowed

    def forward(self, q: Any, k: Any, v: Any, keep: Any) -> tuple[Any, Any]:
        b, s, h, _ = q.shape
        qf = q.astype(jnp.float32) * self.scale
        out = jnp.zeros((b, h, s, v.shape[-1]), jnp.float32)
        top = jnp.full((b, h, s), -jnp.inf, jnp.float32)
        total = jnp.zeros((b, h, s), jnp.float32)
        block = (k, v, keep)
        for step in range(self.p):
            kb, vb, keepb = block
            allowed = self._allowed(keepb, step)
            scores = jnp.where(allowed, jnp.einsum("bqhd,bkhd->bhqk", qf, kb.astype(jnp.float32)),
                               -jnp.inf)  # fmt: skip
            new_top = jnp.maximum(top, scores.max(-1))
            safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            weights = jnp.where(allowed, jnp.exp(scores - safe[..., None]), 0.0)
            fade = jnp.where(jnp.isfinite(top), jnp.exp(top - safe), 0.0)
            total = total * fade + weights.sum(-1)
            out = out * fade[..., None] + jnp.einsum("bhqk,bkhd->bhqd", weights,
                                                     vb.astype(jnp.float32))  # fmt: skip
            top = new_top
            if step + 1 < self.p:
                block = self._shift(block)
        # Each query's log-sum-exp (-inf for a query with no key to attend, whose output is 0).
        lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
        out = out / jnp.where(total > 0, total, 1.0)[..., None]
        return out.transpose(0, 2, 1, 3).astype(q.dtype), lse

    def backward(self, res: Any, g: Any) -> tuple[Any, Any, Any, Any]:
        q, k, v, keep, out, lse = res
        qf = q.astype(jnp.float32) * self.scale
        go = g.astype(jnp.float32).transpose(0, 2, 1, 3)  # (b, h, q, dv)
        # sum_j P_ij dP_ij for each query: the softmax's correction term.
        delta = jnp.sum(go * out.astype(jnp.float32).transpose(0, 2, 1, 3), -1)
        safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        dq = jnp.zeros(q.shape, jnp.float32)
        block = (k, v, keep, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        for step in range(self.p):
            kb, vb, keepb, dk, dv = block
            allowed = self._allowed(keepb, step) & jnp.isfinite(lse)[..., None]
            kf, vf = kb.astype(jnp.float32), vb.astype(jnp.float32)
            scores = jnp.einsum("bqhd,bkhd->bhqk", qf, kf)
            probs = jnp.where(allowed, jnp.exp(scores - safe_lse[..., None]), 0.0)
            dv = dv + jnp.einsum("bhqk,bhqd->bkhd", probs, go)
            dscores = probs * (jnp.einsum("bhqd,bkhd->bhqk", go, vf) - delta[..., None])
            dq = dq + jnp.einsum("bhqk,bkhd->bqhd", dscores, kf) * self.scale
            dk = dk + jnp.einsum("bhqk,bqhd->bkhd", dscores, qf)
            block = (kb, vb, keepb, dk, dv)
            if step + 1 < self.p:
                block = self._shift(block)
        # The block this rank holds last is the next rank's: its gradients go home.
        dk, dv = block[3], block[4]
        if self.p > 1:
            dk, dv = self._shift((dk, dv))
        no_grad = np.zeros(keep.shape, jax.dtypes.float0)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), no_grad
