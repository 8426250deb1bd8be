"""Device meshes: named axes over the world's ranks, and this rank's group on each axis.

Axes are given outermost first; the last is innermost, so its groups are consecutive ranks. This
is AITER's layout ExternalDP x DP x PP x TP: ``Mesh(dp=2, tp=4)`` on 8 ranks has the tp groups
``[[0, 1, 2, 3], [4, 5, 6, 7]]`` and the dp groups ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Any

import numpy as np

from ._errors import SpmdError, SpmdTypeError
from .runtime import Communicator, get_communicator

Axis = str | tuple[str, ...]

# Axes that the derived "ep" axis combines, within each slice of the other axes (AITER's EP group
# is DP x TP inside one PP stage).
_EP_AXES = ("dp", "tp")


def _ep_axes(shape: Mapping[str, int]) -> tuple[str, ...]:
    """The axes a mesh of ``shape`` without an 'ep' axis derives 'ep' from, in mesh order."""
    return tuple(a for a in shape if a in _EP_AXES)


# The entered meshes, innermost last, each with the jit-key context it entered (or None).
_active: contextvars.ContextVar[tuple[tuple[Mesh, Any], ...]] = contextvars.ContextVar(
    "spmd_active_meshes", default=()
)


def _make_jit_key() -> Any:
    """A JAX configuration state that is part of jit's cache key: the active mesh's shape goes
    there, so that a jitted function whose collectives name mesh axes (resolved when it is
    traced) is traced again under a mesh of another shape instead of reusing the groups of the
    first. None where this JAX has no such state (then re-jit after changing meshes)."""
    from ._jax_compat import jit_key_state

    return jit_key_state(
        "spmd_active_mesh", "the shape of spmd's active mesh (set by `with spmd.Mesh(...)`)"
    )


_JIT_KEY: list[Any] = []  # made on first use: importing spmd does not import JAX


def _jit_key() -> Any:
    if not _JIT_KEY:
        _JIT_KEY.append(_make_jit_key())
    return _JIT_KEY[0]


def layout_rank_lists(shape: Mapping[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """The groups of ranks that vary along ``axes`` (and agree on every other axis).

    Ranks are laid out row-major over ``shape`` (first axis outermost). Groups are listed in
    row-major order of the other axes; inside a group, ranks are ordered row-major over ``axes``
    in the order given.
    """
    names = list(shape)
    ranks = np.arange(math.prod(shape.values())).reshape([shape[n] for n in names])
    moved = np.moveaxis(ranks, [names.index(a) for a in axes], range(-len(axes), 0))
    group_size = math.prod(shape[a] for a in axes)
    return [[int(r) for r in g] for g in moved.reshape(-1, group_size)]


class Mesh:
    """Named axes over the world's ranks, e.g. ``Mesh(dp=2, pp=2, tp=2)``.

    Sizes are positive integers; one of them may be -1, inferred from the world size. The sizes'
    product must equal the world size. Besides its own axes, a mesh answers for ``"ep"`` (if it
    has no axis of that name): the ``dp`` and ``tp`` axes combined, within each slice of the
    others. Wherever an axis is expected, a tuple of axis names means those axes combined.

    ``with mesh:`` makes it the active mesh, whose axis names collectives accept as ``group=``.
    Creating a mesh starts the runtime (:func:`spmd.init`) if needed.

    Example (a world of one; on 8 ranks ``Mesh(dp=2, tp=4)`` has the tp groups ``[[0, 1, 2,
    3], [4, 5, 6, 7]]`` and the dp groups ``[[0, 4], [1, 5], [2, 6], [3, 7]]``)::

        >>> import jax.numpy as jnp, spmd
        >>> mesh = spmd.Mesh(dp=-1, tp=1)
        >>> dict(mesh.shape), mesh.rank_lists("dp")
        ({'dp': 1, 'tp': 1}, [[0]])
        >>> with mesh:
        ...     spmd.allreduce(jnp.ones(2), group="tp")
        Array([1., 1.], dtype=float32)
    """

    def __init__(self, **axes: int) -> None:
        world = get_communicator()
        if not axes:
            raise SpmdError(f"Mesh() needs at least one axis, e.g. Mesh(dp={world.size})")
        inferred = [name for name, size in axes.items() if size == -1]
        for name, size in axes.items():
            if isinstance(size, bool) or not isinstance(size, int | np.integer):
                raise SpmdTypeError(f"Mesh axis {name}={size!r} is not an integer size")
            if size < 1 and size != -1:
                raise SpmdError(f"Mesh axis {name}={size} must be >= 1 (or -1 to infer it)")
        if len(inferred) > 1:
            raise SpmdError(f"Mesh({_fmt(axes)}) may infer (-1) at most one axis")
        known = math.prod(size for size in axes.values() if size != -1)
        shape = {name: int(size) for name, size in axes.items()}
        if inferred:
            if world.size % known:
                raise SpmdError(
                    f"Mesh({_fmt(axes)}): the world size {world.size} is not divisible "
                    f"by {known}, so {inferred[0]}=-1 cannot be inferred"
                )
            shape[inferred[0]] = world.size // known
        if math.prod(shape.values()) != world.size:
            raise SpmdError(
                f"Mesh({_fmt(axes)}) has {math.prod(shape.values())} ranks but the world "
                f"has {world.size}; the axis sizes must multiply to the world size"
            )
        self._shape = MappingProxyType(shape)
        self._world = world

    # -- shape ----------------------------------------------------------------------------------

    @property
    def shape(self) -> Mapping[str, int]:
        """Axis name -> size, outermost first."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._shape)

    @property
    def size(self) -> int:
        return self._world.size

    def axes(self, axis: Axis) -> tuple[str, ...]:
        """The mesh axes ``axis`` stands for: itself, each name of a tuple, or for ``"ep"`` (on a
        mesh without such an axis) its dp and tp axes; an error for a name the mesh lacks."""
        names = (axis,) if isinstance(axis, str) else axis
        if not isinstance(names, tuple) or not names or not all(isinstance(a, str) for a in names):
            raise SpmdTypeError(
                f"axis={axis!r} is not an axis name or a tuple of axis names of {self!r}",
                rank=self._world.world_rank,
            )
        derived = "ep" in names and "ep" not in self._shape
        out = tuple(a for n in names for a in self._expand(n))
        if len(set(out)) != len(out):
            raise SpmdError(
                f"axis={axis!r} uses a mesh axis twice"
                + (f" ('ep' is {' and '.join(_ep_axes(self._shape))} combined)" if derived else ""),
                rank=self._world.world_rank,
            )
        return out

    def _expand(self, name: str) -> tuple[str, ...]:
        """One axis name as the mesh's own axes: 'ep' (when the mesh has no such axis) is its
        dp and tp axes combined."""
        if name == "ep" and "ep" not in self._shape:
            derived = _ep_axes(self._shape)
            if not derived:
                raise SpmdError(
                    f"{self!r} has no 'dp' or 'tp' axis, from "
                    "which the 'ep' axis is derived; name an axis 'ep', or pass a tuple of axes",
                    rank=self._world.world_rank,
                )
            return derived
        if name not in self._shape:
            raise SpmdError(
                f"{self!r} has no axis {name!r}; its axes are "
                f"{', '.join(map(repr, self._shape))}"
                + (
                    ""
                    if "ep" in self._shape or not _ep_axes(self._shape)
                    else " (and 'ep', derived from its dp and tp axes)"
                )
                + f". An axis the mesh lacks is not taken as size 1 (a misspelt name would then "
                f"skip a reduction silently): add it as {name}=1 to the mesh",
                rank=self._world.world_rank,
            )
        return (name,)

    # -- groups ---------------------------------------------------------------------------------

    def rank_lists(self, axis: Axis) -> list[list[int]]:
        """Every group of ranks along ``axis``: a ``rank_list`` for collectives and
        :func:`spmd.get_communicator`."""
        return layout_rank_lists(self._shape, self.axes(axis))

    def group(self, axis: Axis) -> Communicator:
        """This rank's communicator along ``axis`` (created on first use, then cached)."""
        return get_communicator(self.rank_lists(axis))

    def index(self, axis: Axis) -> int:
        """This rank's coordinate along ``axis`` (its rank within its group on that axis)."""
        me = self._world.world_rank
        return next(g.index(me) for g in self.rank_lists(axis) if me in g)

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every axis of the mesh."""
        return {a: self.index(a) for a in self._shape}

    # -- the active mesh ------------------------------------------------------------------------

    def __enter__(self) -> Mesh:
        state = _jit_key()
        key = None if state is None else state(self._key())
        if key is not None:
            key.__enter__()
        _active.set((*_active.get(), (self, key)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        *rest, (_, key) = _active.get()
        _active.set(tuple(rest))
        if key is not None:
            key.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"Mesh({_fmt(self._shape)})"

    # Meshes of one shape over one world have the same groups: they are equal, so that arrays
    # placed on either are the same pytree type and jit does not trace again for a new mesh.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._key() == other._key() and self._world is other._world

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[tuple[str, int], ...]:
        """The mesh's shape, which its groups follow from: what caches of traces key on."""
        return tuple(self._shape.items())


