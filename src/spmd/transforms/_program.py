"""The op list: ``spmd.trace(fn)(*args) -> Program``.

A Program is a function as JAX traces it (a closed jaxpr) together with the pytree structure of
its inputs and outputs. Its ops are the jaxpr's equations, read top to bottom; ``str(program)``
prints them as a readable IR in the spirit of RAF's::

    def @train_step(%params.w: Tensor[(784, 10), float32], %batch.0: ...) {
      let %x_1 = dot_general(%batch.0, %params.w) /* ty=Tensor[(64, 10), float32] */;
      ...
      let (%x_9, %x_10) = spmd.allreduce(%x_7, %x_8) /* op=sum, group=[0, 1], ty=(...) */;
      (%x_12, %x_13)
    }

Passes are functions ``Program -> Program``; they rewrite a program by re-evaluating its ops
under a fresh trace (:func:`retrace`), inserting or replacing ops on the way. A Program runs
compiled: calling it jit-compiles the op list once and then takes jit's fast path.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from .._errors import SpmdError
from .._jax_compat import ClosedJaxpr, core, is_closed_jaxpr
from ..ops import holds_collective
from ._column import check_column_splits, strip_columns

__all__ = ["Env", "Op", "Program", "eval_eqn", "retrace", "trace"]

Shape = tuple[int, ...]


# -- API ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One op of a Program: its name, the names of its inputs and outputs, and its parameters."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: dict[str, Any] = field(repr=False)


class Program:
    """A traced function: a closed jaxpr, the input and output pytree structures, and names.

    Call it with arguments of the structure, shapes and dtypes it was traced with; it runs
    compiled (``jax.jit`` of the op list, compiled once).

    ``in_sharding`` and ``out_sharding`` say, per flat input and output, whether the value is
    split by rows (axis 0) over the step's group: its global shape, or None for a full value.
    A program as traced has none sharded; the ZeRO pass reads ``in_sharding`` and sets
    ``out_sharding``.
    """

    def __init__(
        self,
        jaxpr: ClosedJaxpr,
        in_tree: Any,
        out_tree: Any,
        *,
        name: str = "main",
        in_names: Sequence[str] | None = None,
        in_sharding: Sequence[Shape | None] | None = None,
        out_sharding: Sequence[Shape | None] | None = None,
    ) -> None:
        self.jaxpr = jaxpr
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.name = name
        n, m = len(jaxpr.jaxpr.invars), len(jaxpr.jaxpr.outvars)
        self.in_names = (
            tuple(in_names) if in_names is not None else tuple(f"in{i}" for i in range(n))
        )
        if len(self.in_names) != n:
            raise SpmdError(f"Program {name}: {len(self.in_names)} input names for {n} inputs")
        self.in_sharding = tuple(in_sharding) if in_sharding is not None else (None,) * n
        self.out_sharding = tuple(out_sharding) if out_sharding is not None else (None,) * m

    def replace(
        self,
        jaxpr: ClosedJaxpr,
        out_tree: Any = None,
        *,
        out_sharding: Sequence[Shape | None] | None = None,
    ) -> Program:
        """The same signature with another op list (what a pass returns)."""
        return Program(
            jaxpr,
            self.in_tree,
            self.out_tree if out_tree is None else out_tree,
            name=self.name,
            in_names=self.in_names,
            in_sharding=self.in_sharding,
            out_sharding=out_sharding,
        )

    def with_inputs(self, jaxpr: ClosedJaxpr, names: Sequence[str]) -> Program:
        """The same program taking more inputs, last, full (not sharded): ``jaxpr`` reads the
        program's inputs and then one input per name of ``names``. Called with them as more
        positional arguments (where it takes no keyword arrays; a step passes them after the
        arguments' leaves)."""
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, [0] * self.in_tree.num_leaves)
        more = [0] * len(names)
        tree = (
            ((*args, *more), kwargs)
            if not jax.tree_util.tree_leaves(kwargs)
            else ((args, kwargs), more)  # (flattened in the jaxpr's order all the same)
        )
        return Program(
            jaxpr,
            jax.tree_util.tree_structure(tree),
            self.out_tree,
            name=self.name,
            in_names=[*self.in_names, *names],
            in_sharding=[*self.in_sharding, *(None for _ in names)],
            out_sharding=self.out_sharding,
        )

    @property
    def ops(self) -> list[Op]:
        """The ops, in program order (the jaxpr's top-level equations)."""
        names = _Names(self)
        return [
            Op(
                _op_name(e),
                tuple(names.ref(v) for v in e.invars),
                tuple(names.define(v) for v in e.outvars),
                dict(e.params),
            )
            for e in self.jaxpr.jaxpr.eqns
        ]

    @functools.cached_property
    def _compiled(self) -> Callable[..., Any]:
        return jax.jit(core.jaxpr_as_fun(self.jaxpr))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self.in_tree:
            raise SpmdError(
                f"Program {self.name} was traced for arguments of structure {self.in_tree}; "
                f"called with {tree}. Trace it again for these arguments."
            )
        for name, v, leaf in zip(self.in_names, self.jaxpr.jaxpr.invars, leaves, strict=True):
            got = core.typeof(leaf)
            if (got.shape, got.dtype) != (v.aval.shape, v.aval.dtype):
                # jit would run the op list at the new shape with sizes the trace baked in
                # (a mean divided by the traced length): refuse instead.
                raise SpmdError(
                    f"Program {self.name}: input %{name} was traced as {_ty(v.aval)}; called "
                    f"with {_ty(got)}. Trace it again for these arguments."
                )
        return jax.tree_util.tree_unflatten(self.out_tree, self._compiled(*leaves))

    def __str__(self) -> str:
        return _print(self)

    def __repr__(self) -> str:
        return f"<spmd.Program {self.name}: {len(self.jaxpr.jaxpr.eqns)} ops>"


