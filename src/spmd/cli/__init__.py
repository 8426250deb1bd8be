"""Command-line tools, thin shells over the packages that do the work: ``spmd-run``
(:mod:`spmd.launch`), ``spmd-bench`` (:mod:`spmd.bench`) and ``python -m spmd.info``."""