def mesh_key() -> Any:
    """What a cache of traced programs must key on when group names may be mesh axes: the
    active mesh's shape (its groups follow from it), or None."""
    mesh = current_mesh()
    return None if mesh is None else mesh._key()


def current_mesh() -> Mesh | None:
    """The innermost mesh entered with ``with mesh:``, or None."""
    stack = _active.get()
    return stack[-1][0] if stack else None


def _fmt(axes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in axes.items())


def resolve_group(
    rank_list: Any = None, group: Any = None, *, op: str | None = None
) -> Communicator:
    """The Communicator that an op's ``rank_list=`` or ``group=`` argument designates.

    ``group`` is a Communicator or an axis name (or tuple of names) of the active mesh;
    ``rank_list`` a RAF-style list of rank lists; both None: the default communicator. ``op``
    names the operation in errors.
    """
    if rank_list is not None and group is not None:
        raise SpmdError("pass rank_list= or group=, not both", op=op)
    if group is None:
        return get_communicator(rank_list)
    if isinstance(group, Communicator):
        return group
    if isinstance(group, str | tuple):
        mesh = current_mesh()
        if mesh is None:
            raise SpmdError(
                f"group={group!r} names a mesh axis but no mesh is active; use it inside "
                "`with spmd.Mesh(...):`, or pass group=mesh.group(axis)",
                op=op,
            )
        return mesh.group(group)
    raise SpmdError(
        f"group={group!r} is not a Communicator or a mesh axis name (str); pass e.g. "
        "group=spmd.get_communicator(...) or group='tp' inside `with spmd.Mesh(...):`",
        op=op,
    )