def trace(fn: Callable[..., Any]) -> Callable[..., Program]:
    """``spmd.trace(fn)(*args, **kwargs)``: the op list of ``fn`` for these arguments.

    ``fn`` may be a plain function (traced by ``jax.make_jaxpr``; ``spmd.grad`` inside it marks
    the gradients it produces) or a transformed step such as ``@spmd.data_parallel``, whose
    Program shows the collectives the transform inserted.

    Example::

        >>> import jax.numpy as jnp, spmd
        >>> program = spmd.trace(lambda x, y: x * y + 1)(jnp.ones(2), jnp.ones(2))
        >>> print(program)
        def @<lambda>(%x: Tensor[(2,), float32], %y: Tensor[(2,), float32]) {
          let %x_1 = mul(%x, %y) /* ty=Tensor[(2,), float32] */;
          let %x_2 = add(%x_1, 1.0) /* ty=Tensor[(2,), float32] */;
          %x_2
        }
        >>> program(jnp.ones(2), jnp.full(2, 2.0))
        Array([3., 3.], dtype=float32)
    """
    custom = getattr(fn, "__spmd_trace__", None)
    if custom is not None:
        return custom  # type: ignore[no-any-return]

    def traced(*args: Any, **kwargs: Any) -> Program:
        from ._grad import marking

        with marking():
            return trace_program(fn, args, kwargs)

    return traced


# -- tracing --------------------------------------------------------------------------------------


