"""Inputs, grouping forms and NumPy references shared by the collective tests.

Every rank's input is a function of its world rank, so each rank computes the expected result of
its own group locally, without communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

import spmd

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
FLOATS = ("float16", "bfloat16", "float32", "float64")


def np_dtype(name: str) -> Any:
    return jnp.bfloat16 if name == "bfloat16" else np.dtype(name)


def value(
    world_rank: int, dtype: str, shape: tuple[int, ...] = (2, 3), salt: int = 0
) -> np.ndarray:
    """Rank-dependent small integers (exact in every dtype, even summed over 4 ranks)."""
    base = (np.arange(int(np.prod(shape))).reshape(shape) * 7 + world_rank * 3 + salt) % 5 + 1
    if dtype == "bool":
        return (base + world_rank) % 2 == 0
    return base.astype(np_dtype(dtype))


def inputs(world_rank: int, dtypes=DTYPES, shape=(2, 3), salt: int = 0) -> dict[str, np.ndarray]:
    return {d: value(world_rank, d, shape, salt) for d in dtypes}


@dataclass
class Form:
    """One way of naming a group, and the world ranks of this rank's group."""

    name: str
    kwargs: dict[str, Any]
    members: list[int]
    mesh: Any = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.mesh is None:
            yield
        else:
            with self.mesh:
                yield

    @property
    def position(self) -> int:
        return self.members.index(spmd.get_communicator().rank)


def _members(groups: list[list[int]], rank: int) -> list[int]:
    for g in groups:
        if rank in g:
            return g
    return [rank]


def forms(comm: Any) -> list[Form]:
    """World, RAF rank_list pairs, a partial rank_list, a Communicator, a mesh axis name."""
    n, r = comm.size, comm.rank
    pairs = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
    partial = [list(range(min(3, n)))]
    out = [
        Form("world", {}, list(range(n))),
        Form("rank_list pairs", {"rank_list": pairs}, _members(pairs, r)),
        Form("rank_list partial", {"rank_list": partial}, _members(partial, r)),
        Form("group=Communicator", {"group": spmd.get_communicator(pairs)}, _members(pairs, r)),
    ]
    if n % 2 == 0:
        mesh = spmd.Mesh(dp=n // 2, tp=2)
        out.append(Form("group=mesh axis", {"group": "tp"}, mesh.rank_lists("tp")[r // 2], mesh))
    return out


# -- references ---------------------------------------------------------------------------------


def reduce_ref(values: list[np.ndarray], op: str) -> np.ndarray:
    dtype = values[0].dtype
    if dtype == np.bool_:
        stack = np.stack(values)
        return stack.any(0) if op in ("sum", "max") else stack.all(0)
    acc = np.stack([v.astype(np.float64) for v in values])
    fn = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    return fn(acc, axis=0).astype(dtype)


def close(actual: Any, expected: np.ndarray, what: str) -> None:
    actual = np.asarray(actual)
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if expected.dtype == np.bool_ or np.issubdtype(expected.dtype, np.integer):
        np.testing.assert_array_equal(actual, expected, err_msg=what)
    else:
        np.testing.assert_allclose(
            actual.astype(np.float64), expected.astype(np.float64), rtol=1e-2, err_msg=what
        )


@contextlib.contextmanager
def x64() -> Iterator[None]:
    """64-bit dtypes on (float64/int64 arrays stay 64-bit), restored afterwards."""
    import jax

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
