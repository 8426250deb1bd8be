"""The peer watch's judgement of the peers of a waiting collective, in this process, against real
TCP peers on loopback: peers that never answer, and one whose port refuses (its process gone);
its server's token and its clients served together.
Across nodes under the real launcher: tests/cli/test_run.py and tests/cli/test_hosts.py."""

from __future__ import annotations

import os
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
        token = "t" * 32
        watch.addresses = [("127.0.0.1", 9, token)] + [(*s.getsockname(), token) for s in silent]
        watch.addresses.append(("127.0.0.1", gone_port, token))
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


def test_the_server_answers_its_token_only_and_a_silent_client_delays_nobody():
    """This process's own server (native): a request without its token gets no answer (the
    connection is closed), with it an answer; 80 clients that connect and say nothing (more
    than it keeps: the oldest are dropped) do not delay an asking peer."""
    world = spmd.init()
    watch = _watch._Watch(world)
    try:
        watch.listen()
        watch.addresses = [(watch.host, watch.port, watch.token)]
        mine = watch.ask(0, [0])
        assert mine == {"started": -1, "leaving": 0, "pid": os.getpid(), "dumps": mine["dumps"]}
        for request in (b"1 0\n", b"0 \n", ("x" * 32 + " 1 0\n").encode(),
                        (watch.token[:-1] + "y 0 0\n").encode()):  # fmt: skip
            with socket.create_connection((watch.host, watch.port), timeout=5) as conn:
                conn.sendall(request)
                assert conn.recv(100) == b"", request  # closed, nothing said
        silent = [socket.create_connection((watch.host, watch.port)) for _ in range(80)]
        try:
            start = time.monotonic()
            answers = [watch.ask(0, [0]) for _ in range(5)]
            took = time.monotonic() - start
        finally:
            for conn in silent:
                conn.close()
        assert answers == [mine] * 5
        assert took < _watch._ASK_TIMEOUT_S, f"5 asks behind 80 silent clients took {took:.2f} s"
    finally:
        watch.close()
