"""The collectives of a traced program in the order they are written, each as the ranks compare
it (:func:`._primitive.describe_call`), with its group and the user's source line: what
``spmd.check`` compares across ranks before a program runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .._jax_compat import core, user_frames
from ._primitive import GroupRef, describe_call, shape_text

_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class PreflightCall:
    """One collective of a program: ``text`` as the ranks compare it ("" for point-to-point
    calls, which two ranks of the group make), ``ranks`` the world ranks of its group, and
    ``where`` the user's line that made it ("file.py:12 (fn)")."""

    text: str
    ranks: tuple[int, ...]
    where: str


def _where(eqn: Any) -> str:
    """The innermost frame outside JAX and spmd, else the innermost outside JAX."""
    frames = user_frames(eqn)
    mine = [f for f in frames if not f[0].startswith(_SPMD_DIR)] or frames
    if not mine:
        return "unknown location"
    file, line, fn = mine[0]
    return f"{os.path.basename(file)}:{line} ({fn.rpartition('.')[2]})"


def collective_calls(jaxpr: Any) -> list[PreflightCall]:
    """The collectives of ``jaxpr`` (open or closed) and of the jaxprs nested in it, in the order
    they are written; a loop's body counts once, and every branch of a conditional in turn."""
    out: list[PreflightCall] = []
    _collect(getattr(jaxpr, "jaxpr", jaxpr), out)
    return out


def _collect(jaxpr: Any, out: list[PreflightCall]) -> None:
    for eqn in jaxpr.eqns:
        group = eqn.params.get("group")
        if isinstance(group, GroupRef):
            op = eqn.primitive.name.removeprefix("spmd_")
            text = describe_call(op, [v.aval for v in eqn.invars], eqn.params)
            out.append(PreflightCall(text, group.ranks, _where(eqn)))
            continue
        for sub in core.jaxprs_in_params(eqn.params):
            _collect(getattr(sub, "jaxpr", sub), out)


@dataclass(frozen=True)
class Message:
    """One message of a program's point-to-point calls, as this rank sends or receives it:
    ``kind`` "send" or "recv", ``ranks`` the world ranks of its group, ``peer`` the other rank's
    world rank, ``text`` the message's dtype and shape, ``where`` the user's line."""

    kind: str
    ranks: tuple[int, ...]
    peer: int
    text: str
    where: str


class Unknown(Exception):
    """A program whose messages cannot be listed: point-to-point calls in a while loop or a
    conditional (how many run, or which, is known only when it runs)."""


# Primitives whose inner program runs once each time they do.
_RUN_ONCE = frozenset(
    {"pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"}
)


def messages(jaxpr: Any) -> list[Message]:
    """The messages of ``jaxpr``'s point-to-point calls in the order this rank makes them: a
    ``lax.scan``'s body once per iteration, a ``sendrecv`` as its send then its receive.
    :class:`Unknown` where a while loop or a conditional holds one."""
    out: list[Message] = []
    _messages(getattr(jaxpr, "jaxpr", jaxpr), out)
    return out


def _messages(jaxpr: Any, out: list[Message]) -> None:
    for eqn in jaxpr.eqns:
        op = eqn.primitive.name
        group = eqn.params.get("group")
        if isinstance(group, GroupRef):
            ranks, where = group.ranks, _where(eqn)
            if op in ("spmd_send", "spmd_sendrecv"):
                out.append(Message("send", ranks, ranks[eqn.params["dst"]],
                                   shape_text(eqn.invars[0].aval), where))  # fmt: skip
            if op == "spmd_sendrecv":
                out.append(Message("recv", ranks, ranks[eqn.params["src"]],
                                   shape_text(eqn.invars[0].aval), where))  # fmt: skip
            if op == "spmd_recv":
                out.append(Message("recv", ranks, ranks[eqn.params["src"]],
                                   shape_text(eqn.outvars[0].aval), where))  # fmt: skip
            continue
        subs = [getattr(s, "jaxpr", s) for s in core.jaxprs_in_params(eqn.params)]
        inner: list[Message] = []
        for sub in subs:
            _messages(sub, inner)
        if not inner:
            continue
        if op not in _RUN_ONCE and op != "scan":  # a while loop, a conditional: not known
            raise Unknown(f"point-to-point calls inside {op} at {_where(eqn)}")
        out.extend(inner * (int(eqn.params["length"]) if op == "scan" else 1))
