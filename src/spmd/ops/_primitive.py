"""What every collective primitive shares: the group it carries, how it is made, lowered to its
FFI handlers, and called eagerly. Each op module holds only what is particular to its family.

A collective's parameters always include ``group``, a :class:`GroupRef`. Its lowering emits the
FFI custom call ``spmd_<op>`` on CPU and ``spmd_cuda_<op>`` on GPU through ``jax.ffi``, with one
extra operand and result, the order value of :mod:`._ordering`.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from .._errors import SpmdError
from .._jax_compat import command_buffer_traits, core, dispatch, ir, mlir
from .._native_lib import native, require_native_cuda, tables
from ..mesh import resolve_group
from ..runtime import cuda_graphs, find_native_group, gpu_active
from . import _gpu_chain, _ordering

_ROLES: dict[str, int] = tables()["roles"]
_ROLE_SHIFT: int = tables()["role_shift"]
_MARKER: str = tables()["error_marker"]


# -- the group a primitive carries ----------------------------------------------------------


@dataclass(frozen=True)
class GroupRef:
    """A group as a primitive sees it: its native id, this rank's rank and the world ranks.

    Hashable, so that jit caches on it. ``role`` says where the collective comes from: called
    as written (``"forward"``), emitted by a JVP rule on tangents (``"jvp"``), or by a transpose
    rule (``"backward"``). It travels to the native layer with the group id and joins the
    signature the ranks compare, so that a rank in the backward pass of a collective the others
    did not differentiate gets a mismatch error instead of pairing its backward collective with
    another rank's next forward one.
    """

    gid: int
    rank: int
    ranks: tuple[int, ...]
    role: str = "forward"
    meaning: str = ""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def world_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def attr(self) -> int:
        """The custom call's ``group`` attribute: the id, and the role in the top byte."""
        return self.gid | (_ROLES[self.role] << _ROLE_SHIFT)

    def jvp(self) -> GroupRef:
        """This group for a collective a JVP rule emits."""
        return replace(self, role="jvp")

    def backward(self) -> GroupRef:
        """This group for a collective a transpose rule emits."""
        return replace(self, role="backward")

    def meant(self, text: str) -> GroupRef:
        """This group for a call whose meaning the native parameters do not show: ``text``
        (e.g. ``"op=avg"``, which runs as a sum, or the axes the Python side moved to axis 0)
        joins the signature the ranks compare on CPU, and the mismatch message."""
        return replace(self, meaning=text)

    def __repr__(self) -> str:
        role = "" if self.role == "forward" else f", {self.role}"
        return f"ranks={list(self.ranks)}{role}"


def resolve(
    rank_list: Any = None, group: Any = None, *, op: str | None = None, p2p: bool = False
) -> GroupRef:
    """The group of an op call from its ``rank_list=`` or ``group=`` argument, prepared for
    collectives (collective over the group the first time; ``p2p``: only what point-to-point
    calls need, see :meth:`spmd.Communicator.native_group`)."""
    comm = resolve_group(rank_list, group, op=op)
    ng = comm.native_group(p2p=p2p, gpu_settings=_gpu_chain.chain_config)
    return GroupRef(ng.gid, comm.rank, comm.ranks)


def alone(ref: GroupRef) -> bool:
    """Whether a collective over ``ref`` returns its input without a call: a group of one,
    except on a GPU with NCCL forced, so that a single GPU checks every NCCL handler."""
    return ref.size == 1 and not (gpu_active() and _gpu_chain.chain_config().transport == "nccl")


# -- the primitive ------------------------------------------------------------------------------


def collective_primitive(name: str) -> core.Primitive:
    """A multiple-results collective primitive (see :func:`._ordering.register`), run eagerly
    through a cached jit of itself: compiled once per parameters, never per call."""
    p = core.Primitive(name)
    p.multiple_results = True
    p.def_impl(functools.partial(_run_eagerly, p))
    _ordering.register(p)
    return p


def bind(prim: core.Primitive, *args: Any, **params: Any) -> list[Any]:
    """Bind ``prim`` from an op's public function: its results as a list (eagerly, once they
    are ready). The first bind in the process installs the ordering rules."""
    _ordering.install()
    return list(prim.bind(*args, **params))


def _run_eagerly(prim: core.Primitive, *args: Any, **params: Any) -> Any:
    """An eager call (also one a JVP or transpose rule makes under eager ``jax.grad``): waits
    for the result so that a failure is raised here, on every rank, as :class:`spmd.SpmdError`."""
    try:
        outs = dispatch.apply_primitive(prim, *args, **params)
        jax.block_until_ready(outs)
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        # JaxRuntimeError from a first call; a cached executable's fast path raises ValueError
        # with the same text. Anything without spmd's marker goes up unchanged.
        raise translate_error(e) from None
    return outs