def arg_names(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list[str]:
    """Readable names for the flattened inputs: the parameter name plus the pytree path."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names: list[str] = []
    for i, a in enumerate(args):
        base = positional[i] if i < len(positional) else f"arg{i}"
        names += [base + path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
    for k in sorted(kwargs):  # as tree_flatten orders a dict: by key, not by call order
        names += [k + path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(kwargs[k])[0]]
    return names


def path_name(path: Any) -> str:
    """``['w'][0].mu`` -> ``.w.0.mu``."""
    text = jax.tree_util.keystr(path)
    return "".join("." + p for p in re.findall(r"[\w]+", text))


def trace_program(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    in_sharding: Sequence[Shape | None] | None = None,
) -> Program:
    """Trace ``fn(*args, **kwargs)`` into a Program (no marking context change)."""
    leaves, in_tree = jax.tree_util.tree_flatten((tuple(args), kwargs))

    def flat(*xs: Any) -> Any:
        a, kw = jax.tree_util.tree_unflatten(in_tree, xs)
        return fn(*a, **kw)

    try:
        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    except NameError as e:
        raise _named_axis_error(e) from None
    out_tree = jax.tree_util.tree_structure(out_shape)
    name = getattr(fn, "__name__", "main")
    names = arg_names(fn, args, kwargs)
    check_column_splits(closed, names, name)
    closed = strip_columns(closed)
    return Program(
        closed,
        in_tree,
        out_tree,
        name=name,
        in_names=names,
        in_sharding=in_sharding,
    )


def _named_axis_error(e: NameError) -> Exception:
    """A ``jax.lax.pmean(x, "batch")`` left in a step ported from ``pmap``: JAX's NameError says to
    use ``shard_map``, the wrong way for spmd; say what spmd does instead. Other NameErrors as
    they are."""
    found = re.search(r"unbound axis name: ([^\s.]+)", str(e))
    if found is None:
        return e
    axis = found.group(1)
    return SpmdError(
        f"a collective over the named axis {axis!r} (jax.lax.pmean, psum, all_gather, "
        "axis_index, ...) was traced in a step, but spmd runs one process per device with no "
        "named axes: those need pmap or shard_map. In a data_parallel/zero_shard step the "
        "gradients of spmd.grad/spmd.value_and_grad are already averaged over the group: remove "
        "the jax.lax.pmean of them. For other values use spmd.allreduce(x, 'avg') (or "
        "'sum'), with group= naming a mesh axis where the mesh has one. docs/pmap.md maps "
        "pmap's idioms to spmd's"
    )


# -- passes: re-evaluation ------------------------------------------------------------------------


def eval_eqn(eqn: core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Bind one op again (under whatever trace is current); always a list of outputs."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # jax < 0.7 returns (subfuns, params); newer versions the params alone.
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


class Env:
    """Values of a jaxpr's variables during re-evaluation."""

    def __init__(self) -> None:
        self.values: dict[core.Var, Any] = {}

    def read(self, v: Any) -> Any:
        if isinstance(v, core.Literal):
            return v.val
        return self.values[v]

    def write(self, v: Any, value: Any) -> None:
        if not isinstance(v, core.DropVar):
            self.values[v] = value


def retrace(
    program: Program,
    body: Callable[[Env, Sequence[Any]], Sequence[Any]],
    extra_in: Sequence[core.ShapedArray] = (),
    in_avals: Sequence[core.ShapedArray] | None = None,
) -> ClosedJaxpr:
    """The closed jaxpr of ``body(env, inputs)``, traced with the program's inputs followed by
    ``extra_in``. ``body`` re-evaluates the program's ops (``eval_eqn``) and may add its own.
    ``in_avals`` replaces the program's input types (a pass that changes their shapes)."""
    jaxpr = program.jaxpr
    if in_avals is None:
        in_avals = [v.aval for v in jaxpr.jaxpr.invars]
    avals = list(in_avals) + list(extra_in)

    def run(*xs: Any) -> list[Any]:
        env = Env()
        for v, c in zip(jaxpr.jaxpr.constvars, jaxpr.consts, strict=True):
            env.write(v, c)
        return list(body(env, xs))

    return jax.make_jaxpr(run)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))


# -- printing -------------------------------------------------------------------------------------

_HIDDEN_PARAMS = {"out_sharding", "precision", "preferred_element_type", "sharding", "jaxpr",
                  "accumulation_type", "group", "op", "shards"}  # fmt: skip


def _op_name(eqn: core.JaxprEqn) -> str:
    name = eqn.primitive.name
    return "spmd." + name[len("spmd_") :] if name.startswith("spmd_") else name


def _ty(aval: Any) -> str:
    if isinstance(aval, core.ShapedArray):
        return f"Tensor[{tuple(aval.shape)}, {getattr(aval.dtype, 'name', aval.dtype)}]"
    return str(aval)


def _attrs(eqn: core.JaxprEqn) -> list[str]:
    attrs = []
    p = eqn.params
    if "op" in p:
        attrs.append(f"op={p['op']}")
    if "group" in p:
        group = p["group"]
        attrs.append(f"group={list(getattr(group, 'ranks', [group]))}")
        role = getattr(group, "role", "forward")
        if role != "forward":
            attrs.append(f"role={role}")
    if "name" in p and isinstance(p["name"], str):
        return [f"name={p['name']}", *attrs]
    for k, v in p.items():
        if k in _HIDDEN_PARAMS or k == "name" or v is None:
            continue
        text = repr(v)
        if len(text) <= 40 and not (is_closed_jaxpr(v) or isinstance(v, core.Jaxpr)):
            attrs.append(f"{k}={text}")
    return attrs


