"""``@spmd.zero_shard(stage=1|2|3)``: ZeRO on top of data parallelism.

The step is the same one ``@spmd.data_parallel`` takes (``spmd.value_and_grad``, an optax update,
apply the updates). ``step.shard(params, opt_state)`` turns replicated state into what the stage
keeps per rank: every optimizer-state array (and at stage 3 every parameter array) becomes a
:class:`~spmd.ShardedArray` split along axis 0 over the data-parallel group (1/N of the rows per
rank, the last shards zero-padded); scalars stay replicated. The step is traced with the global
shapes, and the pass :func:`~._partition.shard_state` runs its ops on the shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import SpmdError
from ..mesh import Mesh, current_mesh
from ..runtime import Communicator
from ..sharded import ShardedArray, is_sharded, make_spec, normalize_spec, shard, spec_axes
from ._boundary import shard_nodes
from ._boxes import box_groups, is_block_box
from ._grad import marking
from ._join import join_inputs, join_state, weight_joined
from ._partition import shard_state
from ._passes import Pass, block_groups, chain, marked_params
from ._program import arg_names, path_name, trace_program
from ._step import Step, Traced, check_same, syncing

__all__ = ["ZeroShard", "zero_shard"]

NO_SYNC = (
    "{name} was called inside spmd.no_sync(), which it does not support; accumulate with "
    "zero_shard(accumulate_steps=k) instead, or use data_parallel"
)


# -- API ------------------------------------------------------------------------------------------


def zero_shard(
    fn: Callable[..., Any] | None = None,
    *,
    stage: int = 1,
    group: Any = None,
    bucket_mb: float = 25.0,
    overlap: bool = True,
    accumulate_steps: int = 1,
    check_params: bool = True,
) -> Any:
    """ZeRO data parallelism for a training step; bare (``@zero_shard``) or with options.

    Use it in place of ``@spmd.data_parallel`` on the same step, and shard the state once::

        step = spmd.zero_shard(train_step, stage=2)
        params, opt_state = step.shard(params, opt_state)
        params, opt_state, loss = step(params, opt_state, batch)

    It is a :class:`~spmd.transforms.Step` whose pass is :func:`spmd.transforms.shard_state`
    (after :func:`spmd.transforms.weight_joined` under ``spmd.join``).

    Args:
        fn: the step; it computes its gradients with ``spmd.(value_and_)grad``.
        stage: 1 shards the optimizer state; 2 also the gradients (reduce_scatter instead of
            allreduce); 3 also the parameters (each all-gathered before its first use in the
            forward pass and again in the backward pass).
        group: the data-parallel group (None: the default communicator; a Communicator; or an
            axis name of the mesh active at call time).
        bucket_mb, overlap, accumulate_steps, check_params: as for ``data_parallel``.

    Example (a world of one: each rank keeps all the rows)::

        >>> import jax.numpy as jnp, spmd
        >>> @spmd.zero_shard(stage=3)
        ... def step(w, m, x):
        ...     g = spmd.grad(lambda w: jnp.sum(w * x))(w)
        ...     m = 0.9 * m + g
        ...     return w - 0.1 * m, m
        >>> w, m = step.shard(jnp.ones(4), jnp.zeros(4))
        >>> w, m = step(w, m, jnp.arange(4.0))
        >>> w.gather()
        Array([1. , 0.9, 0.8, 0.7], dtype=float32)
    """
    options: dict[str, Any] = dict(
        stage=stage,
        group=group,
        bucket_mb=bucket_mb,
        overlap=overlap,
        accumulate_steps=accumulate_steps,
        check_params=check_params,
    )
    if fn is None:
        return functools.partial(ZeroShard, **options)
    return ZeroShard(fn, **options)


BAD_INPUT = (
    "argument {path} is a ShardedArray with spec {spec} over {mesh}; zero_shard expects "
    "its sharded state split along axis 0 over its group {ranks}, as step.shard(params, "
    "opt_state) makes it, or a block of a model-parallel layer split over a mesh axis "
    "(spmd.moe.shard_experts), which it leaves whole (docs/model_parallel.md)"
)


# -- the step -------------------------------------------------------------------------------------


class ZeroShard(Step):
    """A ZeRO training step (what ``@spmd.zero_shard`` returns)."""

    transform = "zero_shard"

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        stage: int,
        group: Any,
        bucket_mb: float,
        overlap: bool,
        accumulate_steps: int,
        check_params: bool,
    ) -> None:
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise SpmdError(f"stage={stage!r}; expected 1, 2 or 3", op=self.transform)
        super().__init__(
            fn, group=group, accumulate_steps=accumulate_steps, check_params=check_params
        )
        self.stage = stage
        self.bucket_mb = bucket_mb
        self.overlap = overlap

    # Sharding the state ------------------------------------------------------------------------

    def _where(self) -> tuple[Communicator, Any, str]:
        """The group, what ShardedArrays record as their mesh, and the axis name in their spec."""
        comm = self.comm()
        if isinstance(self.group, str) and current_mesh() is not None:
            return comm, current_mesh(), self.group
        return comm, comm, "dp"

    def shard(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` as this stage keeps them: every array of rank >= 1 of the
        optimizer state (and at stage 3 of the parameters) becomes a ShardedArray of this rank's
        rows; scalars and, at stages 1 and 2, the parameters stay replicated. At stage 3 (with
        ``check_params``) the full parameters are first compared between the ranks, as the
        step's first call does at stages 1 and 2: a collective, call it on every rank."""
        objects = shard_nodes(params, opt_state, self.shard)
        if objects is not None:  # Flax NNX objects, sharded in place
            return objects
        comm, where, axis = self._where()
        place = {"group": where} if isinstance(where, Communicator) else {"mesh": where}

        def kept(x: Any) -> bool:
            """A ShardedArray, or a framework layer's block (or its state's) that differs
            within the group (experts): left as it is."""
            return is_sharded(x) or (
                is_block_box(x) and block_groups(comm.groups, box_groups(x)) is not None
            )

        def one(x: Any) -> Any:
            if kept(x):
                return x
            x = jnp.asarray(x)
            return x if x.ndim == 0 else shard(x, make_spec(axis), **place)

        sharded_state = jax.tree_util.tree_map(one, opt_state, is_leaf=kept)
        if self.stage == 3:
            if self.check_params:  # the step's own check sees only shards from here on
                flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=kept)[0]
                named = [("params" + path_name(k), x) for k, x in flat if not kept(x)]
                check_same(comm, named, f"{self.name}.shard")
            params = jax.tree_util.tree_map(one, params, is_leaf=kept)
        return params, sharded_state

    # The step ----------------------------------------------------------------------------------

    def trace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Traced:
        """Check the sharded inputs and trace the step with their global shapes."""
        comm, where, axis = self._where()
        objs, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_sharded)

        def block(x: Any) -> bool:
            """A block of a model-parallel layer (experts split over an ep axis): a ShardedArray
            over a mesh axis that is not the ZeRO group's own. The step sees it as it is, this
            rank's block, and the pass leaves it unpartitioned."""
            if not (is_sharded(x) and isinstance(x.mesh, Mesh)):
                return False
            return x.mesh != where or axis not in spec_axes(x.spec)

        abstract = [
            ShardedArray.placed(
                jax.ShapeDtypeStruct(x.local.shape, x.dtype), x.shape, x.spec, x.mesh
            )
            if block(x)
            else jax.ShapeDtypeStruct(x.shape, x.dtype)
            if is_sharded(x)
            else x
            for x in objs
        ]
        a, kw = jax.tree_util.tree_unflatten(tree, abstract)
        sharding: list[Any] = []
        for i, x in enumerate(objs):
            if not is_sharded(x) or block(x):
                sharding.append(None)
                continue
            dims = x.dims
            if not (
                dims[0].split and not any(d.split for d in dims[1:]) and _ranks(x) == comm.ranks
            ):
                raise SpmdError(
                    BAD_INPUT.format(
                        path=arg_names(self.fn, a, kw)[i],
                        spec=x.spec,
                        mesh=x.mesh,
                        ranks=list(comm.ranks),
                    ),
                    op=self.name,
                )
            sharding.append(x.shape)
        with marking(self.accumulate_steps, self.transform):
            program = trace_program(self.pure, a, kw, in_sharding=sharding)
        self.check_program(program)
        # The replica check compares the replicated parameters: shards differ by design.
        params = [i for i in marked_params(program) if sharding[i] is None]
        traced = Traced(program, params)
        traced.info["state_outputs"] = _state_outputs(args, kwargs, program.out_tree)
        traced.info["where"] = (where, axis)
        return traced

    def passes(self, traced: Traced, variant: Any) -> Pass:
        shard = shard_state(
            stage=self.stage,
            group=self.group,
            bucket_mb=self.bucket_mb,
            overlap=self.overlap,
            state_outputs=traced.info["state_outputs"],
        )
        return chain(weight_joined(group=self.group), shard) if variant else chain(shard)

    def variant(self, traced: Traced) -> Any:
        """None, or "join" under spmd.join (the program takes its weight and scale)."""
        return None if join_state(self.comm, self.name) is None else "join"

    def extra_inputs(self, traced: Traced, variant: Any) -> Sequence[Any]:
        return join_inputs(self.comm()) if variant else ()

    def results(self, traced: Traced, variant: Any, outs: Sequence[Any]) -> Any:
        placements = traced.info.get("outputs")
        if placements is None:  # checked once; each call wraps its outputs without checks
            where, axis = traced.info["where"]
            spec = make_spec(axis)
            placements = traced.info["outputs"] = [
                None if s is None else (s, normalize_spec(spec, len(s), where), where)
                for s in self.program(traced, variant).out_sharding
            ]
        wrapped = [
            val if placed is None else ShardedArray.placed(val, *placed)
            for val, placed in zip(outs, placements, strict=True)
        ]
        return self.unflatten(traced, wrapped)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not syncing():
            # The sharded step always communicates: inside no_sync its gradients would be
            # synchronized anyway and the local accumulation silently lost.
            raise SpmdError(NO_SYNC.format(name=self.name))
        return super().__call__(*args, **kwargs)


