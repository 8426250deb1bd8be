"""Pipeline parallelism: a model's layers split into stages over the ranks of a group
(``spmd.pipeline``, by default the ``"pp"`` axis of the active mesh).

Rank s of the group holds stage s's parameters and runs ``stage_fn(params, x)`` on what stage
s - 1 sends it (stage 0 on the inputs). :func:`value_and_grad` splits the batch into
microbatches and runs, inside one traced program, every forward and backward pass of this
stage in the order of a schedule, with ``spmd.send``/``recv``/``sendrecv`` on the group moving
activations forward and their gradients backward:

- ``"gpipe"`` (GPipe): every microbatch's forward pass, then every backward pass (last
  microbatch first); what the backward passes need is kept for all m microbatches;
- ``"1f1b"`` (PipeDream-Flush, Megatron-LM's non-interleaved schedule): stage s runs
  ``p - s - 1`` forward passes to fill the pipeline, then alternates one forward with one
  backward, then drains the backward passes left; it keeps at most ``p - s`` microbatches'
  worth. A stage that sends an activation forward and waits for a gradient from the same
  neighbour does both in one ``sendrecv``, so neither rank waits on the other.

- ``"interleaved"`` (Megatron-LM's interleaved 1F1B, ``virtual_stages=v``): each rank holds v
  chunks of layers, chunk ``j * p + r`` on rank r, and runs 1F1B over them in Megatron-LM's
  order (module ``_interleaved``), for a bubble of ``(p - 1) / (v m + p - 1)``.

- ``"zero_bubble"`` (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's order,
  with each backward pass split in two (module ``_backward_split``): B, the gradient of what
  the stage received, which the previous stage waits for, and W, the gradient of the stage's
  parameters, which nothing waits for; stage s runs each W s microbatches late, where 1F1B's
  stage would wait at the end. It keeps at most p microbatches on every stage (1F1B's first
  stage's peak). Its messages: as 1F1B's, but the gradient goes back with a plain send, and W
  runs before the next activation is received.

All give the same loss and gradients (those of one process running the whole model on the
whole batch, up to float rounding). In theory GPipe and 1F1B leave ``(p - 1) / (m + p - 1)`` of
the step idle, and ZB-H1 ``(p - 1)(F + B - W)`` of ``m(F + B + W) + (p - 1)(F + B - W)`` (F, B,
W: the time of a forward pass and of the two halves of a backward pass), ``(p - 1) /
(3m + p - 1)`` where the three take equal time. The repeated part of each schedule is a
``lax.scan``, so the compiled program stays the same size for any m, and XLA cannot run
forward passes ahead of the schedule (it orders the computations of an unrolled program by
their data alone).

Before any of that, when the program is built, the stages agree on shapes: stage 0 works out
the shape of what it sends from its inputs' microbatch (``jax.eval_shape``), tells stage 1,
which works out its own, and so on (host-side messages over the group, once per trace). A stage
that cannot take what the previous one sends is an error naming both stages, raised on every
rank of the group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import SpmdError
from ..mesh import resolve_group
from ..ops import after, broadcast, recv, send, sendrecv
from ..runtime import Communicator
from ..transforms.marks import active, mark_tree
from . import _interleaved
from ._backward_split import BackwardSplit
from ._stages import agree_settings, at, describe, split, stage_layers, sum_shared

__all__ = ["SCHEDULES", "split", "stage_layers", "value_and_grad"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
_OP = "pipeline_value_and_grad"


# -- the pipelined step -------------------------------------------------------------------------


def value_and_grad(
    stage_fn: Callable[[Any, Any], Any],
    loss_fn: Callable[[Any, Any], Any],
    *,
    microbatches: int,
    schedule: str = "1f1b",
    group: Any = "pp",
    shared: Any = None,
    virtual_stages: int = 1,
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """The loss and this stage's gradients of a model split into pipeline stages over the group.

    Returns ``f(stage_params, inputs, targets) -> (loss, grads)``:

    - ``stage_params``: this rank's stage's parameters (any pytree; ShardedArrays of tensor
      parallel layers too); ``stage_fn(stage_params, x)`` is this rank's stage, and the rank's
      position in the group says which one it is (:func:`stage_layers` picks a stage's layers);
    - ``inputs``: the batch, read on the first stage only (others may pass None); ``targets``:
      read on the last stage only; both are pytrees whose leaves have the batch on axis 0, split
      into ``microbatches`` equal parts;
    - ``loss``: the mean over the microbatches of ``loss_fn(stage_fn(...), targets_i)`` (a
      scalar, computed on the last stage), the same on every rank of the group;
    - ``grads``: the gradient of that loss with respect to ``stage_params``. Inside
      ``@spmd.data_parallel`` or ``@spmd.zero_shard`` they are marked like
      ``spmd.value_and_grad``'s, so the transform reduces them over its group: use a group
      that does not span the pipeline axis (``group="dp"`` on a mesh with ``pp``), as each
      stage's ranks hold different parameters.

    ``schedule``: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved"`` or ``"zero_bubble"``
    (module doc). A group of one runs the microbatches one after the other in this process.
    ``"interleaved"`` takes ``virtual_stages=v``: ``stage_params`` is then a list of v pytrees,
    entry j being model chunk ``j * p + r`` on rank r of the p ranks (Megatron-LM's placement;
    :func:`stage_layers` with ``virtual_stages`` picks them), and ``grads`` the same list.

    ``shared``: parameters that every stage holds but only some use (an embedding on the first
    stage, a head on the last, or weights tied between them), as a pytree of bools with the
    structure of ``stage_params`` or a prefix of it (True: shared), e.g. ``{"embed": True,
    "blocks": False}``. Their gradients are summed over the group before they are returned
    (Megatron-LM's embedding group), so that every stage holds the same gradient and, applying
    the same update, the same values.

    Example (a world of one: one stage, the whole model)::

        >>> import jax.numpy as jnp, spmd
        >>> step = spmd.pipeline_value_and_grad(
        ...     lambda w, x: x * w, lambda y, t: jnp.mean((y - t) ** 2), microbatches=2)
        >>> with spmd.Mesh(pp=-1):
        ...     loss, g = step(jnp.float32(2.0), jnp.arange(4.0), jnp.zeros(4))
        >>> loss, g
        (Array(14., dtype=float32), Array(14., dtype=float32))
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise SpmdError(f"microbatches={microbatches!r}; expected an int, 1 or more", op=_OP)
    if schedule not in SCHEDULES:
        raise SpmdError(f"schedule={schedule!r}; expected one of {SCHEDULES}", op=_OP)
    v = virtual_stages
    if (
        isinstance(v, bool)
        or not isinstance(v, int)
        or v < 1
        or (v > 1) != (schedule == "interleaved")
    ):
        raise SpmdError(
            f"virtual_stages={v!r} with schedule={schedule!r}; expected an int, more than 1 "
            "with schedule='interleaved' (each rank's chunks), else 1",
            op=_OP,
        )

    compiled: dict[Any, Any] = {}  # per group: the schedule as one program, for eager calls

    @functools.wraps(stage_fn)
    def step(stage_params: Any, inputs: Any = None, targets: Any = None) -> tuple[Any, Any]:
        comm = resolve_group(None, group, op=_OP)

        if v > 1 and (not isinstance(stage_params, list | tuple) or len(stage_params) != v):
            raise SpmdError(
                f"stage_params is {type(stage_params).__name__}"
                + (f" of {len(stage_params)}" if isinstance(stage_params, list | tuple) else "")
                + f"; with virtual_stages={v} it is a list of {v} pytrees (this rank's chunks)",
                op=_OP,
            )

        def go(params: Any, xs: Any, ts: Any) -> tuple[Any, Any]:
            return _Run(comm, stage_fn, loss_fn, microbatches, schedule)(params, xs, ts, shared)

        leaves = jax.tree_util.tree_leaves((stage_params, inputs, targets))
        if active() is not None or any(isinstance(x, jax.core.Tracer) for x in leaves):
            return go(stage_params, inputs, targets)
        # Called outside any trace: the schedule runs as one compiled program, as it does in a
        # transform. (Eager, the stage's forward pass would hand back copies of its parameters
        # among its residuals, which the stash keeps apart from the parameters by identity.)
        key = (comm.groups, comm.world_rank)
        if key not in compiled:
            compiled[key] = jax.jit(go)
        return compiled[key](stage_params, inputs, targets)  # type: ignore[no-any-return]

    return step


class _Run:
    """One trace of a pipelined step on one rank."""

    def __init__(
        self,
        comm: Communicator,
        stage_fn: Callable[[Any, Any], Any],
        loss_fn: Callable[[Any, Any], Any],
        m: int,
        schedule: str,
    ) -> None:
        self.comm, self.stage_fn, self.loss_fn = comm, stage_fn, loss_fn
        self.m, self.schedule = m, schedule
        self.p, self.s = comm.size, comm.rank
        self.first, self.last = self.s == 0, self.s == self.p - 1

    # -- before anything runs: the stages agree ------------------------------------------------

    def _split(self, tree: Any, what: str) -> Any:
        """``tree`` with every leaf reshaped to ``(m, rows / m, ...)``: microbatch i is
        ``at(result, i)``."""
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        if not leaves:
            where = "first" if what == "inputs" else "last"
            raise SpmdError(f"{what} is {tree!r}; the {where} stage needs the batch", op=_OP)
        for path, leaf in leaves:
            shape = np.shape(leaf)
            if not shape or shape[0] % self.m:
                raise SpmdError(
                    f"{what}{jax.tree_util.keystr(path)} has shape {shape}, whose axis 0 does "
                    f"not split into microbatches={self.m} equal parts; pass a batch whose size "
                    f"is a multiple of {self.m}",
                    op=_OP,
                )
        return jax.tree_util.tree_map(
            lambda a: jnp.reshape(jnp.asarray(a), (self.m, -1, *np.shape(a)[1:])), tree
        )

    def _agree(
        self, chunks: list[Any], inputs: Any, targets: Any, settings: dict[str, Any]
    ) -> list[Any]:
        """Check that every rank passed the same ``settings``, split the batch, and work out
        what each stage sends (``jax.ShapeDtypeStruct`` trees; the last stage's: its loss)
        stage after stage: the same on every rank of the group, or the same error on every
        rank. This rank holds stages ``j * p + s`` (``chunks[j]``; one, but for the
        interleaved schedule)."""
        comm, p, s = self.comm, self.p, self.s
        agree_settings(comm, settings)

        def setup() -> None:
            self.xs = self._split(inputs, "inputs") if self.first else None
            self.ts = self._split(targets, "targets") if self.last else None

        comm.agree(setup)
        xs = self.xs
        like = None if xs is None else jax.eval_shape(lambda: at(xs, 0))
        sends: list[Any] = []
        n = len(chunks) * p
        for c in range(n):

            def stage_c(c: int = c, like: Any = like) -> Any:
                return self._shape_of_stage(chunks[c // p], like, c, n) if c % p == s else None

            like = comm.agree(stage_c)[c % p]
            sends.append(like)
        return sends

    def _shape_of_stage(self, params: Any, like: Any, stage: int, stages: int) -> Any:
        """What stage ``stage`` of ``stages`` (this rank's, or one of its chunks) sends on (the
        loss, on the last), from what it receives."""
        try:
            out = jax.eval_shape(self.stage_fn, params, like)
        except Exception as e:
            if stage == 0:
                raise SpmdError(
                    f"stage 0's stage_fn fails on a microbatch of the inputs, "
                    f"{describe(like)}: {type(e).__name__}: {e}",
                    op=_OP,
                ) from e
            raise SpmdError(
                f"stage {stage}'s stage_fn cannot take what stage {stage - 1} sends, "
                f"{describe(like)}: {type(e).__name__}: {e}",
                op=_OP,
            ) from e
        if stage < stages - 1:
            for leaf in jax.tree_util.tree_leaves(out):
                if not jnp.issubdtype(leaf.dtype, jnp.floating):
                    raise SpmdError(
                        f"stage {stage} sends {describe(out)}; what a stage sends on must be "
                        "floating point (its gradient travels back)",
                        op=_OP,
                    )
            return out
        assert self.ts is not None
        try:
            loss = jax.eval_shape(self.loss_fn, out, at(self.ts, 0))
        except Exception as e:
            raise SpmdError(
                f"loss_fn fails on the last stage's output, {describe(out)}, and a microbatch "
                f"of the targets: {type(e).__name__}: {e}",
                op=_OP,
            ) from e
        scalar = getattr(loss, "shape", None) == ()
        if not (scalar and jnp.issubdtype(loss.dtype, jnp.floating)):
            raise SpmdError(
                f"loss_fn returns {describe(loss)}; expected a floating-point scalar", op=_OP
            )
        return loss

    # -- the schedule -------------------------------------------------------------------------
    #
    # What a microbatch's backward pass needs (the residuals of its jax.vjp) waits in a stash of
    # K slots, microbatch i in slot i % K: K = m for GPipe, min(p - s, m) for 1F1B. The repeated
    # part of a schedule runs as a lax.scan, whose iterations XLA runs one after the other: so
    # the stash is all the activation memory the schedule keeps, whatever order XLA would
    # otherwise pick for the computations (it would compute forward passes ahead).

    def __call__(self, params: Any, inputs: Any, targets: Any, shared: Any) -> tuple[Any, Any]:
        ctx = active()
        if ctx is not None and ctx.accumulate_steps > 1:
            raise SpmdError(
                f"{ctx.transform}(accumulate_steps={ctx.accumulate_steps}) around a pipeline: "
                "the pipeline splits its batch into microbatches itself; pass accumulate_steps=1 "
                "and microbatches= to the pipeline instead",
                op=_OP,
            )
        call = -1
        if ctx is not None:
            call, ctx.calls = ctx.calls, ctx.calls + 1
            params = mark_tree(params, "param", call)
        if self.schedule == "interleaved":
            loss, grads = _interleaved.run(self, list(params), inputs, targets)
            return self._finish(loss, type(params)(grads), shared, call)
        self.sends = self._agree(
            [params], inputs, targets, {"microbatches": self.m, "schedule": self.schedule}
        )
        self.params = params
        m, p, s = self.m, self.p, self.s
        self.slots = {"gpipe": m, "1f1b": min(p - s, m), "zero_bubble": min(p, m)}[self.schedule]
        loss_like = self.sends[-1]
        self.state = (
            self._empty_stash(),
            jax.tree_util.tree_map(jnp.zeros_like, params),
            jnp.zeros(loss_like.shape, loss_like.dtype),
        )
        {"gpipe": self._gpipe, "1f1b": self._one_f_one_b, "zero_bubble": self._zero_bubble}[
            self.schedule
        ]()
        _, grads, loss = self.state
        loss = loss / m
        if p > 1:
            loss = broadcast(loss, root=p - 1, group=self.comm)
        return self._finish(loss, grads, shared, call)

    def _finish(self, loss: Any, grads: Any, shared: Any, call: int) -> tuple[Any, Any]:
        """The shared parameters' gradients summed, and the gradients marked for a transform."""
        if self.p > 1 and shared is not None:
            grads = sum_shared(grads, shared, self.comm)
        if call >= 0:
            grads = mark_tree(grads, "grad", call)
        return loss, grads

    def _vjp(self, params: Any, i: Any, x: Any) -> tuple[Any, list[Any], Any, list[int | None]]:
        """Microbatch i's forward pass (i may be traced; x: its input, unused on the first
        stage): what the stage sends on (the loss on the last), the leaves of its backward
        function, their tree, and for each leaf the parameter leaf it is (None: a residual)."""
        f = self.stage_fn
        if self.last:
            t = at(self.ts, i)

            def f(p: Any, x: Any) -> Any:
                return self.loss_fn(self.stage_fn(p, x), t)

        if self.first:
            x = at(self.xs, i)
            out, vjp = jax.vjp(lambda p: f(p, x), params)
        else:
            out, vjp = jax.vjp(f, params, x)
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        mine = jax.tree_util.tree_leaves(params)
        where = [next((k for k, q in enumerate(mine) if q is leaf), None) for leaf in leaves]
        return out, leaves, tree, where

    def _empty_stash(self) -> list[Any]:
        """Zeros for K microbatches' residuals (their shapes from a trace of one forward pass
        that is thrown away); for "zero_bubble", also for what the input-gradient half of the
        backward pass hands the weight-gradient half (:meth:`_split_backward`)."""
        shapes: list[Any] = []
        found: list[Any] = []

        def probe(params: Any, x: Any) -> Any:
            out, leaves, tree, where = self._vjp(params, 0, x)
            shapes.extend(jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v))
                          for v, w in zip(leaves, where, strict=True) if w is None)  # fmt: skip
            found.append((tree, where, [jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v))
                                        for v in leaves]))  # fmt: skip
            return out

        like = None if self.first else self.sends[self.s - 1]
        jax.make_jaxpr(probe)(self.params, like)
        self.residuals = len(shapes)
        if self.schedule == "zero_bubble":
            shapes.extend(self._split_backward(*found[0]))
        return [jnp.zeros((self.slots, *v.shape), v.dtype) for v in shapes]

    def _split_backward(self, tree: Any, where: list[int | None], leaves: list[Any]) -> list[Any]:
        """Splits the backward pass into B (the input's gradient) and W (the parameters'),
        sharing the stash; returns the shapes W needs kept from B (module
        ``_backward_split``): the frontier, and the gradient received where W reads it."""
        g_like = jax.ShapeDtypeStruct((), self.sends[-1].dtype) if self.last else self.sends[self.s]
        g_leaves, g_tree = jax.tree_util.tree_flatten(g_like)
        n, n_params = len(leaves), len(jax.tree_util.tree_leaves(self.params))
        n_dx = 0 if self.first else len(jax.tree_util.tree_leaves(self.sends[self.s - 1]))

        def backward(*flat: Any) -> list[Any]:
            g = jax.tree_util.tree_unflatten(g_tree, flat[n:])
            return jax.tree_util.tree_leaves(jax.tree_util.tree_unflatten(tree, flat[:n])(g))

        split = BackwardSplit(backward, [*leaves, *g_leaves], range(n_params, n_params + n_dx))
        self.split, self.g_count = split, len(g_leaves)
        self.w_reads_g = [k - n for k in split.w_inputs if k >= n]
        self.frontier = len(split.frontier_like)
        return [*split.frontier_like, *(g_leaves[k] for k in self.w_reads_g)]

    def _forward(self, i: Any, x: Any) -> Any:
        """Microbatch i's forward pass on this stage: what it sends on. Stashes what the
        backward pass needs."""
        stash, grads, loss = self.state
        out, leaves, self.tree, self.where = self._vjp(self.params, i, x)
        res = [v for v, w in zip(leaves, self.where, strict=True) if w is None]
        slot = i % self.slots
        n = self.residuals
        stash = [*(a.at[slot].set(v) for a, v in zip(stash[:n], res, strict=True)), *stash[n:]]
        if self.last:
            loss = loss + out
        self.state = (stash, grads, loss)
        return out

    def _backward(self, i: Any, g: Any) -> Any:
        """Microbatch i's backward pass (g: the gradient of what the stage sent on; None on the
        last stage, whose loss counts 1/m): the gradient of what it received."""
        stash, grads, loss = self.state
        if self.last:
            g = jnp.asarray(1.0 / self.m, loss.dtype)
        slot = i % self.slots
        back = jax.tree_util.tree_unflatten(self.tree, self._inputs(stash, slot))(g)
        grads = jax.tree_util.tree_map(jnp.add, grads, back[0])
        self.state = (stash, grads, loss)
        return None if self.first else back[1]

    def _inputs(self, stash: list[Any], slot: Any) -> list[Any]:
        """The backward function's leaves: residuals from the stash slot, parameters."""
        res = iter([a[slot] for a in stash[: self.residuals]])
        mine = jax.tree_util.tree_leaves(self.params)
        return [next(res) if w is None else mine[w] for w in self.where]

    def _backward_input(self, i: Any, g: Any) -> Any:
        """The zero-bubble schedule's B: microbatch i's input gradient (as
        :meth:`_backward`'s), keeping what its W (:meth:`_backward_weights`) needs in the
        stash."""
        stash, grads, loss = self.state
        if self.last:
            g = jnp.asarray(1.0 / self.m, loss.dtype)
        slot = i % self.slots
        g_leaves = jax.tree_util.tree_leaves(g)
        dx, frontier = self.split.b(*self._inputs(stash, slot), *g_leaves)
        keep = [*frontier, *(g_leaves[k] for k in self.w_reads_g)]
        n = self.residuals
        stash = [*stash[:n], *(a.at[slot].set(v) for a, v in zip(stash[n:], keep, strict=True))]
        self.state = (stash, grads, loss)
        if self.first:
            return None
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(self.sends[self.s - 1]), dx
        )

    def _backward_weights(self, i: Any) -> None:
        """The zero-bubble schedule's W: microbatch i's parameter gradients, added to the others."""
        stash, grads, loss = self.state
        slot = i % self.slots
        # After this stage's sends so far: XLA would otherwise run W's products before the
        # send of the gradient the previous stage waits for (benchmarks/pipeline.py).
        kept = after(*(a[slot] for a in stash[self.residuals :]))
        g_leaves: list[Any] = [None] * self.g_count
        for k, v in zip(self.w_reads_g, kept[self.frontier :], strict=True):
            g_leaves[k] = v
        dp = self.split.w([*self._inputs(stash, slot), *g_leaves], kept[: self.frontier])
        back = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(grads), dp)
        self.state = (stash, jax.tree_util.tree_map(jnp.add, grads, back), loss)

    def _loop(self, body: Callable[[Any, Any], Any], x: Any, n: int, reverse: bool = False) -> Any:
        """``x = body(x, j)`` for j in range(n) as one lax.scan, carrying the state too."""
        if n == 0:
            return x

        def step(carry: Any, j: Any) -> tuple[Any, None]:
            x, self.state = carry
            return (body(x, j), self.state), None

        (x, self.state), _ = jax.lax.scan(step, (x, self.state), jnp.arange(n), reverse=reverse)
        return x

    # The messages between neighbours. "fwd i": microbatch i's activation; "bwd i": its gradient.

    # ``i``, ``j``: a microbatch's number, or how the trace's note names it inside a loop.

    def _recv_forward(self, i: Any) -> Any:
        if self.first:
            return None
        return recv(self.sends[self.s - 1], self.s - 1, group=self.comm, note=f"fwd {i}")

    def _send_forward(self, y: Any, i: Any) -> None:
        if not self.last:
            send(y, self.s + 1, group=self.comm, note=f"fwd {i}")

    def _recv_backward(self, i: Any) -> Any:
        if self.last:
            return None
        return recv(self.sends[self.s], self.s + 1, group=self.comm, note=f"bwd {i}")

    def _send_backward(self, gx: Any, i: Any) -> None:
        if not self.first:
            send(gx, self.s - 1, group=self.comm, note=f"bwd {i}")

    def _send_forward_recv_backward(self, y: Any, i: Any, j: Any) -> Any:
        """Send microbatch i's activation on and receive microbatch j's gradient, at once."""
        if self.last:
            return None
        nb = self.s + 1
        return sendrecv(y, nb, nb, group=self.comm, note=f"fwd {i}, bwd {j}")

    def _send_backward_recv_forward(self, gx: Any, j: Any, i: Any) -> Any:
        """Send microbatch j's gradient back and receive microbatch i's activation, at once."""
        if self.first:
            return None
        nb = self.s - 1
        return sendrecv(gx, nb, nb, group=self.comm, note=f"bwd {j}, fwd {i}")

    def _gpipe(self) -> None:
        def forward(x: Any, i: Any) -> None:
            self._send_forward(self._forward(i, self._recv_forward("i")), "i")

        def backward(x: Any, i: Any) -> None:
            self._send_backward(self._backward(i, self._recv_backward("i")), "i")

        self._loop(forward, None, self.m)
        self._loop(backward, None, self.m, reverse=True)

    def _one_f_one_b(self) -> None:
        m = self.m
        warm = min(self.p - self.s - 1, m)
        for i in range(warm):
            self._send_forward(self._forward(i, self._recv_forward(i)), i)
        if warm == m:
            x = None
        else:
            # Steady: forward i = warm + j, backward j. Past the first stage the last such pair
            # is written out, as it sends its gradient back without waiting for another
            # activation; the first stage sends no gradient back, so all its pairs are alike.
            steady = m - warm
            x = self._recv_forward(warm)

            def pair(x: Any, j: Any) -> Any:
                y = self._forward(warm + j, x)
                g = self._send_forward_recv_backward(y, f"{warm}+j", "j")
                return self._send_backward_recv_forward(self._backward(j, g), "j", f"{warm + 1}+j")

            x = self._loop(pair, x, steady if self.first else steady - 1)
            if not self.first:
                j = steady - 1
                g = self._send_forward_recv_backward(self._forward(m - 1, x), m - 1, j)
                self._send_backward(self._backward(j, g), j)
        for j in range(m - warm, m):  # cool-down
            self._send_backward(self._backward(j, self._recv_backward(j)), j)

    def _zero_bubble(self) -> None:
        """ZB-H1 (module doc). Where a forward pass is followed by a backward pass, the
        activation goes down and the gradient comes back in one ``sendrecv``, as in 1F1B; the
        gradient then goes up with a plain send, and W runs before the next activation is
        received. A send does not wait for its receiver on CPU; where one does (a rendezvous),
        this order still cannot deadlock: a stage's sendrecv with the next stage never waits for
        that stage's send to return."""
        m, p, s = self.m, self.p, self.s
        warm, defer = min(p - s - 1, m), s

        def forward(i: Any, note: Any) -> None:
            self._send_forward(self._forward(i, self._recv_forward(note)), note)

        def backward(j: Any, note: Any, g: Any = None) -> None:
            g = self._recv_backward(note) if g is None and not self.last else g
            self._send_backward(self._backward_input(j, g), note)

        def forward_backward(i: Any, j: Any, fnote: Any, bnote: Any) -> None:
            y = self._forward(i, self._recv_forward(fnote))
            backward(j, bnote, self._send_forward_recv_backward(y, fnote, bnote))

        for i in range(warm):
            forward(i, i)
        steady = m - warm
        head = min(defer, steady)  # rounds before the first W
        for k in range(head):
            forward_backward(warm + k, k, warm + k, k)

        def rnd(x: Any, j: Any) -> Any:
            k = head + j
            forward_backward(warm + k, k, f"{warm + head}+j", f"{head}+j")
            self._backward_weights(k - defer)
            return x

        self._loop(rnd, None, steady - head)
        waiting = list(range(steady - head, steady))
        for j in range(steady, m):  # cool-down: a W after each B, the rest at the end
            backward(j, j)
            waiting.append(j)
            while len(waiting) > defer:
                self._backward_weights(waiting.pop(0))
        for j in waiting:
            self._backward_weights(j)