def translate_error(e: Exception) -> Exception:
    """A native collective's failure as the SpmdError it reports; other errors unchanged. The
    native text already starts with the rank and the op."""
    text = str(e)
    at = text.find(_MARKER)
    if at < 0:
        return e
    return SpmdError(text[at + len(_MARKER) :].strip(), rank=None)


# -- lowering -----------------------------------------------------------------------------------

_ORDER = core.ShapedArray((1,), np.dtype(np.uint8))


def _attribute(value: Any) -> Any:
    """An FFI attribute: tuples become i64 arrays (``Span<const int64_t>`` in C++); ints, NumPy
    scalars and bools go to ``jax.ffi`` as they are (i64, their own width, bool)."""
    if isinstance(value, tuple):
        return ir.DenseI64ArrayAttr.get([int(v) for v in value])
    return value


def lower_collective(
    ctx: mlir.LoweringRuleContext, target: str, operands: Sequence[Any], **attrs: Any
) -> list[Any]:
    """Emit the FFI custom call ``target`` after the previous collective of the block.

    Attributes: Python ints become i64, NumPy scalars keep their type, tuples become i64
    arrays. The call is marked as having side effects, so XLA never removes or merges it.
    """
    _ensure_targets("cuda" if target.startswith("spmd_cuda_") else "cpu")
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    chained = ctx.replace(avals_in=[_ORDER, *ctx.avals_in], avals_out=[_ORDER, *ctx.avals_out])
    results = rule(
        chained, _ordering.chain_end(ctx), *operands,
        **{k: _attribute(v) for k, v in attrs.items()},
    )  # fmt: skip
    _ordering.extend(ctx, results[0])
    return list(results[1:])


# -- what the GPU handlers compare ----------------------------------------------------------------

# Point-to-point calls involve two ranks of their group: no group-wide comparison (on CPU, recv
# checks the sender's shape and dtype instead).
_NOT_COMPARED = frozenset({"sendrecv", "send", "recv"})
# Ops whose arrays may differ in their first dimension from rank to rank.
_ROWS_VARY = frozenset({"all_to_allv"})
_sites = itertools.count(1)


def shape_text(aval: Any, rows_vary: bool = False) -> str:
    """An array's dtype and shape as the ranks compare them, ``float32[4,8]`` (``float32[*,8]``
    where its rows may differ from rank to rank)."""
    dims = [str(d) for d in aval.shape]
    if rows_vary and dims:
        dims[0] = "*"
    return f"{np.dtype(aval.dtype).name}[{','.join(dims)}]"


def describe_call(op: str, avals: Sequence[Any], params: dict[str, Any]) -> str:
    """One call written out as the ranks compare it on GPU: the op, its parameters (the call's
    meaning as written, e.g. ``op=avg``, and every static parameter), its arrays' dtypes and
    shapes, and where it comes from in differentiation; "" for calls that are not compared."""
    if op in _NOT_COMPARED:
        return ""
    group: GroupRef = params["group"]
    vary = op in _ROWS_VARY or (op == "allgather" and bool(params.get("sizes")))
    # Not compared: the op where the meaning says it (avg runs as a sum), and the output rows
    # where the rows vary (each rank receives its own number).
    skip = {"group", *(["op"] if "op=" in group.meaning else []), *(["out_rows"] if vary else [])}
    parts = [group.meaning] if group.meaning else []
    for k, v in sorted(params.items()):
        if k not in skip and v is not None and v != ():
            parts.append(f"{k}=[{','.join(map(str, v))}]" if isinstance(v, tuple) else f"{k}={v}")

    leaves = ", ".join(shape_text(a, vary) for a in avals) or "no arrays"
    text = f"{op}({', '.join(parts)}) of {leaves}"
    return text + {"forward": "", "jvp": " [JVP]", "backward": " [backward pass]"}[group.role]


def check_attrs(op: str, avals: Sequence[Any], params: dict[str, Any]) -> dict[str, Any]:
    """The GPU handler's ``site`` (this call of this program, numbered at lowering; the ranks
    compare each site the first time it runs, or every call under ``SPMD_DEBUG=1``) and
    ``check`` (:func:`describe_call`) attributes."""
    return {"site": next(_sites), "check": describe_call(op, avals, params)}


