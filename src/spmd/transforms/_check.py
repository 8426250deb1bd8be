"""The pre-flight schedule check: before a program runs, its ranks compare the collectives each
would make, group by group, and a difference is an error naming the first call that differs with
each rank's call and source line, on every rank, instead of a mismatch error (or, on GPU after
a call site's first run, a hang) when the program reaches it.

``spmd.check(step, *args)`` does it over the world for any function or transformed step; a
``data_parallel``/``zero_shard`` step does it on its first call over its own group (with
``check_params``), for the groups whose ranks all belong to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._errors import SpmdError
from ..ops import Message, Unknown, collective_calls, messages
from ..runtime import Communicator, get_communicator
from ._program import Program, trace

_OP = "spmd.check"
# Each rank's collectives as (text, group's world ranks, source line): what the ranks exchange.
Calls = list[tuple[str, tuple[int, ...], str]]


def collectives_of(program: Program) -> Calls:
    """The collectives of ``program`` as the ranks compare them (point-to-point calls left out:
    two ranks of their group make them, each its own way)."""
    return [(c.text, c.ranks, c.where) for c in collective_calls(program.jaxpr) if c.text]


def compare(comm: Communicator, mine: Calls, op: str) -> int:
    """Exchange ``mine`` over ``comm`` and raise the same error on every rank if, on a group whose
    ranks all belong to ``comm``, its ranks' calls differ: the first call that differs, each
    rank's call and source line. Returns the number of calls compared."""
    if comm.size == 1:
        return 0
    everyone: dict[int, Calls] = dict(zip(comm.ranks, comm.allgather_object(mine), strict=True))
    groups = sorted({c[1] for calls in everyone.values() for c in calls}, key=lambda g: (len(g), g))
    compared = 0
    for group in groups:
        if not all(r in everyone for r in group):
            continue
        seqs = {r: [c for c in everyone[r] if c[1] == group] for r in group}
        problem = _first_difference(group, seqs)
        if problem:
            raise SpmdError(problem, op=op, rank=None)
        compared += len(seqs[group[0]])
    return compared


def _first_difference(group: Sequence[int], seqs: dict[int, Calls]) -> str:
    """The error for the first call of ``group`` its ranks make differently ("" if none)."""
    longest = max(len(s) for s in seqs.values())
    for i in range(longest):
        at = {r: (s[i] if i < len(s) else None) for r, s in seqs.items()}
        if len({None if c is None else c[0] for c in at.values()}) == 1:
            continue
        lines = []
        for r, c in at.items():
            if c is None:
                lines.append(f"  rank {r}: no call (it makes {len(seqs[r])} on this group)")
            else:
                lines.append(f"  rank {r}: {c[0]} at {c[2]}")
        return (
            f"the ranks of the group {list(group)} would make different collective calls: "
            f"call #{i + 1} on this group is\n" + "\n".join(lines) + "\nEvery rank of a group "
            "must make the same collectives in the same order with the same shapes and dtypes "
            "(allgatherv/reduce_scatterv: the same sizes)."
        )
    return ""


def compare_messages(comm: Communicator, program: Program, op: str) -> int:
    """Exchange this rank's point-to-point messages over ``comm`` and raise the same error on
    every rank if, between two ranks of ``comm``, what one sends and what the other receives
    differ in number, order, dtype or shape: the first message that differs, with both ranks'
    calls and source lines. Returns the number of messages compared (0 where a rank's messages
    cannot be listed: see :class:`spmd.ops.Unknown`)."""
    if comm.size == 1:
        return 0
    try:
        mine: list[Message] | str = messages(program.jaxpr)
    except Unknown as e:
        mine = str(e)
    everyone = dict(zip(comm.ranks, comm.allgather_object(mine), strict=True))
    if any(isinstance(m, str) for m in everyone.values()):
        return 0
    sent: dict[tuple[Any, ...], list[Message]] = {}
    received: dict[tuple[Any, ...], list[Message]] = {}
    for r, msgs in everyone.items():
        for m in msgs:
            if m.peer in everyone:  # both ends in comm
                key = (m.ranks, r, m.peer) if m.kind == "send" else (m.ranks, m.peer, r)
                (sent if m.kind == "send" else received).setdefault(key, []).append(m)
    compared = 0
    for key in sorted(set(sent) | set(received)):
        ranks, a, b = key
        outs, ins = sent.get(key, []), received.get(key, [])
        for i in range(max(len(outs), len(ins))):
            out = outs[i] if i < len(outs) else None
            got = ins[i] if i < len(ins) else None
            if out is not None and got is not None and out.text == got.text:
                continue
            what = f"message #{i + 1} from rank {a} to rank {b} on the group {list(ranks)}"
            send = (f"sends {out.text} at {out.where}" if out else
                    f"sends nothing more (it sends {len(outs)} to rank {b})")  # fmt: skip
            recv = (f"receives {got.text} at {got.where}" if got else
                    f"receives nothing more (it receives {len(ins)} from rank {a})")  # fmt: skip
            raise SpmdError(
                f"the ranks would exchange different messages: {what}: rank {a} {send}; rank "
                f"{b} {recv}. Every send needs a receive on its destination, in the same order "
                "and with the same dtype and shape (a send without its receive waits for ever)",
                op=op,
                rank=None,
            )
        compared += len(outs)
    return compared


def check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Compare, before anything runs, the collectives ``fn(*args, **kwargs)`` would make on every
    rank of the world: collective over the world (every rank calls it, each with its own
    arguments).

    ``fn``: a function whose collectives are traced (any JAX-traceable code), or a transformed
    step (``@spmd.data_parallel``, ``@spmd.zero_shard``), whose inserted collectives count too.
    For every group, its ranks' calls on it are compared in order: op and meaning (``op="avg"``
    is not ``op="sum"``), static parameters, dtypes and shapes (rows excepted where they may
    differ), and whether the call comes from a backward pass. A loop's body counts once; every
    branch of a conditional counts. Point-to-point messages are compared pair by pair: what a
    rank sends to another (``send``, and the send half of ``sendrecv``) against what that rank
    receives from it, in order, with dtypes and shapes (a ``lax.scan``'s body counts once per
    iteration; where a while loop or a conditional holds a point-to-point call on some rank,
    messages are not compared).

    Returns the number of calls and messages compared; raises :class:`spmd.SpmdError` on every
    rank, naming the first call or message that differs with each rank's call and source line.

    Example (a world of one: nothing to compare)::

        >>> import jax.numpy as jnp, spmd
        >>> spmd.check(lambda x: spmd.allreduce(x), jnp.ones(3))
        0
    """
    program = trace(fn)(*args, **kwargs)
    comm = get_communicator()
    return compare(comm, collectives_of(program), _OP) + compare_messages(comm, program, _OP)
