"""spmd.perf: a cost model of spmd's collectives and a step-time simulator.

The collectives' model (:func:`collective_cost`, :class:`Links`) gives each algorithm spmd runs
(shared memory on one node; across nodes the hierarchical one or one MPI call over the group) as
alpha-beta terms of three link classes: spmd's shared memory, MPI inside a node, MPI between
nodes (whose link the node's ranks share). :func:`fit` finds the parameters from measured calls
(:func:`read_bench` reads ``spmd-bench --json`` reports), :func:`compare` sets predictions
beside measurements. :func:`step_time` predicts a training step of a :class:`Transformer` in a
:class:`Layout` (data parallel, ZeRO 1-3, tensor and pipeline parallel) on a :class:`Cluster`,
and :func:`best` searches the layouts. :func:`plan` ranks the layouts of a language model
(:class:`Model`; context parallelism and the pipeline's schedule included) by the step time a
:class:`Machine` fitted to measured steps predicts (docs/planner.md). docs/scaling.md shows
what the simulator predicts, with its assumptions, and how it compares with measurements.

Pure Python and NumPy (SciPy, which JAX brings, for :meth:`Machine.fit`): importing it starts
nothing, and it runs without MPI or JAX.

Example: a 64 MiB allreduce on 2 nodes of 8 ranks, shared memory at 1 us and 20 GB/s per rank,
MPI inside the node at 2 us and 10 GB/s, 100 Gbit/s links with 10 us per message::

    >>> from spmd.perf import Links, gbit
    >>> links = Links(1e-6, 1 / 20e9, 2e-6, 1 / 10e9, 10e-6, gbit(100))
    >>> round(links.time("allreduce", 64 << 20, 2, 8, "hier") * 1e3, 2)
    11.28
    >>> links.best("allreduce", 64 << 20, 2, 8)[0]  # than one MPI call over the 16 ranks
    'hier'
"""

from ._collectives import ALGORITHMS as ALGORITHMS
from ._collectives import OPS as OPS
from ._collectives import PARAMS as PARAMS
from ._collectives import Cost as Cost
from ._collectives import Links as Links
from ._collectives import collective_cost as collective_cost
from ._collectives import gbit as gbit
from ._fit import Measurement as Measurement
from ._fit import compare as compare
from ._fit import fit as fit
from ._fit import read_bench as read_bench
from ._plan import TERMS as TERMS
from ._plan import Machine as Machine
from ._plan import Model as Model
from ._plan import Prediction as Prediction
from ._plan import candidates as candidates
from ._plan import counts as counts
from ._plan import plan as plan
from ._plan import predict as predict
from ._simulate import Cluster as Cluster
from ._simulate import Layout as Layout
from ._simulate import StepTime as StepTime
from ._simulate import Transformer as Transformer
from ._simulate import best as best
from ._simulate import group_shape as group_shape
from ._simulate import layouts as layouts
from ._simulate import step_time as step_time
