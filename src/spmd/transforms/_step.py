"""The step base: what every parallel transform does around its passes.

A :class:`Step` wraps a training step ``fn``. On a call it

1. refuses JAX tracers (a step compiles itself: called under ``jax.jit`` its Python state, the
   replica check and the no_sync accumulator, would be frozen into the trace);
2. traces ``fn`` once per input signature (pytree structure, shapes and dtypes, the active
   mesh) into a :class:`~spmd.transforms.Program`, with ``spmd.grad``'s marks;
3. on its first call, checks that the parameters ``spmd.grad`` differentiates are the same on
   every rank of the group (CRC32 checksums; ``check_params=False`` skips it), and that the
   ranks of the group would make the same collectives (:mod:`._check`);
4. applies its chain of passes to the program, once per signature and *variant* (a transform
   may run several programs from one trace, e.g. data_parallel inside ``spmd.no_sync()``), and
   runs the result compiled, on jit's fast path.

``spmd.trace(step)(*args)`` shows the transformed program. A transform subclasses Step and says
which passes to run (:meth:`Step.passes`), and, where it needs to, how it traces, which variant
a call runs and what a call passes in and gives back.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from .._errors import SpmdError
from .._jax_compat import core
from ..mesh import current_mesh, mesh_key, resolve_group
from ..runtime import Communicator, check_every, debug_checks
from ._boundary import lift, stateful, statics, unstatic
from ._check import collectives_of, compare
from ._grad import leaf_shard_groups, marking
from ._passes import Pass, gradients_reach_results, marked_params, shard_coordinate
from ._program import Program, arg_names, trace_program

PARAMS_DIFFER = (
    "the parameters differ between ranks at the first step: {detail}. Data-parallel replicas "
    "must start from one state: params = spmd.broadcast_params(params) before training (or pass "
    "check_params=False if they differ on purpose)."
)
TRACED_CALL = (
    "called inside a JAX transformation (jax.jit, jax.vmap, ...); the step compiles itself, so "
    "call it directly"
)

UNUSED_GRADIENTS = (
    "none of the step's results depends on the gradients it computes with spmd.grad or "
    "spmd.value_and_grad, so it would train nothing. A step is a pure function: what it changes "
    "in place in Python objects (a dict, a list, an object's attributes) is not seen outside "
    "it, except in Flax NNX objects passed as arguments. Return the new parameters and "
    "optimizer state, e.g. `return optax.apply_updates(params, updates), opt_state, loss`, or "
    "keep them in NNX objects (docs/data_parallel.md)"
)

_NO_SYNC: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_no_sync", default=False)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Inside this context, ``@data_parallel`` steps accumulate gradients locally, without
    communication; the next call outside it averages the accumulated sum over the group.

    As with PyTorch DDP, the outputs of the steps run inside ``no_sync`` are computed from this
    rank's local gradients; use them only for what does not need synchronised gradients.

    Example (a world of one: the accumulated gradients are averaged over one rank)::

        >>> import jax.numpy as jnp, spmd
        >>> @spmd.data_parallel
        ... def grads(w, x):
        ...     return spmd.grad(lambda w: jnp.sum(w * x))(w)
        >>> with spmd.no_sync():
        ...     _ = grads(jnp.ones(2), jnp.ones(2))
        >>> grads(jnp.ones(2), jnp.ones(2))  # the sum of both micro-batches' gradients
        Array([2., 2.], dtype=float32)
    """
    token = _NO_SYNC.set(True)
    try:
        yield
    finally:
        _NO_SYNC.reset(token)


def syncing() -> bool:
    """Whether a step called now synchronises its gradients (False inside :func:`no_sync`)."""
    return not _NO_SYNC.get()


@dataclass
class Traced:
    """One input signature of a step: its program as traced, and what was built from it."""

    program: Program  # as traced, with spmd.grad's marks
    param_inputs: list[int]  # flat positions of the parameters the replica check compares
    transformed: dict[Any, Program] = field(default_factory=dict)  # by variant
    runs: dict[Any, Callable[..., Any]] = field(default_factory=dict)  # compiled, by variant
    info: dict[str, Any] = field(default_factory=dict)  # what a transform keeps per signature