def _literal(value: Any) -> str:
    a = np.asarray(value)
    if a.ndim:
        return f"<{_ty(core.ShapedArray(a.shape, a.dtype))}>"
    if np.issubdtype(a.dtype, np.floating):
        return np.format_float_positional(a.dtype.type(a.item()), trim="0")
    return repr(a.item())


class _Names:
    """Printed names: inputs by their argument names, constants %c_i, values %x_i; each name
    used once (a clash gets a numbered suffix)."""

    def __init__(self, program: Program) -> None:
        self.names: dict[core.Var, str] = {}
        self.used: set[str] = set()
        jaxpr = program.jaxpr.jaxpr
        for v, n in zip(jaxpr.invars, program.in_names, strict=True):
            self.names[v] = self._fresh("%" + n)
        for i, v in enumerate(jaxpr.constvars):
            self.names[v] = self._fresh(f"%c_{i}")
        self.count = 0

    def _fresh(self, name: str) -> str:
        out, k = name, 1
        while out in self.used:
            k += 1
            out = f"{name}#{k}"
        self.used.add(out)
        return out

    def define(self, v: Any) -> str:
        if isinstance(v, core.DropVar):
            return "_"
        while True:
            self.count += 1
            name = f"%x_{self.count}"
            if name not in self.used:
                break
        self.used.add(name)
        self.names[v] = name
        return name

    def bind(self, v: Any, name: str) -> None:
        """``v`` (a nested body's input) names the same value as ``name``."""
        self.names[v] = name

    def ref(self, v: Any) -> str:
        if isinstance(v, core.Literal):
            return _literal(v.val)
        return self.names[v]


def _print(program: Program) -> str:
    jaxpr = program.jaxpr.jaxpr
    names = _Names(program)
    args = ", ".join(f"{names.ref(v)}: {_ty(v.aval)}" for v in jaxpr.invars)
    lines = [f"def @{program.name}({args}) {{"]
    _print_eqns(jaxpr, names, lines, "  ")
    results = [names.ref(v) for v in jaxpr.outvars]
    lines.append("  " + (results[0] if len(results) == 1 else "(" + ", ".join(results) + ")"))
    lines.append("}")
    return "\n".join(lines)


def _print_eqns(jaxpr: core.Jaxpr, names: _Names, lines: list[str], indent: str) -> None:
    for eqn in jaxpr.eqns:
        ins = ", ".join(names.ref(v) for v in eqn.invars)
        body = _called_body(eqn)
        inner: list[str] = []
        if body is not None:
            # A call holding collectives (a jitted helper): its ops, collectives included,
            # nested under it, with its inputs named as the caller's.
            for v, outer in zip(body.invars, eqn.invars, strict=True):
                names.bind(v, names.ref(outer))
            for c in body.constvars:
                names.bind(c, "<const>")
            _print_eqns(body, names, inner, indent + "  ")
            results = [names.ref(v) for v in body.outvars]
            inner.append(indent + "  " + (results[0] if len(results) == 1 else
                                          "(" + ", ".join(results) + ")"))  # fmt: skip
        outs = [names.define(v) for v in eqn.outvars]
        lhs = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
        tys = [_ty(v.aval) for v in eqn.outvars]
        ty = tys[0] if len(tys) == 1 else "(" + ", ".join(tys) + ")"
        note = ", ".join([*_attrs(eqn), f"ty={ty}"])
        head = f"{indent}let {lhs} = {_op_name(eqn)}({ins}) /* {note} */"
        if body is None:
            lines.append(head + ";")
        else:
            lines += [head + " {", *inner, indent + "};"]


def _called_body(eqn: core.JaxprEqn) -> core.Jaxpr | None:
    """The body of a call-like op (jit, closed_call, remat, custom derivatives) that holds
    collectives and takes the op's operands as its inputs; None for any other op."""
    for value in eqn.params.values():
        body = value.jaxpr if is_closed_jaxpr(value) else value
        if (
            isinstance(body, core.Jaxpr)
            and len(body.invars) == len(eqn.invars)
            and len(body.outvars) == len(eqn.outvars)
            and holds_collective(body)
        ):
            return body
    return None
