"""The planner: the layouts a transformer language model can train in on ``world`` ranks, ranked
by the step time a fitted cost model predicts for each.

A step of one rank is a sum of *terms*, each a count of something the rank does on the step's
critical path times a fitted cost per unit (:data:`TERMS`):

- ``flop``: matrix-multiply FLOPs (forward, backward twice the forward; attention's scores and
  values once more, for the context-parallel backward recomputes them);
- ``value``: activation values the elementwise work touches (norms, residuals, the MLP's
  activation, attention's scores and softmax), a fitted cost per value;
- ``layer``: a block's forward and backward on one microbatch (the per-iteration overhead of
  running it at all, whatever its size);
- ``slot``: one microbatch's turn on one stage (the pipeline's and gradient accumulation's
  machinery);
- ``call``: one collective or point-to-point call (its fixed cost);
- ``link``: what the collectives' model (:class:`~spmd.perf.Links`) predicts for the calls'
  bytes, in seconds (so its fitted coefficient is near 1 where the links' model is right);
- ``param``: one parameter value the optimizer updates on this rank (ZeRO shards them);
- ``step``: once per step (the step's dispatch, the batch, the loss back to the host).

The counts follow the layout: tensor parallelism (Megatron-LM's layers) divides the
multiplies and the MLP's activations by ``tp`` and adds per block two allreduces forward and four
backward (q, k, v and the MLP's first layer); context parallelism divides the tokens by ``cp`` and
adds a ring of ``cp - 1`` point-to-point exchanges of keys and values per block forward and
``cp`` backward; a pipeline of ``pp`` stages runs ``microbatches + pp - 1`` slots, the last
stage's (which also applies the head) bounding the steady state, with a send each way per slot;
the gradients are averaged over the ``dp * cp`` ranks that saw different tokens (an allreduce;
ZeRO 1 and 2: a reduce_scatter and the parameters' allgather; ZeRO 3: two allgathers and a
reduce_scatter), and with a pipeline the shared embedding and head are summed over ``pp``.

The coefficients are not assumed: :meth:`Machine.fit` finds them (non-negative, relative least
squares) from measured steps, and ``benchmarks/plan.py`` measures every layout of the language
model example, fits, and sets the predictions beside the measurements (docs/planner.md).

Memory per rank is an estimate, not fitted: float32 weights, gradients and Adam's two moments
(16 bytes per parameter, divided by ZeRO's sharding: stage 1 the moments, 2 also the gradients,
3 all), plus the activations of the microbatches in flight.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import SpmdError
from ._collectives import Links
from ._simulate import Layout, group_shape

TERMS = ("flop", "value", "layer", "slot", "call", "link", "param", "step")
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer and its step: ``layers`` blocks of width ``hidden`` with
    ``heads`` attention heads and an MLP ``ffn`` times as wide, ``seq`` tokens per sequence,
    ``batch`` sequences per step (the global batch), a ``vocab``-sized embedding and head, and
    values of ``value_bytes`` bytes (float32: 4)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int = 256
    ffn: int = 4
    value_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "batch", "vocab", "ffn", "value_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpmdError(f"Model({name}={value!r}): expected an int >= 1", rank=None)
        if self.hidden % self.heads:
            raise SpmdError(
                f"Model(hidden={self.hidden}, heads={self.heads}): the heads must divide the width",
                rank=None,
            )

    def _per_layer(self) -> tuple[int, int]:
        """A block's parameters split over ``tp`` (attention's four projections, the MLP's two
        layers and its first bias) and held whole (two norms, the MLP's second bias)."""
        d, f = self.hidden, self.ffn * self.hidden
        return 4 * d * d + 2 * d * f + f, 3 * d

    @property
    def params_per_layer(self) -> int:
        return sum(self._per_layer())

    @property
    def shared_params(self) -> int:
        """The embedding, the positions, the final norm and the head (outside the blocks)."""
        return int(self.local_shared(1))

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer + self.shared_params

    def local_params(self, tp: int = 1, pp: int = 1) -> float:
        """The parameters one rank holds with ``tp``-way tensor and ``pp``-way pipeline
        parallelism: its stage's blocks (:meth:`_per_layer`), and the parameters outside them,
        which every stage holds (:meth:`local_shared`)."""
        split, whole = self._per_layer()
        return self.layers / pp * (split / tp + whole) + self.local_shared(tp)

    def local_shared(self, tp: int = 1) -> float:
        """The parameters outside the blocks one rank holds: the embedding and the head split
        over ``tp``, the positions and the final norm whole."""
        return 2 * self.vocab * self.hidden / tp + self.seq * self.hidden + self.hidden

    @property
    def activations_per_token(self) -> int:
        """Bytes one block keeps per token for its backward (with no tensor parallelism): its
        input, the norms' outputs, q, k, v, attention's output and the MLP's two activations."""
        return self.value_bytes * (7 * self.hidden + 2 * self.ffn * self.hidden)


@dataclass(frozen=True)
class Prediction:
    """One layout, its predicted seconds per step by term and its estimated bytes per rank."""

    layout: Layout
    time: float
    memory: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def mesh(self) -> dict[str, int]:
        """The axes for ``spmd.Mesh(**prediction.mesh)``."""
        return self.layout.axes


@dataclass(frozen=True)
class Machine:
    """A fitted cost model: seconds per unit of each of :data:`TERMS`, and the collectives' link
    parameters (``spmd.perf.fit`` of ``spmd-bench`` runs) that the ``link`` term uses."""

    coefficients: Mapping[str, float]
    links: Links
    fitted_on: str = ""

    def __post_init__(self) -> None:
        missing = [t for t in TERMS if t not in self.coefficients]
        if missing:
            raise SpmdError(
                f"a Machine needs a coefficient for every term; missing {', '.join(missing)} "
                f"(terms: {', '.join(TERMS)})",
                rank=None,
            )

    def time(self, counts: Mapping[str, float]) -> float:
        return sum(self.coefficients[t] * counts.get(t, 0.0) for t in TERMS)

    @classmethod
    def fit(
        cls,
        runs: Iterable[tuple[Model, Layout, float]],
        links: Links,
        *,
        per_node: int | None = None,
        fitted_on: str = "",
    ) -> Machine:
        """The non-negative coefficients that best predict ``runs`` (model, layout, measured
        seconds per step), each run's error relative to its own time."""
        from scipy.optimize import nnls  # type: ignore[import-untyped]  # JAX brings SciPy

        rows, target = [], []
        for model, layout, seconds in runs:
            c = counts(model, layout, links, per_node=per_node)
            rows.append([c[t] / seconds for t in TERMS])
            target.append(1.0)
        if len(rows) < len(TERMS):
            raise SpmdError(
                f"fitting {len(TERMS)} coefficients needs at least as many runs, got {len(rows)}",
                rank=None,
            )
        a = np.asarray(rows)
        scale = a.max(axis=0)
        scale[scale == 0] = 1.0
        x, _ = nnls(a / scale, np.asarray(target))
        return cls(dict(zip(TERMS, (x / scale).tolist(), strict=True)), links, fitted_on)

    def to_json(self) -> dict[str, Any]:
        return {
            "coefficients": dict(self.coefficients),
            "links": self.links.as_dict(),
            "fitted_on": self.fitted_on,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Machine:
        return cls(dict(data["coefficients"]), Links.of(data["links"]), data.get("fitted_on", ""))

    @classmethod
    def load(cls, path: str | Path) -> Machine:
        """A Machine from a JSON file: :meth:`to_json`'s form, or a ``benchmarks/plan.py``
        result (its ``"machine"`` entry)."""
        try:
            data = json.loads(Path(path).read_text())
            return cls.from_json(data.get("machine", data))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpmdError(
                f"cannot read a cost model from {str(path)!r}: {type(e).__name__}: {e}; expected "
                "a Machine's JSON or a benchmarks/plan.py result",
                rank=None,
            ) from e


# Fitted by `python benchmarks/plan.py --rounds 3` on a 2-core x86 machine
# (benchmarks/results/plan-cpu2-n2.json): the default where plan() is given no cost model. A
# different machine wants its own fit.
REFERENCE = {
    "coefficients": {
        "flop": 3.522223072977622e-11,
        "value": 3.081342250733928e-10,
        "layer": 0.0,
        "slot": 0.00032743484783708703,
        "call": 0.0,
        "link": 10.585381124381644,
        "param": 0.0,
        "step": 0.0,
    },
    "links": {
        "shm_alpha": 5.228247754497322e-06,
        "shm_beta": 1.0423696030197953e-10,
        "node_alpha": 5.335530455576508e-06,
        "node_beta": 1.37737345933889e-10,
        "net_alpha": 1.7698670312259853e-05,
        "net_beta": 8.099266509549644e-09,
    },
    "fitted_on": "plan-cpu2-n2.json",
}


def _call_time(
    links: Links, op: str, nbytes: float, size: int, stride: int, per_node: int
) -> float:
    nodes, per = group_shape(size, stride, per_node)
    if nodes * per <= 1 or nbytes <= 0:
        return 0.0
    return links.time(op, nbytes, nodes, per, "shm" if nodes == 1 else "hier")


def _p2p_time(links: Links, nbytes: float, across: bool) -> float:
    p = links.as_dict()
    link = "net" if across else "shm"
    return p[f"{link}_alpha"] + nbytes * p[f"{link}_beta"]


def counts(
    model: Model, layout: Layout, links: Links, *, per_node: int | None = None
) -> dict[str, float]:
    """What one rank does in one step of ``model`` in ``layout``, on the step's critical path,
    per term of :data:`TERMS` (``link`` in predicted seconds). Ranks are placed as
    ``spmd.Mesh(pp=, dp=, cp=, tp=)`` lays them out: tp innermost, then cp, dp, pp."""
    lay, mdl = layout, model
    per_node = per_node or lay.ranks
    d, f, s, v, vb = mdl.hidden, mdl.ffn * mdl.hidden, mdl.seq, mdl.vocab, mdl.value_bytes
    tp, cp, pp, dp, m = lay.tp, lay.cp, lay.pp, lay.dp, lay.microbatches
    tokens = mdl.batch / dp / m * s / cp  # one microbatch's tokens on this rank
    heads = mdl.heads / tp
    per_layer = {
        # q, k, v, o, the MLP: 2 FLOPs per weight and token forward, 4 backward; attention's
        # scores and values: 4 * seq * hidden / tp per token forward, recomputed, 8 backward.
        "flop": tokens * (6 * (4 * d * d + 2 * d * f) / tp + 16 * s * d / tp),
        "value": tokens * 3 * (8 * d + 2 * f / tp + 4 * heads * s),
        "layer": 1.0,
        "call": (6 if tp > 1 else 0) + (2 * cp - 1 if cp > 1 else 0),
    }
    act = tokens * d * vb  # one microbatch's activations (bytes)
    tp_link = 6 * _call_time(links, "allreduce", act, tp, 1, per_node)
    ring = (cp - 1) * _p2p_time(links, 2 * act / tp, False) + cp * _p2p_time(
        links, 4 * act / tp, False
    )
    per_layer["link"] = tp_link + (ring if cp > 1 else 0.0)
    head = {  # the last stage: the head and the loss over the vocabulary
        "flop": tokens * 6 * d * v / tp,
        "value": tokens * 3 * (2 * d + 3 * v / tp),
        "call": 4 if tp > 1 else 0,
        "link": _call_time(links, "allreduce", act, tp, 1, per_node)
        + 3 * _call_time(links, "allreduce", tokens * vb, tp, 1, per_node),
    }
    embed = {  # the first stage: the embedding (an allreduce over tp)
        "value": tokens * 3 * d,
        "call": 1 if tp > 1 else 0,
        "link": _call_time(links, "allreduce", act, tp, 1, per_node),
    }
    stage_layers = mdl.layers / pp

    def slot(first: bool, last: bool) -> dict[str, float]:
        out = {k: stage_layers * per_layer.get(k, 0.0) for k in ("flop", "value", "layer", "call")}
        out["link"] = stage_layers * per_layer["link"]
        out["slot"] = 1.0
        for part, on in ((head, last), (embed, first)):
            if on:
                for k, val in part.items():
                    out[k] = out.get(k, 0.0) + val
        if pp > 1:  # the activations forward and their gradient back
            across = tp * cp * dp * 2 > per_node  # neighbouring stages on two nodes
            out["call"] = out.get("call", 0.0) + 2
            out["link"] += 2 * _p2p_time(links, act, across)  # every tp rank sends its copy
        return out

    # The critical path: every stage's slot once (filling and draining the pipeline), then the
    # slowest stage's (the last) for the other microbatches.
    stages = [slot(i == 0, i == pp - 1) for i in range(pp)]
    total: dict[str, float] = {t: 0.0 for t in TERMS}
    for st in stages:
        for k, val in st.items():
            total[k] += val
    for k, val in stages[-1].items():
        total[k] += (m - 1) * val

    # Once per step: the gradients over the dp * cp ranks, the shared parameters over pp.
    local = mdl.local_params(tp, pp)
    grads, group, stride = local * vb, dp * cp, tp
    calls, link = 1.0, _call_time(links, "allreduce", vb, group, stride, per_node)  # the loss
    if group > 1:
        if lay.zero == 0:
            calls += 1
            link += _call_time(links, "allreduce", grads, group, stride, per_node)
        else:
            gathers = 2 if lay.zero == 3 else 1
            calls += 1 + gathers
            link += _call_time(links, "reduce_scatter", grads, group, stride, per_node)
            link += gathers * _call_time(links, "allgather", grads, group, stride, per_node)
    if pp > 1:
        calls += 1
        shared = mdl.local_shared(tp) * vb
        link += _call_time(links, "allreduce", shared, pp, tp * cp * dp, per_node)
    total["call"] += calls
    total["link"] += link
    total["param"] = local / (group if lay.zero and group > 1 else 1)
    total["step"] = 1.0
    return total


def memory(model: Model, layout: Layout) -> float:
    """Estimated bytes per rank (module doc): not fitted, not measured."""
    lay = layout
    local = model.local_params(lay.tp, lay.pp)
    shard = lay.dp * lay.cp
    per_param = {0: 4, 1: 2 + 2 / shard, 2: 1 + 3 / shard, 3: 4 / shard}[lay.zero]
    tokens = model.batch / lay.dp / lay.microbatches * model.seq / lay.cp
    in_flight = 1 if lay.pp == 1 else (lay.microbatches if lay.schedule == "gpipe" else lay.pp)
    act = model.activations_per_token * tokens * model.layers / lay.pp * in_flight
    return model.value_bytes * per_param * local + act


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(
    model: Model,
    world: int,
    *,
    microbatches: Sequence[int] = (1, 2, 4, 8),
    schedules: Sequence[str] = SCHEDULES,
    zero: Sequence[int] = (0, 1, 2, 3),
    per_node: int | None = None,
) -> list[Layout]:
    """Every layout of ``model`` on ``world`` ranks that divides its work evenly: ``tp`` divides
    the heads (and stays in a node), ``pp`` the layers, ``2 * cp`` the sequence (the causal
    split), ``dp`` the batch and ``microbatches`` each replica's rows (at least ``pp`` of them
    with a pipeline); ZeRO stages only where gradients are averaged (``dp * cp > 1``), schedules
    only with a pipeline."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise SpmdError(f"world={world!r}: expected an int >= 1 (ranks)", rank=None)
    for s in schedules:
        if s not in SCHEDULES:
            raise SpmdError(
                f"the planner models the schedules {', '.join(SCHEDULES)}; got {s!r}", rank=None
            )
    per_node = per_node or world
    out = []
    for tp in _divisors(world):
        if model.heads % tp or tp > per_node:
            continue
        for pp in _divisors(world // tp):
            if model.layers % pp:
                continue
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if model.seq % (2 * cp) or model.batch % dp:
                    continue
                rows = model.batch // dp
                for m in microbatches:
                    if rows % m or (pp > 1 and m < pp):
                        continue
                    for z in zero if dp * cp > 1 else (0,):
                        for sched in schedules if pp > 1 else ("1f1b",):
                            out.append(Layout(dp, tp, pp, z, m, cp=cp, schedule=sched))
    return out


def predict(
    model: Model, layout: Layout, cost: Machine, *, per_node: int | None = None
) -> Prediction:
    """The predicted step of ``model`` in ``layout``."""
    c = counts(model, layout, cost.links, per_node=per_node)
    parts = {t: cost.coefficients[t] * c[t] for t in TERMS}
    return Prediction(layout, sum(parts.values()), memory(model, layout), parts)


def plan(
    model: Model,
    *,
    world: int,
    cost: Machine | str | Path | None = None,
    memory_per_rank: float | None = None,
    per_node: int | None = None,
    microbatches: Sequence[int] = (1, 2, 4, 8),
    schedules: Sequence[str] = SCHEDULES,
    zero: Sequence[int] = (0, 1, 2, 3),
) -> list[Prediction]:
    """The feasible layouts of ``model`` on ``world`` ranks, fastest predicted first.

    ``cost``: a fitted :class:`Machine` (or the path of one's JSON); None: the reference fit of
    a 2-core CPU machine (``benchmarks/results/plan-cpu2-n2.json``). ``memory_per_rank``: bytes a
    rank may hold; layouts estimated above it are left out. ``per_node``: ranks per node (one
    node: ``world``). The other arguments bound the search (:func:`candidates`)."""
    machine = (
        Machine.from_json(REFERENCE)
        if cost is None
        else cost
        if isinstance(cost, Machine)
        else Machine.load(cost)
    )
    found = [
        predict(model, lay, machine, per_node=per_node)
        for lay in candidates(
            model,
            world,
            microbatches=microbatches,
            schedules=schedules,
            zero=zero,
            per_node=per_node,
        )
    ]
    if memory_per_rank is not None:
        found = [p for p in found if p.memory <= memory_per_rank]
    if not found:
        raise SpmdError(
            f"no layout of the model ({model.layers} layers, {model.heads} heads, sequence "
            f"{model.seq}, batch {model.batch}) fits {world} ranks"
            + (f" within {memory_per_rank / 2**20:.0f} MiB per rank" if memory_per_rank else ""),
            rank=None,
        )
    return sorted(found, key=lambda p: p.time)
