"""spmd.MessageQueue: one writer, every other rank a reader, on shared memory (ranks on the
writer's node) and over ZMQ (simulated nodes), objects of every size in order (larger than a
slot too), broadcast_object through it, and its errors: a reader that does not read, a writer
that dies, misuse; nothing left in /dev/shm, also after a SIGKILL."""

from __future__ import annotations

import glob
import subprocess
import sys
import time

import numpy as np
import pytest

import spmd
from spmd.testing import multirank

from .. import _leftovers as leftovers


def _objects():
    """Objects of 0 bytes to several slots (4 KiB slots below), each different."""
    return [
        None,
        {"step": 1, "lr": 1e-3},
        np.arange(10),
        b"x" * 4096,  # one slot exactly, with the pickle's header: two
        np.arange(5000, dtype=np.float64),  # 40 KiB: ten slots
        ["tail", 7],
    ]


def _exchange(comm, writer: int, repeat: int = 3) -> None:
    with spmd.MessageQueue(comm, writer=writer, slots=4, slot_bytes=4096) as q:
        for i in range(repeat):  # more messages than slots: the ring wraps around
            for obj in _objects():
                sent = (i, obj)
                if comm.rank == writer:
                    q.enqueue(sent)
                else:
                    got = q.dequeue(timeout=30)
                    assert got[0] == i
                    if isinstance(obj, np.ndarray):
                        np.testing.assert_array_equal(got[1], obj)
                    else:
                        assert got[1] == obj


@multirank(nprocs=(2, 3, 4))
def test_objects_arrive_in_order_over_shared_memory(comm):
    _exchange(comm, writer=0)
    _exchange(comm, writer=comm.size - 1)
    assert not glob.glob("/dev/shm/spmd-mq-*")  # unlinked once every reader mapped it


@multirank(nprocs=(4,))
def test_a_ring_of_few_slots_under_load_delivers_every_byte(comm):
    """The publication order under stress: 5000 messages through 4 slots to 3 readers, each
    message's bytes depending on its number and of varying length (one slot or two), so that a
    reader that saw a sequence number before the data it guards, or a writer that reused a slot
    a reader was still copying, would show a wrong byte. (x86-64 orders these loads and stores
    anyway; the native acquire/release atomics make aarch64 keep the same order.)"""
    count = 5000
    with spmd.MessageQueue(comm, writer=0, slots=4, slot_bytes=256) as q:
        if comm.rank == 0:
            for i in range(count):
                q.enqueue(bytes([i % 251]) * (i % 400))
        else:
            bad = [i for i in range(count) if q.dequeue(timeout=60) != bytes([i % 251]) * (i % 400)]
            assert bad == [], f"rank {comm.rank}: {len(bad)} messages differ, first {bad[:5]}"


@multirank(nprocs=(4,), env={"SPMD_SIMULATE_NODES": "2"})
def test_readers_on_other_nodes_get_them_over_zmq(comm):
    """Ranks 0, 1 on one node, 2, 3 on the other: rank 0 writes to 1 by shared memory and to
    2, 3 over ZMQ; then rank 3 writes (2 local, 0 and 1 remote)."""
    pytest.importorskip("zmq")
    _exchange(comm, writer=0)
    _exchange(comm, writer=3)
    # Readers far behind: more messages in flight than ZMQ's default high-water marks (1000 on
    # each side); none may be lost.
    with spmd.MessageQueue(comm, writer=0, slots=4096, slot_bytes=64) as q:
        if comm.rank == 0:
            for i in range(3000):
                q.enqueue(i)
        else:
            time.sleep(1.0)
            assert [q.dequeue(timeout=30) for _ in range(3000)] == list(range(3000))


@multirank(nprocs=(2, 3))
def test_broadcast_object_goes_through_a_queue_within_a_node(comm):
    for root in range(comm.size):
        for obj in _objects():
            got = comm.broadcast_object(obj if comm.rank == root else "not this", root=root)
            if isinstance(obj, np.ndarray):
                np.testing.assert_array_equal(got, obj)
            else:
                assert got == obj
    assert sorted(comm._queues) == list(range(comm.size))  # one queue per root, made once


@multirank(nprocs=(2,))
def test_a_reader_that_does_not_read_is_named_and_misuse_is_refused(comm):
    q = spmd.MessageQueue(comm, slots=2, slot_bytes=64, timeout=1.0)
    if comm.rank == 0:
        q.enqueue(1)
        q.enqueue(2)
        start = time.monotonic()
        with pytest.raises(spmd.SpmdError, match=r"the readers \[1\] have not read"):
            q.enqueue(3)  # both slots hold messages rank 1 has not read
        assert time.monotonic() - start < 10
        with pytest.raises(spmd.SpmdError, match="dequeue on rank 0, the writer"):
            q.dequeue()
        with pytest.raises(spmd.SpmdError, match="a function cannot be pickled"):
            q.enqueue(lambda: 0)
    else:
        with pytest.raises(spmd.SpmdError, match="enqueue on rank 1, a reader"):
            q.enqueue(1)
    comm.barrier()
    if comm.rank == 1:
        assert [q.dequeue(), q.dequeue()] == [1, 2]
        with pytest.raises(spmd.SpmdError, match=r"nothing from the writer, rank 0, within 0.5"):
            q.dequeue(timeout=0.5)
    q.close()
    with pytest.raises(spmd.SpmdError, match="closed"):
        q.enqueue(4) if comm.rank == 0 else q.dequeue()


def test_a_writer_killed_is_named_by_its_readers_and_leaves_nothing(tmp_path):
    """Started torchrun-style (no MPI launcher stops the others when one dies): the readers
    find that the writer's process is gone and say so, long before their timeout."""
    import os

    script = tmp_path / "writer_dies.py"
    script.write_text(
        "import os, signal, spmd\n"
        "comm = spmd.init()\n"
        "q = spmd.MessageQueue(comm, timeout=60)\n"
        "if comm.rank == 0:\n"
        "    q.enqueue('first')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "assert q.dequeue() == 'first'\n"
        "q.dequeue()\n"
    )
    store = tmp_path / "store"
    store.mkdir()
    env = {**os.environ, "WORLD_SIZE": "3", "SPMD_FILE_STORE_PATH": str(store),
           "SPMD_RUN_ID": "mq-test"}  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "HYDI_", "HYDRA_"))}
    before = leftovers.files(["/dev/shm/spmd-*"])
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(3)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[0].returncode == -9
    for r in (1, 2):
        assert procs[r].returncode == 1, errs[r]
        assert "the writer, rank 0, has ended" in errs[r], errs[r]
    assert time.monotonic() - start < 30  # not the 60 s timeout
    assert leftovers.new_files(["/dev/shm/spmd-*"], before) == set()
