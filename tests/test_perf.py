"""spmd.perf: the collectives' cost model, its fit, and the step simulator (one process; the
model against measured bytes on real links is in tests/cli/test_hosts.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import spmd
from spmd.perf import (
    Cluster,
    Layout,
    Links,
    Measurement,
    Transformer,
    best,
    collective_cost,
    compare,
    fit,
    gbit,
    group_shape,
    layouts,
    read_bench,
    step_time,
)

MiB = 1 << 20
LINKS = Links(2e-6, 1 / 20e9, 5e-6, 1 / 8e9, 40e-6, gbit(1))


def net_bytes(op, nbytes, nodes, per, algorithm):
    """What the model puts on one node's link (the net_beta coefficient), less the signature
    check's (an allgather of 8 bytes per rank)."""
    check = collective_cost("allgather", 8 * nodes * per, nodes, per, "mpi")["net_beta"] / 2
    return collective_cost(op, nbytes, nodes, per, algorithm).get("net_beta", 0.0) - check


def test_bytes_on_each_nodes_link_hierarchical_against_one_mpi_call():
    S = 16 * MiB
    # Reduce_scatter, then allgather: every node sends (N - 1) / N of the buffer each way.
    assert net_bytes("allreduce", S, 2, 2, "hier") == S
    assert net_bytes("allreduce", S, 2, 2, "mpi") == S
    # Each rank's block crosses to each other node once; MPICH's ring sends (P - 1) / P.
    assert net_bytes("allgather", S, 2, 2, "hier") == S / 2
    assert net_bytes("allgather", S, 2, 2, "mpi") == 3 * S / 4
    assert net_bytes("allgather", S, 4, 8, "mpi") == 31 * S / 32
    # Pairwise exchange sends every rank's blocks for the other node; the rails sum first.
    assert net_bytes("reduce_scatter", S, 2, 2, "hier") == S / 2
    assert net_bytes("reduce_scatter", S, 2, 2, "mpi") == S
    # What all_to_all moves between nodes is the same whichever way it goes.
    assert net_bytes("all_to_all", MiB // 8, 2, 2, "hier") == net_bytes(
        "all_to_all", MiB // 8, 2, 2, "mpi"
    )
    # Broadcast is one MPI call either way (MPICH's is node-aware).
    assert collective_cost("broadcast", S, 2, 2, "hier") == collective_cost(
        "broadcast", S, 2, 2, "mpi"
    )


def test_one_node_and_one_rank_per_node():
    assert collective_cost("allreduce", MiB, 1, 4, "shm") == {
        "shm_alpha": 2, "shm_beta": 2 * 3 / 4 * MiB
    }  # fmt: skip
    assert collective_cost("broadcast", MiB, 1, 1, "shm") == {}
    # 'hier' with one rank per node is what spmd runs there: MPI.
    assert collective_cost("allgather", MiB, 4, 1, "hier") == collective_cost(
        "allgather", MiB, 4, 1, "mpi"
    )
    with pytest.raises(spmd.SpmdError, match="shared memory needs one node, not 2"):
        collective_cost("allreduce", 4, 2, 2, "shm")
    with pytest.raises(spmd.SpmdError, match="unknown op 'gather'"):
        collective_cost("gather", 4, 1, 2, "shm")
    with pytest.raises(spmd.SpmdError, match="unknown algorithm 'ring'"):
        collective_cost("allreduce", 4, 2, 2, "ring")


def test_time_is_the_linear_form_at_the_parameters():
    cost = collective_cost("allreduce", 64 * MiB, 2, 8, "hier")
    by_hand = sum(c * getattr(LINKS, k) for k, c in cost.items())
    assert LINKS.time("allreduce", 64 * MiB, 2, 8, "hier") == pytest.approx(by_hand)
    # Latency-bound small calls: fewer steps across nodes for the hierarchical allgather.
    assert LINKS.best("allgather", 16 * MiB, 2, 4)[0] == "hier"
    assert LINKS.best("allreduce", MiB, 1, 4)[0] == "shm"


