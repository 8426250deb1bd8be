"""Which launcher topology files a job's rank removes: those no other live launcher proxy of the
user can have written (the launcher itself is exercised in tests/cli/test_agreement.py)."""

from __future__ import annotations

from spmd.runtime._leftovers import stale_topology_files


def test_a_file_only_this_job_s_proxy_can_have_written_is_removed():
    # Ages in seconds: the proxy 7 started 10 s ago, its file was written 9.5 s ago.
    assert stale_topology_files({"/tmp/a": 9.5}, {7: 10.0}, own=7) == ["/tmp/a"]


def test_a_file_older_than_every_live_proxy_belongs_to_a_dead_job_and_is_removed():
    assert stale_topology_files({"/tmp/old": 600.0}, {7: 10.0, 8: 20.0}, own=7) == ["/tmp/old"]
    assert stale_topology_files({"/tmp/old": 600.0}, {}, own=None) == ["/tmp/old"]


def test_a_file_another_live_proxy_may_have_written_stays():
    # Proxy 8 (another job of the user) started 30 s ago, before both files were written.
    files = {"/tmp/mine": 9.5, "/tmp/theirs": 25.0}
    assert stale_topology_files(files, {7: 10.0, 8: 30.0}, own=7) == []
    # Under a launcher without such a proxy (srun), any file a live proxy may own stays.
    assert stale_topology_files({"/tmp/theirs": 25.0}, {8: 30.0}, own=None) == []


def test_a_proxy_started_within_the_clock_s_resolution_of_the_file_counts_as_its_writer():
    assert stale_topology_files({"/tmp/f": 10.0}, {8: 9.98}, own=7) == []
    assert stale_topology_files({"/tmp/f": 10.0}, {8: 9.9}, own=7) == ["/tmp/f"]
