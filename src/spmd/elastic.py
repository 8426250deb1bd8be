"""``spmd.elastic``: elastic restart's script side, :mod:`spmd.checkpoint.elastic` (beside the
checkpoints it resumes from) under its public name; ``import spmd.elastic`` gives that module."""

import sys

from .checkpoint import elastic as _elastic

sys.modules[__name__] = _elastic
