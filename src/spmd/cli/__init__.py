"""Command-line tools: ``spmd-run`` (launcher) and ``python -m spmd.info`` (environment report)."""
