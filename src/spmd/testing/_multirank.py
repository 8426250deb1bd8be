"""``@multirank``: a pytest test whose body runs on every rank."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..launch import Launcher
from ._harness import run


def _call_with_world(body: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(body)
    def on_rank() -> None:
        from ..runtime import init

        body(init())

    return on_rank


def multirank(
    nprocs: Iterable[int] = (1, 2, 3, 4),
    *,
    env: Mapping[str, str] | None = None,
    launcher: Launcher = "mpi",
    timeout: float | None = None,
    fresh: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Make ``body(comm)`` a pytest test run on every rank, once per world size in ``nprocs``.

    ``comm`` is the world communicator (``spmd.init()``). The test fails if any rank raises,
    dies or hangs; the failure shows every failing rank's traceback. Options as
    :func:`spmd.testing.run`.
    """
    sizes = list(nprocs)

    def decorate(body: Callable[..., Any]) -> Callable[..., None]:
        import pytest

        if "." in body.__qualname__:
            from .._errors import SpmdError

            raise SpmdError(
                f"{body.__qualname__} is not a module-level function; the ranks import the "
                "test by name, so define it at the top level of the test module (not in a "
                "class or another function)",
                op="@multirank",
                rank=None,  # raised where pytest collects the test, which is no rank
            )

        def test(nprocs: int) -> None:
            run(test, nprocs, env=env, launcher=launcher, timeout=timeout, fresh=fresh)

        # The ranks find the body through the test function's name.
        test._spmd_body = _call_with_world(body)  # type: ignore[attr-defined]
        test.__name__ = body.__name__
        test.__qualname__ = body.__qualname__
        test.__module__ = body.__module__
        test.__doc__ = body.__doc__
        marked: Callable[..., None] = pytest.mark.parametrize("nprocs", sizes)(test)
        return marked

    return decorate