def _measurements(links, rng):
    rows = []
    for op in ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all"):
        for size in (4, 4096, 256 << 10, 4 * MiB, 64 * MiB):
            for nodes, per, algorithm in ((1, 2, "shm"), (1, 2, "mpi"), (2, 1, "mpi")):
                t = links.time(op, size, nodes, per, algorithm) * (1 + rng.normal(0, 0.01))
                rows.append(Measurement(op, size, nodes, per, algorithm, t))
    return rows


def test_fit_recovers_the_parameters_that_made_the_measurements():
    rows = _measurements(LINKS, np.random.default_rng(0))
    got = fit(rows)
    for name, want in LINKS.as_dict().items():
        assert getattr(got, name) == pytest.approx(want, rel=0.1), name
    table = compare(rows, got)
    assert max(abs(r["error"]) for r in table) < 0.05
    assert table[0]["measured_us"] == pytest.approx(rows[0].seconds * 1e6)


def test_fit_says_which_parameter_no_measurement_involves():
    rows = [m for m in _measurements(LINKS, np.random.default_rng(1)) if m.nodes == 1]
    with pytest.raises(spmd.SpmdError, match="no measurement involves net_alpha, net_beta"):
        fit(rows)
    got = fit(rows, fixed={"net_alpha": 1e-5, "net_beta": gbit(10)})
    assert got.net_beta == gbit(10) and got.shm_beta == pytest.approx(LINKS.shm_beta, rel=0.1)


