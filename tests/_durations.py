"""The tables of tests/DURATIONS.md, from pytest's JUnit XML reports.

    python -m pytest --junitxml=after.xml
    python tests/_durations.py after.xml [before.xml]

Prints, as Markdown, the time per file (with the earlier report's beside it, where given) and
the 30 slowest tests. A test's time is pytest's: the wall-clock time of its setup, call and
teardown, in whichever worker ran it (three run at a time: their sum is about three times the
run's).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def _times(path: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for case in ET.parse(path).iter("testcase"):
        test = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        out[test] = float(case.get("time", 0))
    return out


def _per_file(times: dict[str, float]) -> dict[str, tuple[float, int]]:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for test, t in times.items():
        f = files[test.split("::", 1)[0]]
        f[0] += t
        f[1] += 1
    return {k: (v[0], int(v[1])) for k, v in files.items()}


def main(after: str, before: str | None = None) -> None:
    now = _per_file(_times(after))
    then = _per_file(_times(before)) if before else {}
    head = "| file | tests | s |" if not then else "| file | tests | s before | s after |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in sorted(set(now) | set(then), key=lambda k: -now.get(k, (0.0, 0))[0]):
        t, n = now.get(name, (0.0, 0))
        if then:
            b, _ = then.get(name, (0.0, 0))
            print(f"| {name} | {n} | {b:.1f} | {t:.1f} |")
        else:
            print(f"| {name} | {n} | {t:.1f} |")
    total = sum(t for t, _ in now.values())
    count = sum(n for _, n in now.values())
    if then:
        print(f"| all | {count} | {sum(t for t, _ in then.values()):.1f} | {total:.1f} |")
    else:
        print(f"| all | {count} | {total:.1f} |")
    print()
    print("| s | test |")
    print("|---|---|")
    for test, t in sorted(_times(after).items(), key=lambda kv: -kv[1])[:30]:
        print(f"| {t:.1f} | {test} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
