"""Passes: functions ``Program -> Program``, how they compose, and what the built-in ones share.

A pass factory takes a transform's options and returns a pass; a transform is a step (a
subclass of :class:`spmd.transforms.Step`) whose ``passes`` method returns a chain of passes, as
optax builds an optimizer from a chain of gradient transformations::

    class Unbucketed(spmd.transforms.Step):
        def passes(self, traced, variant):
            return chain(reduce_gradients(bucket_mb=0))

Most passes re-evaluate a program's ops under a fresh trace (:func:`spmd.transforms.retrace`),
adding or replacing ops on the way. The gradient marks that ``spmd.grad`` leaves in a traced
step tell them which values are gradients, of which parameters (:func:`gradient_leaves`); the
data-parallel and ZeRO passes both reduce them in the same buckets, at the same places
(:func:`place_buckets`). docs/architecture.md, "Writing a pass", walks through one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._jax_compat import core
from ._grad import mark_p
from ._program import Env, Program, eval_eqn, retrace

Pass = Callable[[Program], Program]

NO_GRAD = (
    "{name} computes no gradient with spmd.grad or spmd.value_and_grad, so there is nothing to "
    "average. Compute the gradients in the step with them, e.g.\n"
    "    loss, grads = spmd.value_and_grad(loss_fn)(params, batch)\n"
    "(the gradients of jax.grad, nnx.value_and_grad and eqx.filter_grad are not seen, nor "
    "are spmd.grad calls inside a nested jax.jit; spmd.value_and_grad takes Flax NNX and "
    "Equinox models as theirs do)."
)


def chain(*passes: Pass) -> Pass:
    """One pass that applies ``passes`` in order.

    Example::

        >>> import spmd
        >>> identity = spmd.transforms.chain()
        >>> double = spmd.transforms.chain(identity, identity)
    """

    def chained(program: Program) -> Program:
        return functools.reduce(lambda p, f: f(p), passes, program)

    return chained


@dataclass
class GradientLeaf:
    """One marked gradient leaf: where it comes from and where the step reads it."""

    k: int  # position among all marked gradients of the step
    call: int  # the spmd.grad call that produced it
    path: str  # its pytree path in that call's gradients
    src: Any  # the value the backward pass produced (the mark's input)
    dst: Any  # the value the rest of the step reads (the mark's output)
    nbytes: int
    producer: int  # index of the producing op, -1 for an input or constant
    # For the gradient of a ShardedArray: the groups of world ranks its blocks differ over
    # (see :func:`replica_groups`); None for a replicated parameter.
    shards: tuple[tuple[int, ...], ...] | None = None


@dataclass
class Bucket:
    leaves: list[GradientLeaf] = field(default_factory=list)
    nbytes: int = 0


def gradient_leaves(program: Program) -> tuple[list[GradientLeaf], dict[int, int]]:
    """The marked gradients of a program, and {gradient call: index of its mark op}."""
    eqns = program.jaxpr.jaxpr.eqns
    producer: dict[Any, int] = {}
    leaves: list[GradientLeaf] = []
    marks: dict[int, int] = {}
    for i, eqn in enumerate(eqns):
        if eqn.primitive is mark_p and eqn.params["kind"] == "grad":
            marks[eqn.params["call"]] = i
            shards = eqn.params.get("shards") or (None,) * len(eqn.invars)
            for src, dst, path, held in zip(
                eqn.invars, eqn.outvars, eqn.params["paths"], shards, strict=True
            ):
                aval = src.aval
                nbytes = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
                # A constant gradient (of an unused or linear scalar) is a literal: no producer.
                made = -1 if isinstance(src, core.Literal) else producer.get(src, -1)
                leaves.append(
                    GradientLeaf(
                        len(leaves), eqn.params["call"], path, src, dst, nbytes, made, held
                    )
                )
        for v in eqn.outvars:
            producer[v] = i
    return leaves, marks


def gradients_reach_results(program: Program) -> bool:
    """Whether some result of the program depends on a marked gradient (True when the program
    marks none at its top level). Forward through the op list: an op that reads a value that
    depends on a gradient makes all its results depend on it."""
    leaves, _ = gradient_leaves(program)
    if not leaves:
        return True
    reached = {leaf.dst for leaf in leaves}
    for eqn in program.jaxpr.jaxpr.eqns:
        if any(not isinstance(v, core.Literal) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return any(
        not isinstance(v, core.Literal) and v in reached for v in program.jaxpr.jaxpr.outvars
    )


def shard_coordinate(shards: tuple[tuple[int, ...], ...] | None, rank: int) -> int | None:
    """Which block world rank ``rank`` holds of an array sharded over ``shards`` (its position
    in its group), None if the array is replicated."""
    if shards is None:
        return None
    return next((g.index(rank) for g in shards if rank in g), None)


def replica_groups(
    groups: Sequence[Sequence[int]], shards: tuple[tuple[int, ...], ...] | None
) -> list[list[int]]:
    """The ranks of a data-parallel group (``groups``: the partition of the world it belongs
    to, ``Communicator.groups``) that hold the same block of a parameter sharded over
    ``shards``: the group itself for a replicated parameter, or for blocks split over axes the
    group does not span (tensor parallelism over tp, data parallelism over dp); a subgroup
    where the blocks are split over ranks of the group itself (experts over an ep axis inside
    the data-parallel ranks). Every rank computes the same partition."""
    if shards is None:
        return [list(g) for g in groups]
    out: list[list[int]] = []
    for g in groups:
        by_block: dict[int | None, list[int]] = {}
        for r in g:
            by_block.setdefault(shard_coordinate(shards, r), []).append(r)
        out.extend(by_block.values())
    return out


def block_groups(
    groups: Sequence[Sequence[int]], shards: tuple[tuple[int, ...], ...] | None
) -> tuple[tuple[int, ...], ...] | None:
    """The rank list over which a gradient of a block sharded over ``shards`` is reduced, when
    it is not the data-parallel group itself (``groups``: its ``Communicator.groups``): the
    ranks holding the same block (:func:`replica_groups`); None when that is the whole group."""
    sub = replica_groups(groups, shards)
    if sorted(map(sorted, sub)) == sorted(map(sorted, groups)):
        return None
    return tuple(tuple(g) for g in sub)


def reduce_blocks(
    values: list[Any], sub: tuple[tuple[int, ...], ...], size: int, average: bool = True
) -> list[Any]:
    """Gradients of blocks split over ranks of a data-parallel group of ``size`` ranks
    (experts over an ep axis inside it), reduced over ``sub`` (from :func:`block_groups`):
    summed over the ranks holding the same block and, with ``average``, divided by ``size``.
    Each is already the sum of the gradients of its ranks' objectives (the collectives'
    convention), so the result is the gradient of the mean over the group."""
    from ..ops import allreduce

    if any(len(g) > 1 for g in sub):
        values = list(allreduce(values, "sum", rank_list=[list(g) for g in sub]))
    return [v / size for v in values] if average else values


def marked_params(program: Program) -> list[int]:
    """Flat input positions of the parameters ``spmd.grad`` differentiates in ``program``."""
    index = {v: i for i, v in enumerate(program.jaxpr.jaxpr.invars)}
    found = {
        index[v]
        for e in program.jaxpr.jaxpr.eqns
        if e.primitive is mark_p and e.params["kind"] == "param"
        for v in e.invars
        if v in index
    }
    return sorted(found)


def _buckets(leaves: list[GradientLeaf], bucket_mb: float) -> list[Bucket]:
    """Reverse parameter order within each gradient call, packed up to bucket_mb MiB."""
    cap = bucket_mb * 2**20
    buckets: list[Bucket] = []
    for call in sorted({leaf.call for leaf in leaves}):
        current = Bucket()
        for leaf in reversed([x for x in leaves if x.call == call]):
            if current.leaves and (cap <= 0 or current.nbytes + leaf.nbytes > cap):
                buckets.append(current)
                current = Bucket()
            current.leaves.append(leaf)
            current.nbytes += leaf.nbytes
        if current.leaves:
            buckets.append(current)
    return buckets


def place_buckets(
    leaves: list[GradientLeaf], marks: dict[int, int], bucket_mb: float, overlap: bool
) -> dict[int, list[Bucket]]:
    """{op index: the buckets to reduce right after it} (-1: before the first op). With overlap,
    a bucket goes after the op that produces its last gradient; without, after the backward pass
    (just before its gradient call's mark)."""
    at: dict[int, list[Bucket]] = {}
    for b in _buckets(leaves, bucket_mb):
        i = max(x.producer for x in b.leaves) if overlap else marks[b.leaves[0].call] - 1
        at.setdefault(i, []).append(b)
    return at


def map_gradients(
    program: Program,
    f: Callable[[Any, GradientLeaf, Sequence[Any]], Any],
    more: Sequence[tuple[str, Any]] = (),
) -> Program:
    """``program`` with each floating gradient ``g`` that ``spmd.grad`` marked replaced by
    ``f(g, leaf, extra)`` right after the op that produces it (so that a reducing pass after
    this one still overlaps the backward pass; a constant gradient where its mark reads it).
    ``more``: (name, aval) of inputs the program takes more, last; ``extra`` holds their values.
    The marks stay."""
    leaves, _ = gradient_leaves(program)
    floating = [bool(jnp.issubdtype(leaf.src.aval.dtype, jnp.inexact)) for leaf in leaves]
    of_var: dict[Any, list[GradientLeaf]] = {}  # (one value may be the gradient of two leaves)
    for leaf, fl in zip(leaves, floating, strict=True):
        if fl and not isinstance(leaf.src, core.Literal):
            of_var.setdefault(leaf.src, []).append(leaf)
    jaxpr = program.jaxpr.jaxpr
    n_in = len(jaxpr.invars)

    def body(env: Env, xs: Sequence[Any]) -> list[Any]:
        extra = xs[n_in:]
        new: dict[int, Any] = {}  # leaf.k -> its gradient, mapped

        def produced(vs: Sequence[Any], vals: Sequence[Any]) -> None:
            for v, val in zip(vs, vals, strict=True):
                env.write(v, val)
                for leaf in of_var.get(v, ()):
                    new[leaf.k] = f(val, leaf, extra)

        produced(jaxpr.invars, xs[:n_in])
        k = 0  # the first leaf of the next grad mark (gradient_leaves' order)
        for eqn in jaxpr.eqns:
            ins = [env.read(a) for a in eqn.invars]
            if eqn.primitive is mark_p and eqn.params["kind"] == "grad":
                for i, leaf in enumerate(leaves[k : k + len(ins)]):
                    if leaf.k in new:
                        ins[i] = new[leaf.k]
                    elif floating[leaf.k]:  # a literal
                        ins[i] = f(jnp.asarray(ins[i], leaf.src.aval.dtype), leaf, extra)
                k += len(ins)
            produced(eqn.outvars, eval_eqn(eqn, ins))
        return [env.read(v) for v in jaxpr.outvars]

    jaxpr_out = retrace(program, body, [aval for _, aval in more])
    if not more:
        return program.replace(jaxpr_out, out_sharding=program.out_sharding)
    return program.with_inputs(jaxpr_out, [name for name, _ in more])