class Step:
    """A training step transformed by a chain of passes (see the module doc)."""

    transform = "step"  # how errors name the transform

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        group: Any = None,
        accumulate_steps: int = 1,
        check_params: bool = True,
    ) -> None:
        if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
            raise SpmdError(
                f"accumulate_steps={accumulate_steps!r}; expected an int >= 1", op=self.transform
            )
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.pure = stateful(fn)  # what is traced: fn, with NNX objects as their state (_nnx)
        self.group = group
        self.accumulate_steps = accumulate_steps
        self.check_params = check_params
        self._cache: dict[Any, Traced] = {}
        self._checked = False
        self._calls = 0  # calls so far (the periodic replica check's step numbers)
        self._replicas: dict[str, tuple[Communicator, list[str]]] = {}
        self.shards = 0  # data_parallel(deterministic=True): the global batch's shard count

    @property
    def name(self) -> str:
        """How errors name the step: ``data_parallel(train_step)``."""
        return f"{self.transform}({getattr(self.fn, '__name__', 'step')})"

    def comm(self) -> Communicator:
        """The step's group (an axis name resolves against the mesh active now)."""
        return resolve_group(None, self.group, op=self.transform)

    # What a transform says -----------------------------------------------------------------

    def passes(self, traced: Traced, variant: Any) -> Pass:
        """The chain of passes that makes the program of ``variant`` from ``traced.program``."""
        raise NotImplementedError

    def trace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Traced:
        """Trace ``fn`` for these arguments (with ``spmd.grad``'s marks)."""
        group = self.comm() if self.shards else None
        with marking(self.accumulate_steps, self.transform, self.shards, group):
            program = trace_program(self.pure, args, kwargs)
        self.check_program(program)
        return Traced(program, marked_params(program))

    def check_program(self, program: Program) -> None:
        """What every traced step must be: an error for one whose results ignore its
        gradients (a step that updates objects in place, which the trace does not keep)."""
        if not gradients_reach_results(program):
            raise SpmdError(UNUSED_GRADIENTS, op=self.name)

    def variant(self, traced: Traced) -> Any:
        """Which transformed program a call now runs (one per step unless overridden)."""
        return None

    def extra_inputs(self, traced: Traced, variant: Any) -> Sequence[Any]:
        """Inputs a call passes after the arguments' leaves."""
        return ()

    def results(self, traced: Traced, variant: Any, outs: Sequence[Any]) -> Any:
        """What a call returns, from the compiled program's flat outputs."""
        return self.unflatten(traced, outs)

    def unflatten(self, traced: Traced, outs: Sequence[Any]) -> Any:
        """The step's results from the program's outputs, with the results that are not arrays
        (static: a function an Equinox model holds) as they were returned."""
        out = jax.tree_util.tree_unflatten(traced.program.out_tree, outs)
        static = traced.info.get("static_results")
        if static is None:  # once per signature
            static = traced.info["static_results"] = unstatic(out) is not out
        return unstatic(out) if static else out

    # The machinery ---------------------------------------------------------------------------

    def _flat(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], list[Any], Any]:
        """The call's arguments (their leaves that are not arrays as static values), their
        leaves, and its signature."""
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))  # once per call
        try:
            # A ShardedArray flattens to its shard, and its global shape, spec and mesh are part
            # of the structure: the key tells apart arrays whose shards look alike.
            return args, kwargs, leaves, (tree, tuple(map(_aval, leaves)), mesh_key())
        except TypeError:  # a function, a string...: static, part of the signature
            names = arg_names(self.fn, args, kwargs)
            args, kwargs = statics((args, kwargs), names, self.name)
            leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
            return args, kwargs, leaves, (tree, tuple(map(_aval, leaves)), mesh_key())

    def _traced(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: Any) -> Traced:
        """The signature ``key`` of a call with these arguments."""
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self.trace(args, kwargs)
        return hit

    def program(self, traced: Traced, variant: Any) -> Program:
        """The transformed program of ``variant`` (built once)."""
        program = traced.transformed.get(variant)
        if program is None:
            program = traced.transformed[variant] = self.passes(traced, variant)(traced.program)
        return program

    def __spmd_trace__(self, *args: Any, **kwargs: Any) -> Program:
        """The step's op list with what its passes inserted (what ``spmd.trace`` shows)."""
        lifted = lift(args, kwargs)
        if lifted is not None:
            args, kwargs = lifted.args, lifted.kwargs
        args, kwargs, _, key = self._flat(args, kwargs)
        return self.program(self._traced(args, kwargs, key), None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lifted = lift(args, kwargs)
        if lifted is None:
            return self.run(args, kwargs)
        out, state = self.run(lifted.args, lifted.kwargs)
        lifted.update(state)
        return out

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call, its NNX objects lifted."""
        args, kwargs, leaves, key = self._flat(args, kwargs)
        if any(isinstance(x, core.Tracer) for x in leaves):
            raise SpmdError(TRACED_CALL, op=self.name)
        traced = self._traced(args, kwargs, key)
        variant = self.variant(traced)
        self._calls += 1
        if not self._checked:
            comm = self.comm()
            if self.check_params:
                named, blocks = self._params(traced, args, kwargs, leaves, comm)
                check_same(comm, named, self.name, blocks)
                if debug_checks():  # (collective over every mesh axis: only when asked for)
                    self._replicas = replicated_over_mesh(comm, named, blocks)
            # The pre-flight schedule check, before the first program runs.
            compare(comm, collectives_of(self.program(traced, variant)), self.name)
            self._checked = True
        elif self.check_params and debug_checks() and self._calls % check_every() == 0:
            comm = self.comm()
            named, blocks = self._params(traced, args, kwargs, leaves, comm)
            check_still_same(comm, named, blocks, self._replicas, self._calls, self.name)
        run = traced.runs.get(variant)
        if run is None:
            run = traced.runs[variant] = self.program(traced, variant)._compiled
        outs = run(*leaves, *self.extra_inputs(traced, variant))
        return self.results(traced, variant, outs)

    def _params(
        self, traced: Traced, args: Any, kwargs: Any, leaves: list[Any], comm: Communicator
    ) -> tuple[list[tuple[str, Any]], list[int | None]]:
        """The parameters the replica check compares, named, and the block of each this rank
        holds (None: not sharded)."""
        named = [(traced.program.in_names[i], leaves[i]) for i in traced.param_inputs]
        groups = leaf_shard_groups((args, kwargs))
        blocks = [shard_coordinate(groups[i], comm.world_rank) for i in traced.param_inputs]
        return named, blocks


def _aval(x: Any) -> Any:
    """``core.typeof(x)``, read from the array itself where it keeps it (a ``jax.Array``: a
    tenth of the time, which a step's every call pays per leaf)."""
    aval = getattr(x, "aval", None)
    return aval if aval is not None else core.typeof(x)


def _checksum(a: Any) -> int:
    return zlib.crc32(_canonical(a).tobytes())


def replicated_over_mesh(
    comm: Communicator, named: list[tuple[str, Any]], blocks: Sequence[int | None]
) -> dict[str, tuple[Communicator, list[str]]]:
    """At the first step: per axis of the active mesh other than the step's own group, the
    parameters (not sharded arrays) that every rank of this rank's group on that axis holds
    alike, so that a later check (``SPMD_DEBUG=1``) finds one that has drifted apart. A
    parameter that differs at the first step is taken as split over the axis (a tensor-parallel
    block). Collective over the mesh: every rank of it makes the same exchanges."""
    mesh = current_mesh()
    if mesh is None:
        return {}
    plain = [(name, a) for (name, a), b in zip(named, blocks, strict=True) if b is None]
    out: dict[str, tuple[Communicator, list[str]]] = {}
    for axis in mesh.axis_names:
        group = mesh.group(axis)
        if group.size == 1 or group.groups == comm.groups:
            continue
        sums = [_checksum(a) for _, a in plain]
        everyone = group.allgather_object(sums)
        same = [name for k, (name, _) in enumerate(plain)
                if all(len(s) == len(sums) and s[k] == sums[k] for s in everyone)]  # fmt: skip
        out[axis] = (group, same)
    return out


def check_still_same(
    comm: Communicator,
    named: list[tuple[str, Any]],
    blocks: Sequence[int | None],
    replicas: dict[str, tuple[Communicator, list[str]]],
    step: int,
    op: str,
) -> None:
    """Every ``SPMD_CHECK_EVERY`` steps under ``SPMD_DEBUG=1``: the replica check again over the
    step's group, and over each other mesh axis for the parameters its ranks held alike at the
    first step. A difference is an error on every rank of the world naming the parameter and
    the group (a parameter replicated over tp that drifts apart trains another model, silently:
    sequence parallelism without ``copy_to`` on a norm's parameters does that)."""
    from ..runtime import get_communicator

    detail = _difference(comm, named, blocks)
    problem = (
        f"at step {step}, the parameters differ between the ranks {list(comm.ranks)} of the step's "
        f"group, though they were the same at the first step: {detail}"
        if detail
        else ""
    )
    values = dict(named)
    for axis, (group, names) in replicas.items():
        sums = [_checksum(values[n]) for n in names]
        everyone = group.allgather_object(sums)
        drifted = [n for k, n in enumerate(names) if any(s[k] != sums[k] for s in everyone)]
        if drifted and not problem:
            problem = (
                f"at step {step}, the parameter {drifted[0]} differs between the ranks "
                f"{list(group.ranks)} of the mesh axis {axis!r} ({len(drifted)} of the "
                f"{len(names)} parameters they held alike at the first step have drifted "
                f"apart). A parameter replicated over {axis!r} must get the same update on "
                "each of its ranks: under sequence parallelism read replicated parameters (a "
                "norm's scale and bias) through spmd.tensor_parallel.copy_to, so that their "
                "gradients are summed over the group (docs/model_parallel.md)"
            )
    problems = [p for p in get_communicator().allgather_object(problem) if p]
    if problems:
        raise SpmdError(problems[0], op=op)


def _canonical(x: Any) -> np.ndarray:
    """The bytes the replica check compares: -0.0 counts as 0.0 (equal values, other bits)."""
    a = np.ascontiguousarray(x)
    if np.issubdtype(a.dtype, np.inexact) or a.dtype.name == "bfloat16":
        a = np.where(a == 0, np.zeros((), a.dtype), a)
    return a


def check_same(
    comm: Communicator,
    named: list[tuple[str, Any]],
    op: str,
    blocks: Sequence[int | None] | None = None,
) -> None:
    """Raise on every rank if the arrays of ``named`` ((name, array) pairs) differ between the
    ranks of ``comm``, naming the ranks and the first array that differs. ``blocks`` gives, per
    array, which block of a sharded parameter this rank holds (None: replicated): such an array
    is compared only between the ranks that hold the same block."""
    detail = _difference(comm, named, blocks)
    if detail:
        raise SpmdError(PARAMS_DIFFER.format(detail=detail), op=op)


def _difference(
    comm: Communicator, named: list[tuple[str, Any]], blocks: Sequence[int | None] | None
) -> str:
    """What differs between the ranks of ``comm`` (check_same), the same on every rank; ""."""
    if comm.size == 1 or not named:
        return ""
    sums = [(_checksum(a), None if blocks is None else blocks[k]) for k, (_, a) in enumerate(named)]
    everyone = comm.allgather_object(sums)
    differ = [r for r, s in enumerate(everyone) if not _agree(s, everyone)]
    if not differ:
        return ""
    first = differ[0]
    if len(everyone[first]) != len(sums) or len(everyone[0]) != len(sums):
        counts = {comm.ranks[r]: len(s) for r, s in enumerate(everyone)}
        return (
            f"the ranks hold different numbers of parameter arrays (rank: count {counts}); "
            "every rank must pass the same parameter structure"
        )
    theirs = _reference(everyone[first], everyone)
    bad = [name for (name, _), a, b in zip(named, theirs, everyone[first], strict=True)
           if a != b]  # fmt: skip
    ranks = [comm.ranks[r] for r in differ]
    return (
        f"ranks {ranks} hold other values than rank {comm.ranks[0]} "
        f"(first difference: {bad[0]}; {len(bad)} of {len(sums)} parameter arrays differ "
        f"on rank {comm.ranks[first]})"
    )


def _reference(mine: list[Any], everyone: list[list[Any]]) -> list[Any]:
    """Per array, the (checksum, block) of the first rank that holds the same block as
    ``mine`` does (rank 0's for replicated arrays)."""
    out = []
    for k, (_, block) in enumerate(mine):
        out.append(next(s[k] for s in everyone if len(s) == len(mine) and s[k][1] == block))
    return out


def _agree(mine: list[Any], everyone: list[list[Any]]) -> bool:
    if len(mine) != len(everyone[0]):
        return False
    return _reference(mine, everyone) == mine
