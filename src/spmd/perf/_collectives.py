"""The alpha-beta model of spmd's CPU collectives: what each algorithm costs, as a linear form in
the parameters of three link classes.

A call's time is ``sum(coefficient * parameter)`` over the parameters of :data:`PARAMS`:

- ``shm_alpha``, ``shm_beta``: spmd's shared memory inside a node (seconds per step, seconds per
  byte a rank copies);
- ``node_alpha``, ``node_beta``: MPI between two ranks of one node (MPICH's shared memory);
- ``net_alpha``, ``net_beta``: MPI between nodes: seconds per message, and seconds per byte on
  a node's link, which the node's ranks share (two ranks sending at once each get half).

``nbytes`` is the op's size as nccl-tests counts it (and ``spmd-bench`` prints it): the buffer
of an allreduce or a broadcast, the output of an allgather, the input of a reduce_scatter, each
rank's buffer of an all_to_all. A group is ``nodes`` nodes of ``per_node`` ranks, each node's
ranks consecutive.

The algorithms are the ones spmd runs (``native/cpu``): on one node shared memory; across nodes
``hier`` (the two-dimensional algorithms of native/cpu/transport.h: shared memory inside each
node, MPI over the rails; broadcast and larger all_to_alls as one MPI call) or ``mpi`` (one MPI
call over the whole group, whose algorithm MPICH chooses by size with its default thresholds,
modelled below as MPICH 4-5 implements them; where MPICH is node-aware, as for a broadcast, so
is the model). Every MPI-based call also pays the
signature check, an 8-byte allgather over the group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._errors import SpmdError

PARAMS = ("shm_alpha", "shm_beta", "node_alpha", "node_beta", "net_alpha", "net_beta")
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all")
ALGORITHMS = ("shm", "hier", "mpi")

# MPICH's default switch points (bytes; its MPIR_CVAR_*_MSG_SIZE defaults).
ALLREDUCE_SHORT = 2048
ALLGATHER_LONG = 512 << 10
BCAST_SHORT = 12 << 10
BCAST_LONG = 512 << 10
REDSCAT_LONG = 512 << 10
# The two-dimensional all_to_all's limit (HierTransport::kHierAllToAllMax).
HIER_ALL_TO_ALL_MAX = 256 << 10


class Cost(dict[str, float]):
    """A linear form over :data:`PARAMS`: coefficient per parameter (missing: 0)."""

    def __add__(self, other: Mapping[str, float]) -> Cost:
        out = Cost(self)
        for k, v in other.items():
            out[k] = out.get(k, 0.0) + v
        return out

    def __mul__(self, factor: float) -> Cost:
        return Cost({k: v * factor for k, v in self.items()})

    __rmul__ = __mul__

    def time(self, params: Mapping[str, float]) -> float:
        """Seconds, with these parameter values."""
        return sum(c * params[k] for k, c in self.items())


def _step(link: str, messages: float = 1.0, nbytes: float = 0.0) -> Cost:
    return Cost({f"{link}_alpha": messages, f"{link}_beta": nbytes})


def _log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


# -- one link class -------------------------------------------------------------------------------


def shm_cost(op: str, nbytes: float, ranks: int) -> Cost:
    """spmd's shared-memory collectives among ``ranks`` ranks of one node."""
    if ranks <= 1:
        return Cost()
    part = (ranks - 1) / ranks * nbytes
    if op == "allreduce":  # reduce_scatter then allgather through the slots
        return _step("shm", 2, 2 * part)
    if op == "broadcast":
        return _step("shm", 1, nbytes)
    return _step("shm", 1, part)  # allgather, reduce_scatter, all_to_all


