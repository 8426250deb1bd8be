"""spmd.perf.plan: the layouts it considers, what it counts, its fit, and its choice against the
committed measurements of examples/train_lm.py (benchmarks/plan.py)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

import spmd
from spmd.perf import TERMS, Links, Machine, Model, candidates, counts, plan, predict
from spmd.perf._plan import REFERENCE

from .test_examples import _run

LM = Model(layers=4, hidden=64, heads=4, seq=64, batch=32)  # examples/train_lm.py's defaults
LINKS = Links.of(REFERENCE["links"])
RESULT = Path(__file__).parents[1] / "benchmarks" / "results" / "plan-cpu2-n2.json"


def test_candidates_divide_the_work_evenly():
    found = {lay.describe() for lay in candidates(LM, 2, microbatches=(1, 2, 4))}
    zeros = ("", " zero1", " zero2", " zero3")
    expected = (
        {f"{axes} m={m}{z}" for axes in ("dp=2", "cp=2") for m in (1, 2, 4) for z in zeros}
        | {f"tp=2 m={m}" for m in (1, 2, 4)}
        | {f"pp=2 {s} m={m}" for s in ("gpipe", "1f1b") for m in (2, 4)}  # m >= pp
    )
    assert found == expected
    # Three heads: no tp=2; 3 layers: no pp=2; a batch of 3 (odd): no dp=2.
    odd = Model(layers=3, hidden=48, heads=3, seq=64, batch=3)
    assert {lay.describe() for lay in candidates(odd, 2, microbatches=(1, 3))} == {
        f"cp=2 m={m}{z}" for m in (1, 3) for z in zeros
    }
    assert all(lay.ranks == 8 for lay in candidates(LM, 8))
    with pytest.raises(spmd.SpmdError, match="models the schedules gpipe, 1f1b; got 'zero_bubble'"):
        candidates(LM, 2, schedules=("zero_bubble",))


def test_counts_follow_the_layout():
    one = counts(LM, spmd.perf.Layout(1), LINKS)
    tokens = 32 * 64
    d, f = 64, 256
    per_layer = tokens * (6 * (4 * d * d + 2 * d * f) + 16 * 64 * d)
    assert one["flop"] == pytest.approx(4 * per_layer + tokens * 6 * d * 256)
    assert (one["layer"], one["slot"], one["call"], one["link"]) == (4, 1, 1, 0.0)  # the loss
    assert one["param"] == LM.params == 4 * LM.params_per_layer + LM.shared_params

    tp = counts(LM, spmd.perf.Layout(1, tp=2), LINKS)
    assert tp["flop"] == pytest.approx(one["flop"] / 2)  # every multiply is split
    assert one["value"] / 2 < tp["value"] < one["value"]  # the norms and residuals are not
    assert tp["call"] == 6 * 4 + 4 + 1 + 1  # per block, the head and loss, the embedding, loss
    whole = 4 * 3 * d + LM.seq * d + d  # per block 2 norms and a bias; positions; final norm
    assert tp["param"] == pytest.approx((LM.params - whole) / 2 + whole)

    # A pipeline of 2 stages and 4 microbatches: 5 slots on the critical path, each stage once
    # and the last stage (2 blocks and the head) 3 more times.
    pp = counts(LM, spmd.perf.Layout(1, pp=2, microbatches=4), LINKS)
    assert (pp["slot"], pp["layer"]) == (5, 10)
    assert pp["call"] == 2 * 5 + 1 + 1  # a send each way per slot; the shared sum; the loss
    cp = counts(LM, spmd.perf.Layout(1, cp=2), LINKS)
    assert cp["call"] == 3 * 4 + 1 + 1  # the ring per block; the gradients' allreduce; the loss
    assert cp["flop"] == pytest.approx(one["flop"] / 2)
    z3 = counts(LM, spmd.perf.Layout(2, zero=3), LINKS)
    z0 = counts(LM, spmd.perf.Layout(2), LINKS)
    assert z3["param"] == z0["param"] / 2 and z3["call"] == z0["call"] + 2 and z3["link"] > 0


def test_fit_recovers_the_coefficients_of_modelled_steps():
    true = dict(zip(TERMS, (2e-11, 3e-10, 2e-4, 5e-4, 3e-5, 1.2, 4e-9, 3e-3), strict=True))
    machine = Machine(true, LINKS)
    runs = [
        (model, lay, machine.time(counts(model, lay, LINKS)))
        for model in (LM, Model(layers=2, hidden=32, heads=2, seq=32, batch=8))
        for world in (1, 2, 4)
        for lay in candidates(model, world, microbatches=(1, 2, 4))
    ]
    fitted = Machine.fit(runs, LINKS)
    np.testing.assert_allclose([fitted.coefficients[t] for t in TERMS], list(true.values()),
                               rtol=1e-6)  # fmt: skip
    with pytest.raises(spmd.SpmdError, match="needs at least as many runs, got 3"):
        Machine.fit(runs[:3], LINKS)
    with pytest.raises(spmd.SpmdError, match="missing step"):
        Machine({t: 1.0 for t in TERMS if t != "step"}, LINKS)


def test_plan_ranks_by_predicted_time_within_the_memory_limit():
    machine = Machine.from_json(REFERENCE)
    ranked = plan(LM, world=4, cost=machine)
    assert [p.time for p in ranked] == sorted(p.time for p in ranked)
    assert len(ranked) == len(candidates(LM, 4))
    assert all(p.time == pytest.approx(sum(p.parts.values())) for p in ranked)
    limit = float(np.median([p.memory for p in ranked]))
    fit = plan(LM, world=4, cost=machine, memory_per_rank=limit)
    assert 0 < len(fit) < len(ranked) and all(p.memory <= limit for p in fit)
    # ZeRO 3 holds the least of the layouts of one mesh, GPipe more activations than 1F1B.
    mem = {p.layout.describe(): p.memory for p in ranked}
    assert mem["dp=4 m=1 zero3"] < mem["dp=4 m=1 zero2"] < mem["dp=4 m=1 zero1"] < mem["dp=4 m=1"]
    assert mem["pp=4 1f1b m=8"] < mem["pp=4 gpipe m=8"]
    with pytest.raises(spmd.SpmdError, match=r"world=0: expected an int >= 1"):
        plan(LM, world=0, cost=machine)
    with pytest.raises(spmd.SpmdError, match=r"Model\(heads=0\): expected an int >= 1"):
        Model(layers=4, hidden=64, heads=0, seq=64, batch=32)
    with pytest.raises(spmd.SpmdError, match="the heads must divide the width"):
        Model(layers=4, hidden=64, heads=3, seq=64, batch=32)
    with pytest.raises(spmd.SpmdError, match=r"cannot read a cost model from 'nowhere\.json'"):
        plan(LM, world=2, cost="nowhere.json")
    with pytest.raises(spmd.SpmdError, match="fits 4 ranks within 0 MiB per rank"):
        plan(LM, world=4, cost=machine, memory_per_rank=1000.0)
    assert ranked[0].mesh == {"pp": ranked[0].layout.pp, "dp": ranked[0].layout.dp,
                              "cp": ranked[0].layout.cp, "tp": ranked[0].layout.tp}  # fmt: skip


def test_the_planner_against_the_measured_layouts():
    """The committed run of benchmarks/plan.py on 2 ranks: the planner ranks only layouts that
    were measured; with the fit it made (the reference, plan()'s default) each prediction but
    one is within 25% of the measured step, and its first choice measured within 10% of the
    fastest."""
    data = json.loads(RESULT.read_text())
    assert data["machine"] == REFERENCE  # the default cost model is this fit
    measured = {json.dumps(r["layout"], sort_keys=True): r["seconds"] for r in data["rows"]}
    ranked = plan(LM, world=2, microbatches=data["microbatches"])
    keys = [json.dumps(asdict(p.layout), sort_keys=True) for p in ranked]
    assert sorted(keys) == sorted(measured)
    errors = {
        p.layout.describe(): p.time / measured[k] - 1 for p, k in zip(ranked, keys, strict=True)
    }
    # GPipe at 2 microbatches measured 1.5x 1F1B's step, with the same critical path; nothing
    # in the model says why, and it is predicted a third short (docs/planner.md).
    assert errors.pop("pp=2 gpipe m=2") < -0.25
    assert max(map(abs, errors.values())) <= 0.25, errors
    assert measured[keys[0]] <= 1.10 * min(measured.values())
    for r in data["rows"]:  # the committed predictions are what this code predicts
        lay = spmd.perf.Layout(**r["layout"])
        assert predict(LM, lay, Machine.from_json(REFERENCE)).time == pytest.approx(r["predicted"])


@pytest.mark.slow(reason="two jobs of train_lm.py")
def test_train_lm_mesh_auto_runs_the_first_plan_and_follows_one_process(tmp_path):
    check = ("--steps", "3", "--check", "--sample", "0")
    out = _run(2, "train_lm.py", "--mesh", "auto", *check, cwd=tmp_path)
    ranked = plan(LM, world=2, microbatches=(1, 2, 4))  # what the example considers
    first = ranked[0]
    listed = re.findall(r"^  (\d+)\. (.+?)\s+([\d.]+) ms/step", out, re.M)
    assert listed[0][:2] == ("1", first.layout.describe()), out
    assert len(listed) == 5 and f"--mesh auto: {len(ranked)} layouts" in out
    assert f"mesh {first.mesh}" in out, out
    steps = dict(re.findall(r"^step (\d+) loss ([\d.]+)$", out, re.M))
    one = dict(re.findall(r"^step (\d+) loss ([\d.]+)$",
                          _run(1, "train_lm.py", *check, cwd=tmp_path), re.M))  # fmt: skip
    np.testing.assert_allclose([float(steps[i]) for i in "123"], [float(one[i]) for i in "123"],
                               rtol=1e-5)  # fmt: skip
