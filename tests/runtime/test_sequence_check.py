"""The sequence check: how the GPU handlers compare every call after a call site's first, fully
compared run, without waiting (native ShmGroup::Sequence, reached through the CPU module's
``group_sequence``, the function the GPU handlers call through their hooks). Run here on the
ranks' shared memory under the real launcher; what a GPU adds (the handlers calling it) is in
tests/gpu. Also: how the flight recorder reports a GPU call's record."""

from __future__ import annotations

import numpy as np
import pytest

from spmd.testing import multirank

SUM = "allreduce(op=sum) of float32[3]"
AVG = "allreduce(op=avg) of float32[3]"
GATHER = "allgather(axis=0) of float32[4, 2]"


def _gid(comm):
    """The world's native group, its sequence check forgotten on every rank (the ranks of a
    pool run several tests)."""
    from spmd._native_lib import native
    from spmd.runtime._groups import native_group

    gid = native_group(comm).gid
    comm.barrier()
    native().group_sequence_reset(gid)
    comm.barrier()
    return gid


def _make(comm, texts):
    """This rank's calls, in order, then twice (each time after every rank made its calls so
    far) one more: the error of the first that failed, or None."""
    from spmd._native_lib import native

    gid = _gid(comm)
    error = None
    for t in [*texts, None, GATHER, None, GATHER]:
        if t is None:
            comm.barrier()  # every rank has published its calls
            continue
        if error is None:
            try:
                native().group_sequence(gid, t)
            except RuntimeError as e:
                error = e
    return error


@multirank(nprocs=(2, 3))
def test_the_same_calls_pass_also_far_apart(comm):
    # More calls than a ring holds, with ranks running ahead of each other: no false alarm.
    calls = [SUM, AVG, GATHER] * 70
    assert _make(comm, calls) is None
    # One rank 100 calls ahead of the others before they start.
    from spmd._native_lib import native

    gid = _gid(comm)
    for turn in (0, 1):
        if (comm.rank == 0) == (turn == 0):
            for _ in range(100):
                native().group_sequence(gid, SUM)
        comm.barrier()
    native().group_sequence(gid, GATHER)


@multirank(nprocs=(2, 3))
def test_calls_in_another_order_fail_on_every_rank_naming_both(comm):
    # Rank 1 makes the same two calls in the other order: sum against avg, the shapes alike.
    calls = [SUM, AVG] if comm.rank != 1 else [AVG, SUM]
    error = _make(comm, [GATHER] * 5 + calls)
    assert error is not None, f"rank {comm.rank}: the swapped calls were not found"
    msg = str(error)
    assert "made different collective calls" in msg and "sequence check" in msg
    # Every rank finds the first call that differs, #6, against a rank whose call differs from
    # its own: ranks 0 and 2 (sum first) against rank 1, rank 1 against whichever of them it
    # compared with first.
    assert "call #6 on this group is" in msg, msg
    me, other = (AVG, SUM) if comm.rank == 1 else (SUM, AVG)
    peers = [r for r in range(comm.size) if r != comm.rank and (r == 1) != (comm.rank == 1)]
    assert f"rank {comm.rank}: {me}" in msg, msg
    assert any(f"\n  rank {p}: {other}" in msg for p in peers), msg


@multirank(nprocs=(2,))
def test_one_call_more_and_a_late_rank_are_found(comm):
    # Rank 0 makes one call more; after it every rank makes the same call, so that the chains
    # differ at call #3.
    error = _make(comm, [SUM] * (3 if comm.rank == 0 else 2))
    assert error is not None
    assert f"call #3 on this group is\n  rank {comm.rank}: " in str(error)
    theirs = GATHER if comm.rank == 0 else SUM
    assert f"rank {1 - comm.rank}: {theirs}" in str(error), str(error)


@multirank(nprocs=(2,))
def test_a_difference_after_a_long_lead_is_found(comm):
    from spmd._native_lib import native

    gid = _gid(comm)
    # Rank 0 makes 100 calls before rank 1 starts; rank 1's 100th differs.
    if comm.rank == 0:
        for _ in range(100):
            native().group_sequence(gid, SUM)
        comm.barrier()
    else:
        comm.barrier()
        for _ in range(99):
            native().group_sequence(gid, SUM)
        with pytest.raises(RuntimeError, match=r"call #100 on this group is\n  rank 1: "):
            native().group_sequence(gid, AVG)
    comm.barrier()
    # Rank 0 finds it at its next call; the error stays.
    with pytest.raises(RuntimeError, match="call #100 on this group is"):
        native().group_sequence(gid, SUM)
    with pytest.raises(RuntimeError, match="call #100 on this group is"):
        native().group_sequence(gid, SUM)


def test_a_gpu_record_reads_as_enqueued():
    from spmd.runtime import _recorder

    recs = np.zeros(2, _recorder.RECORD)
    names = {v: k for k, v in _recorder._names().items()}
    for i, r in enumerate(recs):
        r["seq"], r["group"], r["call"], r["bytes"] = i + 1, 7, i + 1, 12
        r["start_ns"], r["end_ns"] = 1000 * (i + 1), 1000 * (i + 1) + 500
        r["code"], r["state"], r["transport"] = names["allreduce_rmsnorm"], 3, -2
    events = [e for e in _recorder.trace_events(recs, 0, {7: [0, 1]}) if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["allreduce_rmsnorm"] * 2
    assert {e["args"]["state"] for e in events} == {"enqueued"}
    assert {e["args"]["transport"] for e in events} == {"gpu"}
    assert events[0]["dur"] == 0.5


def _ring(recs):
    from spmd.runtime import _recorder

    head = np.array([_recorder._MAGIC, len(recs), len(recs), 0, 0, 0, 0, 0], "<u8")
    return head.tobytes() + recs.tobytes()


def test_a_groups_gpu_and_cpu_calls_are_compared_apart(tmp_path):
    import json

    from spmd.runtime import _recorder

    names = {v: k for k, v in _recorder._names().items()}
    for rank in (0, 1):
        # Call #1 of group 7 twice: a CPU barrier and a GPU allreduce, each alike on both ranks
        # but made in another order; rank 1's GPU call #2 is still enqueued, rank 0 made none.
        cpu, gpu = ("barrier", 0, 11, 1, 1), ("allreduce", -2, 22, 3, 1)
        rows = [cpu, gpu] if rank == 0 else [gpu, cpu, ("allreduce", -2, 22, 3, 2)]
        recs = np.zeros(len(rows), _recorder.RECORD)
        for i, r in enumerate(recs):
            op, transport, h, state, call = rows[i]
            r["seq"], r["group"], r["call"], r["hash"] = i + 1, 7, call, h
            r["start_ns"], r["end_ns"], r["bytes"] = 10 + i, 20 + i, 16
            r["code"], r["state"], r["transport"] = names[op], state, transport
        (tmp_path / f"rank{rank}.ring").write_bytes(_ring(recs))
        (tmp_path / f"rank{rank}.groups").write_text(json.dumps([7, [0, 1]]) + "\n")
    lines = _recorder.flight_report(tmp_path)
    text = "\n".join(lines)
    assert lines[0] == "flight recorder: the group [0, 1] (its GPU calls) when the job ended:"
    assert "rank 0: collective #1 allreduce of 16 bytes, enqueued on the GPU" in text, text
    assert "rank 1: collective #2 allreduce of 16 bytes, enqueued on the GPU" in text, text
    assert "signature differs" not in text, text  # the CPU barrier is not the GPU's call #1
    assert len(lines) == 3, text  # the CPU calls agree: not reported