def _mpi_allreduce(nbytes: float, nodes: int, per: int, streams: float = 1.0) -> Cost:
    """MPICH's allreduce over nodes x per ranks (recursive doubling below ALLREDUCE_SHORT bytes,
    else reduce_scatter by recursive halving and allgather by recursive doubling, nearest
    partners first: the steps across nodes carry (nodes - 1) / nodes of the buffer per node).
    ``streams``: calls sharing each node's link at once (the rails)."""
    if nbytes < ALLREDUCE_SHORT:
        return _step("node", _log2(per), _log2(per) * nbytes) + _step(
            "net", _log2(nodes), _log2(nodes) * per * streams * nbytes
        )
    return _step("node", 2 * _log2(per), 2 * (per - 1) / per * nbytes) + _step(
        "net", 2 * _log2(nodes), 2 * (nodes - 1) / nodes * nbytes * streams
    )


def _mpi_allgather(total: float, nodes: int, per: int, streams: float = 1.0) -> Cost:
    """MPICH's allgather of ``total`` output bytes: recursive doubling below ALLGATHER_LONG,
    else a ring, in which each step's transfers across nodes use every node's link once."""
    p = nodes * per
    if total < ALLGATHER_LONG:
        across = per * (nodes - 1) / nodes * total  # each node's ranks send what they hold
        return _step("node", _log2(per), (per - 1) / p * total) + _step(
            "net", _log2(nodes), across * streams
        )
    if nodes == 1:
        return _step("node", p - 1, (p - 1) / p * total)
    return _step("net", p - 1, (p - 1) / p * total * streams)


def _mpi_reduce_scatter(total: float, nodes: int, per: int, streams: float = 1.0) -> Cost:
    """MPICH's reduce_scatter of ``total`` input bytes: recursive halving below REDSCAT_LONG
    (farthest partners first: the steps across nodes come first, with the larger halves), else
    pairwise exchange (every rank sends each peer its block directly). Either way each node's
    link carries its ranks' data for the other nodes."""
    p = nodes * per
    across = per * (nodes - 1) / nodes * total * streams
    if total < REDSCAT_LONG:
        return _step("net", _log2(nodes), across) + _step("node", _log2(per), (per - 1) / p * total)
    return _step("node", per - 1, (per - 1) / p * total) + _step("net", p - per, across)


def _mpi_bcast(nbytes: float, nodes: int, per: int, streams: float = 1.0) -> Cost:
    """MPICH's broadcast, node-aware as MPICH runs it (from the root, a node leader, across the
    nodes, then inside each node): binomial below BCAST_SHORT, else scatter and allgather."""

    def one(n: int, link: str) -> Cost:
        if n <= 1:
            return Cost()
        if nbytes < BCAST_SHORT:
            return _step(link, _log2(n), _log2(n) * nbytes * (streams if link == "net" else 1))
        share = 2 * (n - 1) / n * nbytes * (streams if link == "net" else 1)
        return _step(link, _log2(n) + (n - 1 if nbytes >= BCAST_LONG else _log2(n)), share)

    return one(nodes, "net") + one(per, "node")


def _mpi_all_to_all(nbytes: float, nodes: int, per: int, streams: float = 1.0) -> Cost:
    """Pairwise messages: P - 1 per rank; each node's link carries what its ranks send off-node."""
    p = nodes * per
    return _step("node", per - 1, (per - 1) / p * nbytes) + _step(
        "net", p - per, per * (nodes - 1) / nodes * nbytes * streams
    )


def mpi_cost(op: str, nbytes: float, nodes: int, per: int, streams: float = 1.0) -> Cost:
    """One MPI call over the whole group, as MPICH runs it."""
    fn = {
        "allreduce": _mpi_allreduce,
        "allgather": _mpi_allgather,
        "reduce_scatter": _mpi_reduce_scatter,
        "broadcast": _mpi_bcast,
        "all_to_all": _mpi_all_to_all,
    }[op]
    return fn(nbytes, nodes, per, streams)


# -- the three algorithms -------------------------------------------------------------------------


def _check(nodes: int, per: int) -> Cost:
    """The signature check of an MPI-based call: an 8-byte allgather over the group."""
    return _mpi_allgather(8 * nodes * per, nodes, per)


