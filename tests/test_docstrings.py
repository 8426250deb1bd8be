"""Every public op and transform has a runnable example in its docstring, and the examples run
(in a world of one, in this process) and print what they say."""

from __future__ import annotations

import doctest

import pytest

import spmd

DOCUMENTED = [
    *(getattr(spmd.ops, name) for name in spmd.ops.__all__),
    spmd.init,
    spmd.Mesh,
    spmd.grad,
    spmd.value_and_grad,
    spmd.trace,
    spmd.data_parallel,
    spmd.zero_shard,
    spmd.broadcast_params,
    spmd.no_sync,
    spmd.transforms.reduce_gradients,
    spmd.transforms.shard_state,
    spmd.transforms.chain,
    spmd.transforms.add_accumulated,
    spmd.transforms.return_local,
    spmd.perf,
    *(getattr(spmd.tensor_parallel, name) for name in (
        "column_linear", "row_linear", "copy_to", "vocab_embed", "vocab_cross_entropy",
        "shard_params", "split_qkv",
    )),
    spmd.moe.route,
    spmd.moe.moe,
    spmd.pipeline.split,
    spmd.pipeline.stage_layers,
    spmd.pipeline.value_and_grad,
    spmd.tensor_parallel.linen,
    spmd.moe.linen,
    spmd.context_parallel,
]  # fmt: skip


def _name(obj):
    return getattr(obj, "__qualname__", obj.__name__)


@pytest.mark.parametrize("obj", DOCUMENTED, ids=_name)
def test_docstring_example_runs(obj):
    tests = doctest.DocTestFinder(recurse=False).find(obj, _name(obj), globs={})
    examples = [e for t in tests for e in t.examples]
    assert examples, f"{_name(obj)} has no example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