_targets: set[str] = set()
# GPU handlers that wait for their stream (all_to_allv reads its counts on the host): a CUDA
# graph cannot hold them, so XLA must never capture them in one.
_WAITS_FOR_DEVICE = frozenset({"spmd_cuda_all_to_allv"})
_targets_lock = threading.Lock()


def _ensure_targets(platform: str) -> None:
    """Register the handlers of ``platform`` with XLA (once). The CUDA handlers are command
    buffer compatible, so XLA may capture them in CUDA graphs, unless ``SPMD_CUDA_GRAPHS=0``
    (or they wait for the device, ``_WAITS_FOR_DEVICE``)."""
    if platform in _targets:
        return
    with _targets_lock:
        if platform in _targets:
            return
        if platform == "cpu":
            for name, capsule in native.cpu_handlers().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        else:
            graphs = cuda_graphs()
            for name, capsule in require_native_cuda().cuda_handlers().items():
                traits = command_buffer_traits(graphs and name not in _WAITS_FOR_DEVICE)
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA", traits=traits)
        _targets.add(platform)


Rule = Callable[..., list[Any]]


def register_rules(prim: core.Primitive, cpu_rule: Rule, cuda_rule: Rule) -> None:
    # Not cacheable: the rule must run in the block it lowers into, where the chain lives.
    mlir.register_lowering(prim, cpu_rule, platform="cpu", cacheable=False)
    mlir.register_lowering(prim, cuda_rule, platform="cuda", cacheable=False)


def gpu_side(group: GroupRef, op: str) -> Any:
    """What the GPU chain knows of ``group`` (:class:`spmd.runtime.GpuGroup`), or an error."""
    ng = find_native_group(group.gid)
    if ng is None or ng.gpu is None:
        raise SpmdError(
            "this group has no GPU side (it was created before JAX ran on the GPU, or "
            "spmd.finalize() was called)",
            op=op,
        )
    return ng.gpu


def collective_rules(
    target: str,
    cuda_attrs: Callable[..., dict[str, Any]] | None = None,
    pass_operands: bool = True,
    cpu_attrs: Callable[..., dict[str, Any]] | None = None,
    **attr_params: Callable[..., Any],
) -> tuple[Rule, Rule]:
    """The lowering rules (CPU, GPU) of a collective to the FFI target ``target`` on CPU and
    ``spmd_cuda_<op>`` on GPU.

    ``attr_params`` map FFI attribute names to functions of the primitive's parameters;
    ``cuda_attrs(ctx, **params)`` adds the GPU handler's own attributes (the all-reduce's
    algorithm per leaf), ``cpu_attrs(**params)`` the CPU handler's own. ``pass_operands=False``:
    the native call takes none of the primitive's operands (recv's, which only carry batch axes).
    """
    op = target.removeprefix("spmd_")

    def attributes(params: dict[str, Any]) -> dict[str, Any]:
        return {"group": params["group"].attr, **{k: f(**params) for k, f in attr_params.items()}}

    def cpu_rule(ctx: mlir.LoweringRuleContext, *operands: Any, **params: Any) -> list[Any]:
        if not pass_operands:
            ctx, operands = ctx.replace(avals_in=[]), ()
        attrs = {**attributes(params), "meaning": params["group"].meaning}
        if cpu_attrs is not None:
            attrs.update(cpu_attrs(**params))
        return lower_collective(ctx, target, operands, **attrs)

    def cuda_rule(ctx: mlir.LoweringRuleContext, *operands: Any, **params: Any) -> list[Any]:
        if not pass_operands:
            ctx, operands = ctx.replace(avals_in=[]), ()
        attrs = {**attributes(params), **check_attrs(op, ctx.avals_in, params)}
        if cuda_attrs is not None:
            attrs.update(cuda_attrs(ctx, **params))
        else:  # everything but the all-reduce runs on NCCL
            gpu_side(params["group"], op).require_nccl(f"the GPU {op}", op=op)
        return lower_collective(ctx, "spmd_cuda_" + op, operands, **attrs)

    return cpu_rule, cuda_rule


def register_lowering(
    prim: core.Primitive,
    target: str,
    cuda_attrs: Callable[..., dict[str, Any]] | None = None,
    pass_operands: bool = True,
    cpu_attrs: Callable[..., dict[str, Any]] | None = None,
    **attr_params: Callable[..., Any],
) -> None:
    """Lower ``prim`` to the FFI target ``target`` on CPU and ``spmd_cuda_<op>`` on GPU (the
    rules of :func:`collective_rules`)."""
    register_rules(
        prim, *collective_rules(target, cuda_attrs, pass_operands, cpu_attrs, **attr_params)
    )
