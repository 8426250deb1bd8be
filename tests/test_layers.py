"""The package's structure: layers call only down, no import cycle, no private name imported
across packages (JAX's internals only through spmd._jax_compat), no module over 600 lines, and
docs/architecture.md names only paths that exist.

Imports are read from the source (every ``import`` statement, also those inside functions; those
under ``if TYPE_CHECKING:`` are types only and left out), so a lazy import counts as much as one
at the top of a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src" / "spmd"

# From the bottom up (docs/architecture.md, "The layers"): errors and compat, runtime, mesh,
# ops, sharded, transforms/checkpoint/data, the model-parallel layers, launch, the tools, cli. A
# module may import modules of its own layer or of layers below it.
LAYERS = [
    ("spmd._errors", "spmd._version"),
    ("spmd._native_lib", "spmd._jax_compat"),
    ("spmd.runtime",),
    ("spmd.mesh",),
    ("spmd.ops",),
    ("spmd.sharded",),
    ("spmd.transforms", "spmd.checkpoint", "spmd.data", "spmd.elastic", "spmd.random"),
    ("spmd.model_parallel", "spmd.parallel"),
    ("spmd.launch",),
    ("spmd.testing", "spmd.notebook", "spmd.bench", "spmd.perf"),
    ("spmd.cli", "spmd.info", "spmd"),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str) -> list[tuple[str, str, int]]:
    """(module imported, name imported from it or "", line) for every import of ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    skip = _type_checking_lines(tree)
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:  # `from . import _gpu`: the submodule itself
                    out.append((sub, "", node.lineno))
                else:
                    out.append((base, a.name, node.lineno))
    return out


def _internal(target: str) -> str | None:
    """The spmd module an import refers to (the longest known prefix), or None."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _, _ in _imports(name):
            found = _internal(target)
            if found is not None and found != name and target.startswith("spmd"):
                edges[name].add(found)
    return edges


def _layer(name: str) -> int:
    best = (-1, -1)
    for i, group in enumerate(LAYERS):
        for prefix in group:
            # The package itself ("spmd") is its __init__ only: no catch-all for its modules.
            inside = prefix != "spmd" and name.startswith(prefix + ".")
            if (name == prefix or inside) and len(prefix) > best[1]:
                best = (i, len(prefix))
    assert best[0] >= 0, f"{name} is in no layer of LAYERS: place it"
    return best[0]


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_a_module_outside_every_layer_is_not_placed():
    """The package's own name places its __init__ only, so a new top-level module must be
    given a layer: the check above can fail."""
    assert _layer("spmd") == len(LAYERS) - 1
    for name in ("spmd.new_module", "spmd.newpkg.mod"):
        try:
            _layer(name)
        except AssertionError as e:
            assert f"{name} is in no layer" in str(e)
        else:
            raise AssertionError(f"{name} was placed")


def test_layers_call_only_down():
    wrong = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, targets in _edges().items()
        for b in targets
        if _layer(b) > _layer(a)
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def _private_parts(module: str) -> list[str]:
    """The packages of ``module`` whose private member it goes through: for
    ``spmd.runtime._gpu``, ``spmd.runtime``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts)) if parts[i].startswith("_")]


def test_no_private_name_is_imported_across_packages():
    """A module may use private modules and names of its own package and of the packages above
    it (spmd._errors, spmd._native_lib and spmd._jax_compat are the root's, shared by all),
    never those of a sibling package; and only spmd._jax_compat may import jax._src."""
    wrong = []
    for name in MODULES:
        own = name if _is_package(name) else name.rpartition(".")[0]
        for target, member, line in _imports(name):
            where = f"{MODULES[name].relative_to(ROOT)}:{line}"
            if target.startswith("jax._src") and name != "spmd._jax_compat":
                wrong.append(f"{where} imports {target} (use spmd._jax_compat)")
            if not target.startswith("spmd"):
                continue
            owners = _private_parts(target)
            if member.startswith("_") and not member.startswith("__"):
                owners.append(target)
            for owner in owners:
                if not (own == owner or own.startswith(owner + ".")):
                    what = f"{target}.{member}" if member else target
                    wrong.append(f"{where} imports {what}, private to {owner}")
    assert not wrong, "\n".join(wrong)


def test_no_module_over_600_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in SRC.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert not long, long


def test_the_architecture_page_names_real_paths():
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:src|native|docs|tests|benchmarks|examples)/[\w./-]+)`", text))
    assert len(paths) > 20, paths  # the page maps the tree
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing


def test_cpu_and_gpu_handlers_share_one_call_layer():
    """Both handler files decode their calls and build their errors with the shared header,
    and neither defines the pieces it holds again."""
    shared = (ROOT / "native" / "include" / "spmd" / "call.h").read_text()
    assert "class CallBase" in shared or "struct CallBase" in shared
    for handlers in ("native/cpu/handlers.cc", "native/cuda/handlers.cc"):
        text = (ROOT / handlers).read_text()
        assert '#include "spmd/call.h"' in text, handlers
        for copied in ("DtypeName(", "ElemBytes("):
            assert f"{copied}ffi::DataType" not in text.replace(" ", ""), (handlers, copied)


def test_spmd_parallel_keeps_the_names_it_had_before_the_split():
    """``spmd.parallel`` was one package of transforms and layers; its names stay importable
    there, the very objects of ``spmd.transforms`` and ``spmd.model_parallel``."""
    import spmd
    import spmd.model_parallel
    import spmd.parallel
    import spmd.transforms

    assert set(spmd.parallel.__all__) == {*spmd.transforms.__all__, "pipeline_value_and_grad"}
    for name in spmd.transforms.__all__:
        assert getattr(spmd.parallel, name) is getattr(spmd.transforms, name), name
    assert spmd.parallel.pipeline_value_and_grad is spmd.model_parallel.pipeline.value_and_grad
    for name in ("tensor_parallel", "moe", "pipeline", "context_parallel"):
        assert (
            getattr(spmd.parallel, name)
            is getattr(spmd, name)
            is getattr(spmd.model_parallel, name)
        )
    assert "Step" in spmd.transforms.__all__ and "value_and_grad" in spmd.transforms.__all__


def test_spmd_elastic_is_the_module_beside_the_checkpoints():
    code = (
        "import spmd.elastic, spmd.checkpoint.elastic as e, spmd\n"
        "from spmd import elastic\n"
        "assert spmd.elastic is e is elastic, (spmd.elastic, e, elastic)\n"
        "assert e.resume.__module__ == 'spmd.checkpoint.elastic'\n"
    )
    _in_a_fresh_process(code)


def test_a_public_name_is_resolved_once_and_then_kept_in_the_package():
    """``spmd.<name>`` imports its module when first used and keeps the object in ``spmd``'s
    namespace: later reads do not go through the package's ``__getattr__`` again (4 us a read,
    which every eager ``spmd.allreduce(...)`` paid)."""
    code = (
        "import spmd, spmd.ops\n"
        "assert 'allreduce' not in vars(spmd)\n"
        "first = spmd.allreduce\n"
        "assert vars(spmd)['allreduce'] is first is spmd.ops.allreduce\n"
        "tp = spmd.tensor_parallel\n"
        "assert vars(spmd)['tensor_parallel'] is tp is spmd.model_parallel.tensor_parallel\n"
        "assert sorted(n for n in spmd.__all__ if not hasattr(spmd, n)) == []\n"
    )
    _in_a_fresh_process(code)


def _in_a_fresh_process(code: str) -> None:
    """Runs ``code`` in a new Python (whose imports start from nothing); fails with its error."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
