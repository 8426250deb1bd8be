"""Every use of JAX's internals, and every difference between the JAX versions spmd supports.

spmd's collectives are JAX primitives with lowering, autodiff and batching rules; JAX's public
API cannot define those, so spmd reaches into ``jax._src``. This module is the only one that
does: the rest of spmd imports these names from here. When a JAX release moves something, this
is the file to change. Importing it imports JAX.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

from jax._src import config as _config
from jax._src import core as core
from jax._src import dispatch as dispatch
from jax._src import source_info_util as _source_info
from jax._src import xla_bridge as _xla_bridge
from jax._src.ad_util import Zero as Zero
from jax._src.interpreters import ad as ad
from jax._src.interpreters import batching as batching
from jax._src.interpreters import mlir as mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir as ir  # type: ignore[attr-defined]
from jax._src.lib.mlir.dialects import hlo as hlo  # type: ignore[attr-defined]

__all__ = [
    "ClosedJaxpr",
    "Zero",
    "ad",
    "backends_are_initialized",
    "batching",
    "bind_params",
    "call_primitives",
    "command_buffer_traits",
    "control_flow_primitives",
    "core",
    "dce_eqn",
    "dispatch",
    "higher_order_primitives",
    "hlo",
    "ir",
    "is_closed_jaxpr",
    "jit_key_state",
    "lowering_rule",
    "mlir",
    "pe",
    "user_frames",
]

# JAX 0.12 merged ClosedJaxpr into Jaxpr (a jaxpr carries its consts; ``.jaxpr`` is itself, and
# ``Jaxpr(jaxpr, consts)`` still builds a closed one); earlier versions have both classes.
_CLOSED_JAXPR: Any = getattr(core, "ClosedJaxpr", core.Jaxpr)
if TYPE_CHECKING:
    ClosedJaxpr: TypeAlias = Any
else:
    ClosedJaxpr = _CLOSED_JAXPR


def is_closed_jaxpr(x: Any) -> TypeGuard[ClosedJaxpr]:
    """Whether ``x`` is a closed jaxpr (from JAX 0.12 every jaxpr is: open ones have no consts)."""
    return isinstance(x, _CLOSED_JAXPR)


def dce_eqn(args: Sequence[Any]) -> Any:
    """The equation a DCE rule is called for: JAX calls them as ``rule(used_outputs, eqn)``, and
    from 0.12 as ``rule(used_outputs, live_ins, eqn)``; ``args`` is what follows used_outputs."""
    return args[-1]


def bind_params(eqn: Any) -> tuple[Sequence[Any], dict[str, Any]]:
    """``(subfuns, params)`` to bind ``eqn``'s primitive again: jax < 0.7 returns both from
    ``get_bind_params``, newer versions the params alone."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    return bound if isinstance(bound, tuple) else ((), bound)


def _find(module: str, name: str) -> core.Primitive | None:
    try:
        prim = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return prim if isinstance(prim, core.Primitive) else None


def call_primitives() -> list[tuple[core.Primitive, str]]:
    """JAX's primitives that call one jaxpr on their operands, with the parameter holding it:
    nested jit, closed_call, remat (``jax.checkpoint``) and the custom-derivative calls."""
    found: list[tuple[core.Primitive, str]] = [(core.closed_call_p, "call_jaxpr")]
    for module, name, param in (
        ("jax._src.pjit", "jit_p", "jaxpr"),
        ("jax._src.pjit", "pjit_p", "jaxpr"),
        ("jax._src.ad_checkpoint", "remat_p", "jaxpr"),
        ("jax._src.custom_derivatives", "custom_jvp_call_p", "call_jaxpr"),
        ("jax._src.custom_derivatives", "custom_vjp_call_p", "call_jaxpr"),
    ):
        prim = _find(module, name)
        if prim is not None and all(prim is not p for p, _ in found):
            found.append((prim, param))
    return found


def control_flow_primitives() -> dict[str, core.Primitive]:
    """``while``, ``cond`` and ``scan`` as this JAX names them (missing ones left out)."""
    found = {}
    for name in ("while_p", "cond_p", "scan_p"):
        prim = _find("jax._src.lax.control_flow", name)
        if prim is not None:
            found[name.removesuffix("_p")] = prim
    return found


def higher_order_primitives() -> list[core.Primitive]:
    """Every JAX primitive that holds jaxprs: calls, loops, branches."""
    prims = [p for p, _ in call_primitives()]
    return prims + [p for p in control_flow_primitives().values() if p not in prims]


def lowering_rule(prim: core.Primitive) -> Any:
    """The lowering rule JAX registered for ``prim`` on every platform, or None."""
    entry = mlir._lowerings.get(prim)
    return None if entry is None else getattr(entry, "rule", entry)


def jit_key_state(name: str, help: str) -> Any:
    """A configuration state that joins jit's cache key and trace context (None where this JAX
    cannot make one): set it, and jit traces anew instead of reusing a trace made without it."""
    try:
        return _config.string_or_object_state(
            name, None, help, include_in_jit_key=True, include_in_trace_context=True
        )
    except Exception:  # pragma: no cover - a JAX without this internal API
        return None


def command_buffer_traits(enabled: bool) -> Any:
    """The custom-call target traits that let XLA capture a handler in a CUDA graph (command
    buffer), or the default ones."""
    from jaxlib import xla_client

    traits = xla_client.CustomCallTargetTraits
    return traits.COMMAND_BUFFER_COMPATIBLE if enabled else traits.DEFAULT


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends (then its devices are chosen for good)."""
    return bool(_xla_bridge.backends_are_initialized())


def user_frames(eqn: Any) -> list[tuple[str, int, str]]:
    """The frames of the Python code that made ``eqn`` (file, line, function), innermost first,
    JAX's own frames left out."""
    return [
        (f.file_name, f.start_line, f.function_name)
        for f in _source_info.user_frames(eqn.source_info.traceback)
    ]
