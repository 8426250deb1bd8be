"""The docs name only what exists: every repository path a page or the README cites is a file or
directory of the repository, and every ``spmd.`` name resolves to an attribute of the package
(paths with a placeholder, ``results/gpu-<device>.md``, and the op list's op names excepted)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "README.md"]
OP_NAMES = {"spmd.mark"}  # how the op list prints spmd.grad's marks: an op, not an attribute

_PATH = re.compile(
    r"(?<![\w/.-])((?:docs|tests|examples|src|benchmarks|native|tutorials)/[\w./-]*\w)(?![\w-]*<)"
)
_NAME = re.compile(r"(?<![\w.])(spmd(?:\.[A-Za-z_]\w*)+)")


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:  # a submodule not imported by its package
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ImportError:
            return False
    return True


@pytest.mark.parametrize("page", PAGES)
def test_every_path_and_name_a_page_cites_is_real(page):
    text = (ROOT / page).read_text()
    paths = sorted(set(_PATH.findall(text)))
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == [], f"{page} cites paths that do not exist: {missing}"
    names = sorted(set(_NAME.findall(text)))
    # ``spmd.py`` and the like are file names in prose, not attributes.
    names = [n for n in names if not n.endswith((".md", ".py")) and n not in OP_NAMES]
    unknown = [n for n in names if not _resolve(n)]
    assert unknown == [], f"{page} cites names spmd does not have: {unknown}"
    assert paths or names, f"{page} cites nothing: the patterns are wrong"
