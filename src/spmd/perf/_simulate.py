"""A step-time simulator: data parallel, ZeRO 1-3, tensor and pipeline parallel layouts of a
transformer language model on a cluster of nodes, from the collectives' model.

The step of one rank is its compute (6 FLOPs per parameter and token, plus attention's
12 * layers * hidden * seq per token, as Kaplan et al. count them; forward a third, backward two
thirds) at the rank's FLOP rate, plus what communication adds to it:

- tensor parallel (Megatron-LM's layers): per layer and microbatch two allreduces of the
  activations forward and two backward over the ``tp`` group, not overlapped;
- pipeline parallel (1F1B): ``microbatches + pp - 1`` slots of one microbatch's forward and
  backward, and a send of the activations (forward) and of their gradient (backward) per slot
  between neighbouring stages;
- data parallel: the gradients' allreduce (ZeRO 0), or their reduce_scatter and an allgather of
  the parameters (ZeRO 1 and 2), or ZeRO 3's allgather of the parameters before the forward and
  again before the backward plus the reduce_scatter; gradient collectives run in buckets
  overlapped with the backward (with pipelining only the last microbatch's backward), the
  parameters' allgather of ZeRO 1-2 after the update, ZeRO 3's under the compute it precedes;
  with several microbatches (pipelining, or gradient accumulation) the gradients are complete
  only in the last microbatch's backward, so only that one hides their collectives.

Ranks are placed tensor-parallel innermost (consecutive ranks, inside a node), then pipeline
stages, then data-parallel replicas, as ``spmd.Mesh(dp=, pp=, tp=)`` lays them out. Memory per
rank: 16 bytes per parameter for mixed-precision Adam (2 weights, 2 gradients, 12 optimizer
state: fp32 master weights and two moments), divided by ZeRO's sharding, plus activations of
34 bytes per token, hidden unit and layer (Korthikanti et al., with sequence parallelism
dividing them by ``tp``) for the microbatches in flight."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._errors import SpmdError
from ._collectives import Cost, Links

BUCKET_BYTES = 25 << 20  # gradient bucket (DDP's default)
ACT_BYTES_PER = 34  # activation bytes per token, hidden unit and layer
WEIGHT_BYTES, GRAD_BYTES, OPT_BYTES = 2, 2, 12  # per parameter: bf16, bf16, fp32 master + moments


@dataclass(frozen=True)
class Transformer:
    """A decoder-only language model: ``layers`` blocks of width ``hidden``, ``seq`` tokens per
    sequence, a ``vocab``-sized embedding."""

    layers: int
    hidden: int
    seq: int = 2048
    vocab: int = 50304

    @property
    def params(self) -> int:
        return 12 * self.layers * self.hidden**2 + self.vocab * self.hidden

    @property
    def flops_per_token(self) -> float:
        return 6 * self.params + 12 * self.layers * self.hidden * self.seq


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` ranks; ``links``: the model's link parameters (``shm_*``
    inside a node, ``net_*`` between nodes); ``flops``: what one rank computes per second;
    ``memory``: bytes one rank may hold."""

    nodes: int
    per_node: int
    links: Links
    flops: float
    memory: float = math.inf

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Layout:
    """``dp`` x ``pp`` x ``cp`` x ``tp`` ranks; ZeRO stage ``zero`` over ``dp`` (and ``cp``,
    whose ranks see different tokens too); ``microbatches`` per step (pipelining; also the
    gradient accumulation without it) and the pipeline's ``schedule``. Context parallelism
    (``cp``) and the schedule are the planner's (:func:`spmd.perf.plan`); :func:`step_time`
    models neither."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    cp: int = 1
    schedule: str = "1f1b"

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        parts = [f"dp{self.dp}"] + [
            f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)) if v > 1
        ]
        return "-".join(parts) + (f" zero{self.zero}" if self.zero else "")

    @property
    def axes(self) -> dict[str, int]:
        """The axes as ``spmd.Mesh(**layout.axes)`` takes them."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def describe(self) -> str:
        """The axes as ``spmd.Mesh`` takes them, the schedule, microbatches, ZeRO stage:
        ``"pp=2 1f1b m=4"``, ``"dp=2 m=1 zero1"``."""
        axes = ("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp)
        text = ",".join(f"{k}={v}" for k, v in axes if v > 1) or "dp=1"
        text += f" {self.schedule}" if self.pp > 1 else ""
        return f"{text} m={self.microbatches}" + (f" zero{self.zero}" if self.zero else "")


@dataclass
class StepTime:
    """One step's predicted seconds, by part, and the memory it needs per rank."""

    compute: float
    tp: float = 0.0
    bubble: float = 0.0
    p2p: float = 0.0
    dp_exposed: float = 0.0
    dp_total: float = 0.0
    memory: float = 0.0
    fits: bool = True
    ideal: float = 0.0  # the whole step's FLOPs over every rank's rate
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.bubble + self.p2p + self.dp_exposed

    @property
    def efficiency(self) -> float:
        return self.ideal / self.total if self.total > 0 else 0.0


def group_shape(size: int, stride: int, per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of a group of ``size`` ranks ``stride`` apart, where nodes hold
    ``per_node`` consecutive ranks."""
    if size <= 1:
        return 1, 1
    if stride >= per_node:
        return size, 1
    per = min(size, max(1, per_node // stride))
    return math.ceil(size / per), per


def _call(links: Links, op: str, nbytes: float, shape: tuple[int, int]) -> float:
    nodes, per = shape
    if nodes * per <= 1 or nbytes <= 0:
        return 0.0
    algorithm = "shm" if nodes == 1 else ("hier" if per > 1 else "mpi")
    return links.time(op, nbytes, nodes, per, algorithm)


def _overlapped(comm: float, window: float, nbytes: float) -> float:
    """What bucketed collectives of ``comm`` seconds add to a backward of ``window`` seconds:
    the buckets start as the gradients appear, and the last one starts when the backward ends."""
    buckets = max(1, math.ceil(nbytes / BUCKET_BYTES))
    return max(comm - window * (1 - 1 / buckets), comm / buckets)


def step_time(model: Transformer, layout: Layout, cluster: Cluster, batch: int) -> StepTime:
    """The predicted step of ``batch`` sequences (the global batch) on ``cluster`` in
    ``layout``."""
    if layout.ranks != cluster.ranks:
        raise SpmdError(
            f"the layout {layout.name()} has {layout.ranks} ranks, the cluster {cluster.ranks}",
            rank=None,
        )
    if layout.zero not in (0, 1, 2, 3):
        raise SpmdError(f"ZeRO stage {layout.zero} is not 0, 1, 2 or 3", rank=None)
    if layout.cp > 1:
        raise SpmdError(
            f"the cluster simulator has no context parallelism (layout {layout.name()}); "
            "spmd.perf.plan models it",
            rank=None,
        )
    links, per_node = cluster.links, cluster.per_node
    m = layout.microbatches
    seqs = batch / layout.dp  # sequences per replica
    tokens = seqs * model.seq
    work = model.flops_per_token * tokens / (layout.tp * layout.pp)
    step = StepTime(compute=work / cluster.flops)
    step.ideal = model.flops_per_token * batch * model.seq / (cluster.ranks * cluster.flops)
    if seqs < m:
        step.fits = False
        step.notes.append(f"{seqs:g} sequences per replica for {m} microbatches")
    act = tokens / m * model.hidden * 2  # one microbatch's activations, bf16
    layers = model.layers / layout.pp
    tp_shape = group_shape(layout.tp, 1, per_node)
    step.tp = 4 * layers * m * _call(links, "allreduce", act, tp_shape)
    if layout.pp > 1:
        slot = (step.compute + step.tp) / m
        step.bubble = (layout.pp - 1) * slot
        across = layout.tp * layout.pp > per_node  # some neighbouring stages on two nodes
        link = "net" if across else "shm"
        streams = min(per_node, layout.tp) if across else 1
        send = Cost({f"{link}_alpha": 1, f"{link}_beta": act / layout.tp * streams})
        step.p2p = 2 * (m + layout.pp - 1) * send.time(links.as_dict())
    grads = model.params / (layout.tp * layout.pp) * 2  # bf16 gradients of this rank's part
    dp_shape = group_shape(layout.dp, layout.tp * layout.pp, per_node)
    backward = 2 / 3 * step.compute / m  # the last microbatch's: the gradients are complete
    forward = step.compute / 3
    if layout.dp > 1:
        if layout.zero == 0:
            ar = _call(links, "allreduce", grads, dp_shape)
            step.dp_total, step.dp_exposed = ar, _overlapped(ar, backward, grads)
        elif layout.zero in (1, 2):
            rs = _call(links, "reduce_scatter", grads, dp_shape)
            ag = _call(links, "allgather", grads, dp_shape)
            step.dp_total = rs + ag
            step.dp_exposed = _overlapped(rs, backward, grads) + ag
        else:
            ag = _call(links, "allgather", grads, dp_shape)
            rs = _call(links, "reduce_scatter", grads, dp_shape)
            step.dp_total = 2 * ag + rs
            step.dp_exposed = max(0.0, ag - forward) + _overlapped(ag + rs, backward, grads)
    params = model.params / (layout.tp * layout.pp)
    w, g, opt, shard = WEIGHT_BYTES, GRAD_BYTES, OPT_BYTES, layout.dp
    per_param = {0: w + g + opt, 1: w + g + opt / shard, 2: w + (g + opt) / shard,
                 3: (w + g + opt) / shard}[layout.zero]  # fmt: skip
    in_flight = min(m, layout.pp) if layout.pp > 1 else 1
    activations = ACT_BYTES_PER * tokens / m * model.hidden * layers / layout.tp * in_flight
    step.memory = per_param * params + activations
    if step.memory > cluster.memory:
        step.fits = False
        step.notes.append(
            f"needs {step.memory / 2**30:.0f} GiB per rank, more than {cluster.memory / 2**30:.0f}"
        )
    return step


def layouts(ranks: int, per_node: int, batch: int, pp_max: int = 64) -> list[Layout]:
    """Every layout of ``ranks`` worth simulating: tp a power of two up to the node, pp a power
    of two, ZeRO 0, 1 and 3, and as microbatches (gradient accumulation without pipelining)
    every power of two up to the sequences a replica gets (at least one; a batch that ``dp``
    does not divide counts its average share)."""
    out = []
    tp = 1
    while tp <= per_node:
        pp = 1
        while pp <= pp_max and tp * pp <= ranks:
            dp = ranks // (tp * pp)
            if ranks % (tp * pp) == 0 and batch >= dp:
                m = 1
                while m <= batch / dp:
                    out += [Layout(dp, tp, pp, zero, m) for zero in (0, 1, 3)]
                    m *= 2
            pp *= 2
        tp *= 2
    return out


def best(
    model: Transformer, cluster: Cluster, batch: int, family: str = "any"
) -> tuple[Layout, StepTime] | None:
    """The fastest layout that fits, among ``family``: ``"dp"`` (data parallel alone, ZeRO 0),
    ``"zero1"``, ``"zero3"``, ``"tp"`` (tensor parallel inside the node, any ZeRO stage over
    dp), ``"pp"`` (pipeline parallel, with or without tensor parallel) or ``"any"``; None if
    none fits."""
    keep = {
        "dp": lambda lay: lay.tp == lay.pp == 1 and lay.zero == 0,
        "zero1": lambda lay: lay.tp == lay.pp == 1 and lay.zero == 1,
        "zero3": lambda lay: lay.tp == lay.pp == 1 and lay.zero == 3,
        "tp": lambda lay: lay.tp > 1 and lay.pp == 1,
        "pp": lambda lay: lay.pp > 1,
        "any": lambda lay: True,
    }
    if family not in keep:
        raise SpmdError(
            f"unknown layout family {family!r}; expected one of {', '.join(keep)}", rank=None
        )
    found = None
    for lay in filter(keep[family], layouts(cluster.ranks, cluster.per_node, batch)):
        s = step_time(model, lay, cluster, batch)
        if s.fits and (found is None or s.total < found[1].total):
            found = (lay, s)
    return found
