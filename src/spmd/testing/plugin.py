"""pytest plugin of spmd (registered through the ``pytest11`` entry point): stops the pooled
ranks of :mod:`spmd.testing` when the session ends."""

from __future__ import annotations

from typing import Any


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    from ._harness import shutdown_pools

    shutdown_pools()