def _hier(op: str, nbytes: float, nodes: int, per: int) -> Cost:
    """The two-dimensional algorithms (native/cpu/transport.h): L rails share each node's link."""
    n, L = nodes, per
    if op == "allreduce":
        return (
            shm_cost("reduce_scatter", nbytes, L)
            + mpi_cost("allreduce", nbytes / L, n, 1, streams=L)
            + shm_cost("allgather", nbytes, L)
        )
    if op == "allgather":  # each rank's block over its rail, then one allgather per node
        rail = mpi_cost("allgather", nbytes / L, n, 1, streams=L)
        return rail + n * shm_cost("allgather", nbytes / n, L)
    if op == "reduce_scatter":
        rail = mpi_cost("reduce_scatter", nbytes / L, n, 1, streams=L)
        return n * shm_cost("reduce_scatter", nbytes / n, L) + rail
    if op == "broadcast":  # one MPI call: MPICH's broadcast is node-aware already
        return mpi_cost("broadcast", nbytes, n, L)
    # all_to_all: two regrouping copies, one inside the node, one over the rail.
    if nbytes > HIER_ALL_TO_ALL_MAX:
        return mpi_cost("all_to_all", nbytes, n, L)
    copies = _step("shm", 0, 2 * nbytes)
    return copies + shm_cost("all_to_all", nbytes, L) + mpi_cost("all_to_all", nbytes, n, 1, L)


def collective_cost(op: str, nbytes: float, nodes: int, per_node: int, algorithm: str) -> Cost:
    """The linear form of one call of ``op`` on ``nodes`` x ``per_node`` ranks by ``algorithm``
    (``"shm"``: one node; ``"hier"``; ``"mpi"``: one MPI call over the group)."""
    if op not in OPS:
        raise SpmdError(f"unknown op {op!r}; expected one of {', '.join(OPS)}", rank=None)
    if algorithm not in ALGORITHMS:
        raise SpmdError(
            f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}", rank=None
        )
    if nodes < 1 or per_node < 1:
        raise SpmdError(f"a group of {nodes} x {per_node} ranks is empty", rank=None)
    if algorithm == "shm":
        if nodes != 1:
            raise SpmdError(f"shared memory needs one node, not {nodes}", rank=None)
        return shm_cost(op, nbytes, per_node)
    if nodes * per_node == 1:
        return Cost()
    if algorithm == "hier" and (nodes == 1 or per_node == 1):
        algorithm = "mpi"  # what spmd chooses there
    body = (
        _hier(op, nbytes, nodes, per_node)
        if algorithm == "hier"
        else mpi_cost(op, nbytes, nodes, per_node)
    )
    return _check(nodes, per_node) + body


@dataclass(frozen=True)
class Links:
    """Values for :data:`PARAMS` (seconds; seconds per byte)."""

    shm_alpha: float
    shm_beta: float
    node_alpha: float
    node_beta: float
    net_alpha: float
    net_beta: float

    @classmethod
    def of(cls, values: Mapping[str, float]) -> Links:
        return cls(**{k: float(values[k]) for k in PARAMS})

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in PARAMS}

    def time(self, op: str, nbytes: float, nodes: int, per_node: int, algorithm: str) -> float:
        """Predicted seconds for one call (:func:`collective_cost`)."""
        return collective_cost(op, nbytes, nodes, per_node, algorithm).time(self.as_dict())

    def best(self, op: str, nbytes: float, nodes: int, per_node: int) -> tuple[str, float]:
        """The faster of spmd's algorithms for this group, and its predicted time."""
        if nodes == 1:
            return "shm", self.time(op, nbytes, 1, per_node, "shm")
        options = [(a, self.time(op, nbytes, nodes, per_node, a)) for a in ("hier", "mpi")]
        return min(options, key=lambda o: o[1])


def gbit(rate_gbit_per_s: float) -> float:
    """Seconds per byte of a link of this many Gbit/s."""
    return 8 / (rate_gbit_per_s * 1e9)


def total(costs: Iterable[Cost]) -> Cost:
    out = Cost()
    for c in costs:
        out = out + c
    return out
