"""The interleaved 1F1B schedule (Megatron-LM's virtual pipeline stages) of
``spmd.pipeline_value_and_grad(..., schedule="interleaved", virtual_stages=v)``.

The model is cut into ``v * p`` chunks; rank r of the p-rank group holds chunks ``j * p + r``
for j < v (``stage_params[j]``), so an activation goes round the ring of ranks v times. Each
rank runs the forward passes of its chunks in Megatron-LM's order: microbatches in groups of p,
and within a group chunk 0 of every microbatch, then chunk 1, ...; the backward passes in the
same order with the chunks reversed. Rank r first runs ``2 (p - r - 1) + (v - 1) p`` forward
passes (all of them if there are fewer), then alternates one forward and one backward pass,
then runs the backward passes left. In theory this leaves ``(p - 1) / (v m + p - 1)`` of the
step idle: 1F1B's bubble divided by about v, for more messages (v times as many) and more
activations kept (the warm-up's forward passes, up to about ``v p + p`` on the first rank).

The program is written out (no loop: its size grows with v * m). Messages between two ranks
arrive in the order they were sent; where a rank needs them in another order (with p = 2,
activations and gradients share each direction), it receives the earlier ones first and keeps
them until they are needed. :func:`warm_up` runs every rank's order against the others' (each
send at once, each receive waiting for its message): where m is not a multiple of p, Megatron's
warm-up can leave a rank waiting for ever, and every rank then runs the fewest more forward
passes before its first backward pass for the orders to complete (tested for p = 1..8,
v = 1..4, m = 1..16).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..ops import broadcast, recv, send
from ._stages import at

Op = tuple[str, int, int]  # ("F" or "B", chunk on this rank j, microbatch i)
Key = tuple[str, int, int]  # ("fwd" or "bwd", the chunk that sent it, microbatch i)


def order(p: int, v: int, m: int, r: int, extra: int = 0) -> list[Op]:
    """Rank r's forward ("F") and backward ("B") passes, in order (module doc), with ``extra``
    more forward passes before the first backward pass."""
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    fwd = [(j, i) for grp in groups for j in range(v) for i in grp]
    bwd = [(j, i) for grp in groups for j in reversed(range(v)) for i in grp]
    total = m * v
    warm = min(total, 2 * (p - r - 1) + (v - 1) * p + extra)
    out: list[Op] = [("F", *fwd[k]) for k in range(warm)]
    for k in range(total - warm):
        out += [("F", *fwd[warm + k]), ("B", *bwd[k])]
    return out + [("B", *bwd[k]) for k in range(total - warm, total)]


def _needs(op: Op, p: int, v: int, r: int) -> tuple[Key | None, int, Key | None, int]:
    """What a pass receives (and from which rank) and what it sends (and to which rank)."""
    kind, j, i = op
    c, last = j * p + r, v * p - 1
    if kind == "F":
        got = ("fwd", c - 1, i) if c > 0 else None
        out = ("fwd", c, i) if c < last else None
        return got, (c - 1) % p, out, (c + 1) % p
    got = ("bwd", c + 1, i) if c < last else None
    out = ("bwd", c, i) if c > 0 else None
    return got, (c + 1) % p, out, (c - 1) % p


def warm_up(p: int, v: int, m: int) -> int:
    """The fewest forward passes to add to every rank's warm-up for the orders to complete
    (0 where m is a multiple of p; a last group of fewer than p microbatches may need more)."""
    extra = 0
    while not _completes(p, v, m, extra):
        extra += 1
    return extra


def _completes(p: int, v: int, m: int, extra: int) -> bool:
    """Every rank's order run against the others': sends at once, receives wait for their
    message. False if some rank would wait for ever."""
    orders = [order(p, v, m, r, extra) for r in range(p)]
    sent: set[Key] = set()
    at = [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < len(orders[r]):
                got, _, out, _ = _needs(orders[r][at[r]], p, v, r)
                if got is not None and got not in sent:
                    break
                if out is not None:
                    sent.add(out)
                at[r] += 1
                moved = True
    return all(at[r] == len(orders[r]) for r in range(p))


def channels(p: int, v: int, m: int, extra: int) -> dict[tuple[int, int], list[Key]]:
    """Per (sender, receiver) of different ranks: the messages in the order they are sent."""
    out: dict[tuple[int, int], list[Key]] = {}
    for r in range(p):
        for op in order(p, v, m, r, extra):
            _, _, key, dst = _needs(op, p, v, r)
            if key is not None and dst != r:
                out.setdefault((r, dst), []).append(key)
    return out


def run(pipe: Any, params: list[Any], inputs: Any, targets: Any) -> tuple[Any, list[Any]]:
    """This rank's loss (the same on every rank) and the gradients of its v chunks; ``pipe`` is
    the pipeline's ``_Run`` (its stage and loss functions, group, microbatches)."""
    comm, m, p, r = pipe.comm, pipe.m, pipe.p, pipe.s
    v = len(params)
    extra = warm_up(p, v, m)
    last = v * p - 1
    settings = {"microbatches": m, "schedule": "interleaved", "virtual_stages": v}
    sends = pipe._agree(params, inputs, targets, settings)  # per chunk (the loss, the last)
    xs, ts = pipe.xs, pipe.ts
    chans = channels(p, v, m, extra)
    incoming = {src: iter(keys) for (src, dst), keys in chans.items() if dst == r}
    inbox: dict[Key, Any] = {}

    def like(key: Key) -> Any:
        kind, c, _ = key
        return sends[c] if kind == "fwd" else sends[c - 1]

    def fetch(key: Key, src: int) -> Any:
        while key not in inbox:  # the channel's messages up to this one, in their order
            k = next(incoming[src])
            inbox[k] = recv(like(k), src, group=comm, note=f"{k[0]} c{k[1]} {k[2]}")
        return inbox.pop(key)

    def post(key: Key, dst: int, value: Any) -> None:
        if dst == r:  # one rank: its chunks hand their values on in place
            inbox[key] = value
        else:
            send(value, dst, group=comm, note=f"{key[0]} c{key[1]} {key[2]}")

    grads = [jax.tree_util.tree_map(jnp.zeros_like, q) for q in params]
    loss = jnp.zeros(sends[last].shape, sends[last].dtype)
    backs: dict[tuple[int, int], Any] = {}
    for op in order(p, v, m, r, extra):
        kind, j, i = op
        c = j * p + r
        got, src, out, dst = _needs(op, p, v, r)
        if kind == "F":
            x = fetch(got, src) if got is not None else None
            f = pipe.stage_fn
            if c == last:
                t = at(ts, i)

                def f(q: Any, h: Any, t: Any = t) -> Any:
                    return pipe.loss_fn(pipe.stage_fn(q, h), t)

            if c == 0:
                x0 = at(xs, i)
                y, back = jax.vjp(lambda q, f=f, x0=x0: f(q, x0), params[j])
            else:
                y, back = jax.vjp(f, params[j], x)
            backs[j, i] = back
            if c == last:
                loss = loss + y
            else:
                post(out, dst, y)  # type: ignore[arg-type]
        else:
            g = fetch(got, src) if got is not None else jnp.asarray(1.0 / m, loss.dtype)
            back = backs.pop((j, i))(g)
            grads[j] = jax.tree_util.tree_map(jnp.add, grads[j], back[0])
            if c > 0:
                post(out, dst, back[1])  # type: ignore[arg-type]
    loss = loss / m
    if p > 1:
        loss = broadcast(loss, root=p - 1, group=comm)  # chunk v p - 1 is on rank p - 1
    return loss, grads
