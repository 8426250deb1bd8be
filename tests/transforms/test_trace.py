"""spmd.trace and Program (the op list, its printing, running it, passes) and spmd.grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.testing import multirank
from spmd.transforms import reduce_gradients

from ._model import global_batches, init_params, loss_fn, make_step, optimizers


def _batch(world=1):
    return tuple(jnp.asarray(a) for a in global_batches(1, world)[0])


def test_grad_outside_transforms_is_jax_grad():
    params, batch = init_params(), _batch()
    for ours, theirs in (
        (spmd.grad(loss_fn)(params, batch), jax.grad(loss_fn)(params, batch)),
        (spmd.value_and_grad(loss_fn)(params, batch), jax.value_and_grad(loss_fn)(params, batch)),
        (spmd.grad(loss_fn, argnums=(0,))(params, batch),
         jax.grad(loss_fn, argnums=(0,))(params, batch)),
    ):  # fmt: skip
        for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs),
                        strict=True):  # fmt: skip
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    aux_fn = lambda p, b: (loss_fn(p, b), {"n": b[0].shape[0]})  # noqa: E731
    g, aux = spmd.grad(aux_fn, has_aux=True)(params, batch)
    assert aux == {"n": 8}
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(params)
    # And inside jit, no marks: the jaxpr is jax's.
    assert "spmd_mark" not in str(jax.make_jaxpr(spmd.grad(loss_fn))(params, batch))


def test_keyword_arguments_are_named_by_their_values():
    """Keyword arguments flatten in key order, whatever the call order: each name must label
    its own value."""

    def f(x, *, b, a):
        return jnp.sum(a) + 2 * jnp.sum(b)

    text = str(spmd.trace(f)(jnp.ones(3), b=jnp.ones(2), a=jnp.ones(5)))
    assert "%a: Tensor[(5,), float32]" in text and "%b: Tensor[(2,), float32]" in text, text


def test_trace_prints_a_readable_op_list_and_runs():
    def f(x, c):
        return jnp.tanh(x @ c) + 1.0

    x, c = jnp.ones((2, 3)), jnp.full((3, 2), 0.5)
    program = spmd.trace(f)(x, c)
    text = str(program)
    assert text.splitlines()[0] == (
        "def @f(%x: Tensor[(2, 3), float32], %c: Tensor[(3, 2), float32]) {"
    )
    assert "let %x_1 = dot_general(%x, %c) /* " in text
    assert "ty=Tensor[(2, 2), float32] */;" in text
    assert "let %x_3 = add(%x_2, 1.0)" in text
    assert [op.name for op in program.ops] == ["dot_general", "tanh", "add"]
    assert program.ops[0].inputs == ("%x", "%c") and program.ops[2].outputs == ("%x_3",)
    np.testing.assert_allclose(program(x, c), f(x, c))
    with pytest.raises(spmd.SpmdError, match="traced for arguments of structure"):
        program(x, c, x)
    # other shapes or dtypes: refused (jit would run with the traced sizes baked in)
    mean = spmd.trace(lambda v: v.mean())(jnp.arange(3.0))
    with pytest.raises(spmd.SpmdError, match=r"%v was traced as Tensor\[\(3,\), float32\]; "
                       r"called with Tensor\[\(5,\), float32\]"):  # fmt: skip
        mean(jnp.arange(5.0))
    with pytest.raises(spmd.SpmdError, match=r"called with Tensor\[\(3,\), int32\]"):
        mean(jnp.arange(3))
    assert float(mean(jnp.arange(3.0) + 1)) == 2.0


def test_printed_names_are_unique_and_keys_print():
    text = str(spmd.trace(lambda x_1, x_2: x_1 * x_2 + 1)(jnp.ones(2), jnp.ones(2)))
    assert "let %x_3 = mul(%x_1, %x_2)" in text and "let %x_4 = add(%x_3, 1.0)" in text, text
    text = str(spmd.trace(lambda d: d["a.b"] - d["a b"])({"a.b": jnp.ones(2), "a b": jnp.ones(1)}))
    assert "(%d.a.b: Tensor[(1,), float32], %d.a.b#2: Tensor[(2,), float32])" in text, text
    key = jax.random.key(0)
    program = spmd.trace(lambda k, x: x + jax.random.normal(k, x.shape))(key, jnp.ones(3))
    assert "%k: Tensor[(), key<fry>]" in str(program)
    np.testing.assert_allclose(
        program(key, jnp.ones(3)), 1 + jax.random.normal(key, (3,)), rtol=1e-6
    )
    s = spmd.shard(jnp.ones(4), spmd.PartitionSpec("dp"))
    assert "%s.local: Tensor[(4,), float32]" in str(spmd.trace(lambda s: s.gather())(s))


def test_trace_names_inputs_by_pytree_path_and_shows_gradient_marks():
    params, batch = init_params(), _batch()
    program = spmd.trace(spmd.value_and_grad(loss_fn))(params, batch)
    text = str(program)
    assert "%params.w1: Tensor[(6, 12), float32]" in text
    assert "%batch.1: Tensor[(8,), int" in text
    marks = [op for op in program.ops if op.name == "spmd.mark"]
    assert [m.params["kind"] for m in marks] == ["param", "grad"]
    assert marks[1].params["paths"] == ("['b1']", "['w1']", "['w2']")
    value, grads = program(params, batch)
    want_value, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grads["w1"], want_grads["w1"], rtol=1e-5, atol=1e-7)


@multirank(nprocs=(2,))
def test_collectives_inside_a_jitted_helper_are_printed(comm):
    @jax.jit
    def helper(x):
        return spmd.allreduce(x * 2)

    program = spmd.trace(lambda x: helper(x) + 1)(jnp.ones(3))
    lines = str(program).splitlines()
    assert lines[1].startswith("  let %x_3 = jit(%x) /* name=helper") and lines[1].endswith("{")
    assert lines[2].startswith("    let %x_1 = mul(%x, 2.0)")
    assert lines[3].startswith("    let %x_2 = spmd.allreduce(%x_1) /* op=sum, group=[0, 1]")
    assert lines[4:6] == ["    %x_2", "  };"]
    assert lines[6].startswith("  let %x_4 = add(%x_3, 1.0)")
    assert [op.name for op in program.ops] == ["jit", "add"]  # the top-level ops
    np.testing.assert_array_equal(program(jnp.ones(3)), np.full(3, 5.0))


def _allreduces(program):
    return [i for i, op in enumerate(program.ops) if op.name == "spmd.allreduce"]


@multirank(nprocs=(2,))
def test_trace_of_a_step_shows_the_inserted_allreduces(comm):
    tx = optimizers()["adam"]
    params = init_params()
    opt_state = tx.init(params)
    batch = spmd.data.shard_batch(global_batches(1, comm.size)[0])
    names = lambda p: [op.name for op in p.ops]  # noqa: E731

    per_leaf = spmd.trace(make_step(tx, bucket_mb=0))(params, opt_state, batch)
    ar = _allreduces(per_leaf)
    assert len(ar) == 3  # one per gradient leaf
    assert all(len(per_leaf.ops[i].inputs) == 1 for i in ar)
    # Each sits between backward ops: the backward matmul for w1 comes after w2's allreduce.
    last_matmul = max(i for i, n in enumerate(names(per_leaf)) if n == "dot_general")
    assert ar[0] < last_matmul < ar[-1]
    assert "spmd.mark" not in names(per_leaf)
    assert "op=sum, group=[0, 1]" in str(per_leaf)

    bucketed = spmd.trace(make_step(tx))(params, opt_state, batch)
    ar = _allreduces(bucketed)
    assert len(ar) == 1 and len(bucketed.ops[ar[0]].inputs) == 3  # one fused bucket

    after = spmd.trace(make_step(tx, bucket_mb=0, overlap=False))(params, opt_state, batch)
    ar = _allreduces(after)
    assert len(ar) == 3
    assert ar[0] > max(i for i, n in enumerate(names(after)) if n == "dot_general")

    accumulated = spmd.trace(make_step(tx, accumulate_steps=2))(params, opt_state, batch)
    assert "scan" in names(accumulated)
    assert names(accumulated).index("scan") < _allreduces(accumulated)[0]

    compressed = spmd.trace(make_step(tx, compression="bf16"))(params, opt_state, batch)
    (i,) = _allreduces(compressed)  # the rounding is the call's (casts or native: when lowered)
    line = str(compressed).splitlines()[i + 1]
    assert "op=avg" in line and "compression='bf16'" in line, line
    assert "bfloat16" not in str(compressed)


@multirank(nprocs=(2,))
def test_reduce_gradients_is_a_pass_over_programs(comm):
    """The pass on its own: trace a gradient function, rewrite it, run the Program."""
    params = init_params()
    batch = spmd.data.shard_batch(global_batches(1, comm.size)[0])
    program = spmd.trace(spmd.grad(loss_fn))(params, batch)
    averaged = reduce_gradients(bucket_mb=0)(program)
    assert len(_allreduces(averaged)) == 3 and not _allreduces(program)
    got = averaged(params, batch)
    mine = jax.grad(loss_fn)(params, batch)
    everyone = comm.allgather_object(jax.tree_util.tree_map(np.asarray, mine))
    for k in params:
        np.testing.assert_allclose(
            got[k], np.mean([g[k] for g in everyone], 0), rtol=1e-5, atol=1e-7
        )


def _architecture_example() -> dict:
    """The pass and step of docs/architecture.md, "Writing a pass", as the page shows them."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    code = text.split("## Writing a pass", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/architecture.md", "exec"), namespace)
    return namespace


@multirank(nprocs=(2,))
def test_the_documented_pass_composes_with_reduce_gradients(comm):
    """docs/architecture.md's example: a pass that halves the gradients, chained before the
    data-parallel pass in a Step of its own, gives half the averaged gradients."""
    example = _architecture_example()
    params = init_params()
    batch = spmd.data.shard_batch(global_batches(1, comm.size)[0])

    def step(params, batch):
        return spmd.grad(loss_fn)(params, batch)

    halved = example["HalfGradients"](step)
    program = spmd.trace(halved)(params, batch)
    assert len(_allreduces(program)) == 1 and "mul" in str(program)
    got = halved(params, batch)
    everyone = comm.allgather_object(jax.tree_util.tree_map(np.asarray, step(params, batch)))
    for k in params:
        want = 0.5 * np.mean([g[k] for g in everyone], 0)
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7)
