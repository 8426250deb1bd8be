"""Test hosts: H hosts on one Linux machine (network namespaces with addresses, hostnames and
``/dev/shm`` of their own, joined by a bridge), for multi-node code over real TCP. Root only.

``spmd-run --hosts H`` runs a job on them; from Python::

    from spmd.testing.hosts import TestHosts, unavailable

    if not unavailable():
        with TestHosts(2, link="rate 10gbit") as hosts:
            ...  # hosts.names == ["h0", "h1"], hosts.addresses, hosts.set_link("h1", up=False)

The layout and what it takes: :mod:`spmd.launch._hosts`.
"""

from ..launch import TestHosts as TestHosts
from ..launch import test_hosts_unavailable as unavailable

__all__ = ["TestHosts", "unavailable"]
