"""The collectives of a traced program in the order they are written, each as the ranks compare
it (:func:`._primitive.describe_call`), with its group and the user's source line: what
``spmd.check`` compares across ranks before a program runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .._jax_compat import core, user_frames
from ._primitive import GroupRef, describe_call

_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class ScheduledCall:
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


def collective_calls(jaxpr: Any) -> list[ScheduledCall]:
    """The collectives of ``jaxpr`` (open or closed) and of the jaxprs nested in it, in the order
    they are written; a loop's body counts once, and every branch of a conditional in turn."""
    out: list[ScheduledCall] = []
    _collect(getattr(jaxpr, "jaxpr", jaxpr), out)
    return out


def _collect(jaxpr: Any, out: list[ScheduledCall]) -> None:
    for eqn in jaxpr.eqns:
        group = eqn.params.get("group")
        if isinstance(group, GroupRef):
            op = eqn.primitive.name.removeprefix("spmd_")
            text = describe_call(op, [v.aval for v in eqn.invars], eqn.params)
            out.append(ScheduledCall(text, group.ranks, _where(eqn)))
            continue
        for sub in core.jaxprs_in_params(eqn.params):
            _collect(getattr(sub, "jaxpr", sub), out)
