"""Ranks, groups and a collective: the smallest spmd program.

spmd-run -n 2 python examples/hello.py
"""

import spmd

comm = spmd.init()
print(f"rank {comm.rank} of {comm.size} on node {comm.node_id!r} (local rank {comm.local_rank})")

# Every rank contributes its rank + 1; every rank receives all contributions.
values = comm.allgather_object(comm.rank + 1)
if comm.rank == 0:
    print(f"allgather of rank + 1 over {comm.size} ranks: {values}, sum {sum(values)}")

# A mesh names groups: here "dp" spans all ranks, as in data-parallel training.
mesh = spmd.Mesh(dp=comm.size)
dp = mesh.group("dp")
total = sum(dp.allgather_object(comm.rank + 1))
assert total == comm.size * (comm.size + 1) // 2
if comm.rank == 0:
    print(f"{mesh}: dp groups {mesh.rank_lists('dp')}, sum over dp = {total}")

spmd.finalize()