def test_read_bench_takes_spmds_columns_under_their_transports(tmp_path):
    report = {
        "machine": {"spmd_transport": "hier+mpi"},
        "results": [
            {"op": "allreduce", "impl": "spmd-hier", "bytes": 4, "status": "ok", "time_us": 90.0},
            {"op": "allreduce", "impl": "spmd-mpi", "bytes": 4, "status": "ok", "time_us": 80.0},
            {"op": "allreduce", "impl": "mpi4py", "bytes": 4, "status": "ok", "time_us": 30.0},
            {
                "op": "allgather",
                "impl": "spmd-mpi",
                "bytes": 4,
                "status": "n/a: x",
                "time_us": None,
            },
        ],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    rows = read_bench(path, 2, 2)
    assert [r.algorithm for r in rows] == ["hier", "mpi"]
    assert [r.seconds for r in rows] == pytest.approx([90e-6, 80e-6])
    assert {(r.nodes, r.per_node) for r in rows} == {(2, 2)}
    report["machine"]["spmd_transport"] = "shm"
    report["results"] = [{"op": "broadcast", "impl": "spmd", "bytes": 8, "status": "ok",
                          "time_us": 5.0}]  # fmt: skip
    path.write_text(json.dumps(report))
    assert read_bench(path, 1, 2)[0].algorithm == "shm"
    report["results"] = []
    path.write_text(json.dumps(report))
    with pytest.raises(spmd.SpmdError, match="no spmd rows"):
        read_bench(path, 1, 2)


def test_group_shapes_on_nodes_of_eight():
    assert group_shape(8, 1, 8) == (1, 8)  # tensor parallel inside a node
    assert group_shape(4, 2, 8) == (1, 4)
    assert group_shape(16, 1, 8) == (2, 8)
    assert group_shape(64, 8, 8) == (64, 1)  # data parallel across nodes, one rank each
    assert group_shape(32, 4, 8) == (16, 2)
    assert group_shape(1, 1, 8) == (1, 1)


GPU_NODE = Links(3e-6, 1 / 150e9, 3e-6, 1 / 150e9, 10e-6, gbit(8 * 400))
GPT = Transformer(layers=32, hidden=4096)  # about 6.6 billion parameters


def test_transformer_counts():
    assert GPT.params == 12 * 32 * 4096**2 + 50304 * 4096
    assert GPT.flops_per_token == 6 * GPT.params + 12 * 32 * 4096 * 2048


def test_data_parallel_step_parts_and_efficiency():
    cluster = Cluster(4, 8, GPU_NODE, flops=400e12)
    s = step_time(GPT, Layout(dp=32), cluster, batch=256)
    tokens = 256 / 32 * 2048
    assert s.compute == pytest.approx(GPT.flops_per_token * tokens / 400e12)
    assert s.ideal == pytest.approx(s.compute)  # no model parallelism: nothing computed twice
    ar = GPU_NODE.time("allreduce", GPT.params * 2, 4, 8, "hier")
    assert s.dp_total == pytest.approx(ar)
    # Buckets overlapped with a backward longer than them: only the last one is exposed.
    buckets = math.ceil(GPT.params * 2 / (25 << 20))
    assert 2 / 3 * s.compute > ar and s.dp_exposed == pytest.approx(ar / buckets)
    assert s.total == pytest.approx(s.compute + s.dp_exposed)
    assert 0 < s.efficiency < 1
    # More replicas at the same global batch: less compute each, the same gradient bytes.
    bigger = step_time(GPT, Layout(dp=256), Cluster(32, 8, GPU_NODE, 400e12), batch=256)
    assert bigger.efficiency < s.efficiency


def test_zero_stages_trade_memory_for_collectives():
    cluster = Cluster(8, 8, GPU_NODE, flops=400e12, memory=80 * 2**30)
    steps = {z: step_time(GPT, Layout(dp=64, zero=z), cluster, batch=512) for z in (0, 1, 2, 3)}
    assert steps[0].memory > steps[1].memory > steps[2].memory > steps[3].memory
    assert not steps[0].fits and steps[3].fits  # 16 bytes per parameter do not fit in 80 GiB
    assert steps[3].dp_total > steps[1].dp_total  # the parameters are gathered twice


def test_tensor_and_pipeline_parallel_costs():
    cluster = Cluster(16, 8, GPU_NODE, flops=400e12)
    tp = step_time(GPT, Layout(dp=16, tp=8), cluster, batch=512)
    assert tp.tp > 0 and tp.bubble == 0
    assert tp.compute == pytest.approx(GPT.flops_per_token * 32 * 2048 / 8 / 400e12)
    pp = step_time(GPT, Layout(dp=8, tp=4, pp=4, microbatches=16), cluster, batch=512)
    slot = (pp.compute + pp.tp) / 16
    assert pp.bubble == pytest.approx(3 * slot)
    assert pp.p2p > 0
    assert pp.efficiency < 1
    with pytest.raises(spmd.SpmdError, match="has 64 ranks, the cluster 128"):
        step_time(GPT, Layout(dp=16, tp=4), cluster, batch=512)
    with pytest.raises(spmd.SpmdError, match="ZeRO stage 4"):
        step_time(GPT, Layout(dp=128, zero=4), cluster, batch=512)


def test_search_over_layouts():
    cluster = Cluster(16, 8, GPU_NODE, flops=400e12, memory=80 * 2**30)
    all_ = layouts(128, 8, 512)
    assert all(lay.ranks == 128 for lay in all_) and len({lay.name() for lay in all_}) > 10
    found = best(GPT, cluster, 512)
    assert found is not None and found[1].fits
    assert found[1].total == min(
        s.total for s in (step_time(GPT, lay, cluster, 512) for lay in all_) if s.fits
    )
    assert best(GPT, cluster, 512, "dp") is None  # ZeRO 0 does not fit
    zero3 = best(GPT, cluster, 512, "zero3")
    assert zero3 is not None and zero3[0].zero == 3 and zero3[0].tp == 1
    with pytest.raises(spmd.SpmdError, match="unknown layout family"):
        best(GPT, cluster, 512, "fsdp")
    assert math.isfinite(found[1].efficiency)
