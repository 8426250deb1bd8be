"""The peer watch's judgement of the peers of a waiting collective, in this process, against real
TCP peers on loopback: peers that never answer, and one whose port refuses (its process gone).
Across nodes under the real launcher: tests/cli/test_run.py and tests/cli/test_hosts.py."""

from __future__ import annotations

import socket
import time

import spmd
from spmd.runtime import _watch


def test_silent_peers_are_asked_together_and_a_gone_one_is_named():
    world = spmd.init()  # a world of one: the watch's own rank is 0
    # Eight peers whose ports take connections and never answer (stopped, or unreachable),
    # and one whose port refuses them (its process has ended).
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(8)]
    closed = socket.create_server(("127.0.0.1", 0))
    gone_port = closed.getsockname()[1]
    closed.close()
    watch = _watch._Watch(world)
    try:
        watch.addresses = [("127.0.0.1", 9)] + [s.getsockname() for s in silent]
        watch.addresses.append(("127.0.0.1", gone_port))
        ranks = tuple(range(10))
        start = time.monotonic()
        watch._check(ranks, call=3, waited=1.0)
        took = time.monotonic() - start
        known = watch.known[(ranks, 3)]
        assert [known[r] for r in range(1, 9)] == ["silent"] * 8
        assert known[9] == "gone"
        # Asked together: about one ask timeout, not eight.
        assert took < 3 * _watch._ASK_TIMEOUT_S, f"judging 9 peers took {took:.2f} s"
    finally:
        watch.close()
        for s in silent:
            s.close()
