"""The fused-kernel trap: the output of a column-parallel layer split into parts on one rank.

A column-parallel layer gives each rank of its group a contiguous block of the weight's columns.
Splitting that rank's output into parts along the features (``q, k, v = jnp.split(qkv, 3, -1)``
after GPT-2's fused ``c_attn``) then gives rank 0 all of q and part of k: another model, which
trains without an error. The layers mark their output with ``spmd_column`` (an identity op that
records the layer's fused part count), and :func:`check_column_splits` looks, in a traced step,
for a ``split`` or a partial ``slice`` of a marked value along its last axis that the layer was
not told about (``fused=``, with the weight from ``split_qkv``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .._errors import SpmdError
from .._jax_compat import ad, batching, core, is_closed_jaxpr, mlir

column_p = core.Primitive("spmd_column")
column_p.def_impl(lambda x, **_: x)
column_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(column_p, lambda ctx, x, **_: [x])


def _jvp(primals: Any, tangents: Any, **params: Any) -> Any:
    return column_p.bind(primals[0], **params), tangents[0]


def _batch(args: Any, dims: Any, **params: Any) -> Any:
    return column_p.bind(args[0], **params), dims[0]


ad.primitive_jvps[column_p] = _jvp
batching.primitive_batchers[column_p] = _batch

# Ops that keep a value's features where they are (elementwise): a split after them is a split
# of the layer's output all the same (a bias added, an activation, a cast).
_KEEPS = {
    "add", "sub", "mul", "div", "max", "min", "neg", "exp", "log", "tanh", "logistic", "erf",
    "integer_pow", "pow", "sqrt", "rsqrt", "convert_element_type", "select_n", "copy", "copy_p",
    "abs", "sign", "square", "erf_inv", "log1p", "expm1",
}  # fmt: skip


def mark_column(y: Any, *, fused: int, layer: str, ranks: tuple[int, ...]) -> Any:
    """``y`` unchanged, marked as the output of a column-parallel layer over ``ranks``."""
    return column_p.bind(y, fused=int(fused), layer=layer, ranks=tuple(ranks))


def check_column_splits(closed: Any, in_names: list[str], op: str) -> None:
    """Raise where a traced step splits a column-parallel output into parts (see the module)."""
    jaxpr = closed.jaxpr if is_closed_jaxpr(closed) else closed
    _walk(jaxpr, dict(zip(jaxpr.invars, in_names, strict=False)), op)


def _subjaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for v in params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if is_closed_jaxpr(x):
                found.append(x.jaxpr)
            elif isinstance(x, core.Jaxpr):
                found.append(x)
    return found


def _walk(jaxpr: Any, names: dict[Any, str], op: str) -> None:
    users: dict[Any, list[Any]] = defaultdict(list)
    producer: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, core.Literal):
                users[v].append(eqn)
        for o in eqn.outvars:
            producer[o] = eqn
    for eqn in jaxpr.eqns:
        for sub in _subjaxprs(eqn.params):
            _walk(sub, {}, op)
        if eqn.primitive is column_p and eqn.params["fused"] == 1:
            bad = _split_of(eqn.outvars[0], users)
            if bad is not None:
                raise SpmdError(_message(eqn, bad, _weight_name(eqn, producer, names)), op=op)


def _split_of(y: Any, users: dict[Any, list[Any]]) -> str | None:
    """How a value derived elementwise from ``y`` is cut into parts along ``y``'s last axis."""
    width, rank = y.aval.shape[-1], len(y.aval.shape)
    todo, seen = [y], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for eqn in users.get(v, []):
            name = eqn.primitive.name
            if name == "split" and eqn.params["axis"] % rank == rank - 1:
                if len(eqn.params["sizes"]) > 1:
                    return f"split into {len(eqn.params['sizes'])} parts along its features"
            elif name == "slice":
                lo, hi = eqn.params["start_indices"][-1], eqn.params["limit_indices"][-1]
                if hi - lo < width:
                    return f"sliced to its features {lo}:{hi} of {width}"
            elif name in _KEEPS:
                o = eqn.outvars[0]
                if len(o.aval.shape) == rank and o.aval.shape[-1] == width:
                    todo.append(o)
    return None


def _weight_name(eqn: Any, producer: dict[Any, Any], names: dict[Any, str]) -> str:
    """The step input the layer's weight came from, where the op list shows it."""
    todo = [eqn.invars[0]]
    for _ in range(16):
        if not todo:
            break
        v = todo.pop(0)
        if v in names:
            return names[v].removesuffix(".value").removesuffix(".local")  # a box's own node
        e = producer.get(v)
        if e is None:
            continue
        if _is_product(e):
            todo = [e.invars[1]]
        elif e.primitive.name == "add":  # the bias: follow the product
            ins = [x for x in e.invars if not isinstance(x, core.Literal)]
            products = [x for x in ins if x in producer and _is_product(producer[x])]
            todo += products or ins
        elif e.primitive.name in ("convert_element_type", "copy", "copy_p", "spmd_mark"):
            todo.append(e.invars[e.outvars.index(v)])  # a mark: the same position
    return ""


def _is_product(e: Any) -> bool:
    """``x @ w``: a dot_general, or jnp.matmul's own jitted call of one."""
    return e.primitive.name == "dot_general" or (
        e.primitive.name in ("pjit", "jit") and e.params.get("name") in ("matmul", "dot")
    )


def _message(eqn: Any, how: str, weight: str) -> str:
    layer = eqn.params["layer"]
    what = f"the column-parallel layer {layer!r}" if layer else "a column-parallel layer"
    if weight:
        what += f" (weight {weight})"
    ranks = list(eqn.params["ranks"])
    return (
        f"the output of {what} is {how}, but each rank of the group "
        f"{ranks} holds a contiguous block of the weight's columns: rank {ranks[0]}'s first part "
        "is not its share of the full output's first part (for a fused [q|k|v] kernel on 2 "
        "ranks, rank 0 holds q and half of k), so the model would train with its parts mixed "
        "up, silently. Give a fused "
        "kernel to the layer as such: spmd.tensor_parallel.linen.ColumnDense(..., fused=3) "
        "(nnx.ColumnLinear, equinox.ColumnLinear likewise), or column_linear(..., fused=3) "
        "with the weight from spmd.tensor_parallel.split_qkv (docs/model_parallel.md, "
        "'Fused kernels'); or split the kernel into separate layers"
    )


def strip_columns(closed: Any) -> Any:
    """``closed`` without its top-level column marks (once checked they say nothing more: the
    op list a user prints shows what runs)."""
    jaxpr = closed.jaxpr
    if not any(e.primitive is column_p for e in jaxpr.eqns):
        return closed
    sub: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v if isinstance(v, core.Literal) else sub.get(v, v)

    eqns = []
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        if e.primitive is column_p:
            sub[e.outvars[0]] = ins[0]
        else:
            eqns.append(e.replace(invars=ins))
    new = jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])
    return type(closed)(new, closed.consts)