def _state_outputs(args: Sequence[Any], kwargs: dict[str, Any], out_tree: Any) -> frozenset[int]:
    """Flat positions of the outputs that are optimizer state, from the pytrees.

    An output part with the structure of some of the step's arguments (positional or keyword)
    holds their leaves in order; a leaf that is sharded in every one of those arguments is
    state, to be returned sharded even if computed from the parameters (``lars``, or
    ``add_decayed_weights`` before ``adam``). Parts are tried from the whole output down
    through tuples, lists and dicts, and the first part that marks a leaf ends the descent
    there. A leaf that a parameter argument of the same structure holds unsharded is never
    marked: an updated parameter returned sharded would break every use of it outside the
    step, while optimizer state returned full only costs memory.
    """
    ins: list[tuple[Any, list[bool]]] = []
    for arg in (*args, *kwargs.values()):
        leaves, tree = jax.tree_util.tree_flatten(arg, is_leaf=is_sharded)
        ins.append((tree, [is_sharded(x) for x in leaves]))
    out = jax.tree_util.tree_unflatten(out_tree, range(out_tree.num_leaves))
    state: set[int] = set()

    def mark(part: Any) -> bool:
        positions, tree = jax.tree_util.tree_flatten(part)
        same = [flags for t, flags in ins if t == tree]
        found = {i for k, i in enumerate(positions) if same and all(f[k] for f in same)}
        state.update(found)
        return bool(found)

    def descend(part: Any) -> None:
        if mark(part):
            return
        if isinstance(part, tuple | list):
            for element in part:
                descend(element)
        elif isinstance(part, dict):
            for element in part.values():
                descend(element)

    descend(out)
    return frozenset(state)


def _ranks(x: ShardedArray) -> tuple[int, ...]:
    where = x.mesh
    if isinstance(where, Communicator):
        return tuple(where.ranks)
    axes = x.dims[0].axes
    return tuple(where.group(axes).ranks)
