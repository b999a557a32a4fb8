"""The ``numa`` report: what memory placement costs on this machine, and what shmtree makes of it.

Part 1, the node x node copy-bandwidth matrix.  For every pair (i, j) of NUMA nodes that have
usable CPUs: the parent maps an anonymous shared buffer without touching it; a process pinned to
node i's CPUs writes it first (first touch puts its pages on node i; ``/proc/self/numa_maps``
shows where they went); then a process pinned to node j's CPUs, with a local buffer it touched
itself, times ``np.copyto(local, remote)`` (read: remote memory -> this core) and
``np.copyto(remote, local)`` (write).  One process per cell: this is what one rank sees, not what
a whole socket can pull through the link.  Pages can move later (automatic NUMA balancing), which
is why the placement is read back after the timing.

Part 2, shmtree's knobs, each a separate ``shmtree.run`` at the same sizes.  First the two paths
side by side, with the options given: ``arrays=private`` (numpy arrays of each rank: the copy
path, through the rings) and ``arrays=shared`` (``comm.empty`` arrays, in place: the single-copy
path, each rank reading its part of the result from every rank's array and writing it into every
rank's; the arrays are first-touched by their owner after pinning, so each part crosses a socket
link once; up to ``small_bytes`` shared arrays travel inline like private ones).
Then the knobs of the copy path: where ring pages live (``numa`` = consumer / producer /
interleave), pinned vs unpinned ranks, and the topology-aware tree vs the rank-order chain.  On a
one-node machine the matrix is 1x1 and the placement policies cannot differ in where pages land;
the report says so instead of pretending otherwise.
"""
import ctypes
import mmap
import re

import numpy as np

from . import harness, sweep
from .machine import numa_nodes
from .measure import measure
from .units import count_for

VARIANTS = (
    ("arrays", "private"), ("arrays", "shared"),         # the copy path, the single-copy path
    ("numa", "consumer"), ("numa", "producer"), ("numa", "interleave"),
    ("pin", True), ("pin", False),
    ("tree", "topology"), ("tree", "chain"),
)


class Solo:
    """The sync of a one-process measurement."""

    def barrier(self):
        pass

    def max(self, value):
        return value


def pages_by_node(address):
    """{node: pages} of the mapping that starts at `address`, from /proc/self/numa_maps."""
    with open("/proc/self/numa_maps") as f:
        for line in f:
            start, _, rest = line.partition(" ")
            if int(start, 16) == address:
                return {int(n): int(p) for n, p in re.findall(r"\bN(\d+)=(\d+)", rest)}
    return {}


def _address(array):
    return ctypes.c_void_p(array.ctypes.data).value


def _touch(peer, buf, cpus):
    harness.pin_to(cpus)
    remote = np.frombuffer(buf, dtype=np.uint8)
    remote[:] = 1
    return pages_by_node(_address(remote))


def _access(peer, buf, cpus, plan):
    harness.pin_to(cpus)
    remote = np.frombuffer(buf, dtype=np.uint8)
    local = np.ones_like(remote)  # first-touched here, on node j

    read = measure(lambda i: np.copyto(local, remote), Solo(), plan.iters, plan.target_s)
    write = measure(lambda i: np.copyto(remote, local), Solo(), plan.iters, plan.target_s)
    return read, write, pages_by_node(_address(remote))


def cell(size, home_cpus, user_cpus, plan):
    """One matrix cell: (read GB/s, write GB/s, {node: pages} of the buffer)."""
    buf = mmap.mmap(-1, size)
    try:
        harness.launch(_touch, 1, (buf, home_cpus), pin=False)
        read, write, pages = harness.launch(_access, 1, (buf, user_cpus, plan), pin=False)[0]
    finally:
        buf.close()
    return size / read["median_s"] / 1e9, size / write["median_s"] / 1e9, pages


def matrix(size, plan, progress=None):
    """The node x node matrix over the NUMA nodes that have usable CPUs."""
    nodes = {n: cpus for n, cpus in numa_nodes().items() if cpus}
    ids = sorted(nodes)
    read = [[None] * len(ids) for _ in ids]
    write = [[None] * len(ids) for _ in ids]
    pages = [[None] * len(ids) for _ in ids]
    for a, i in enumerate(ids):
        for b, j in enumerate(ids):
            if progress:
                progress.step(size, f"memory on node {i}, process on node {j}")
            read[a][b], write[a][b], placed = cell(size, nodes[i], nodes[j], plan)
            pages[a][b] = {str(n): p for n, p in placed.items()}
    return {"nodes": ids, "cpus": {str(n): nodes[n] for n in ids}, "size": size,
            "read_gbs": read, "write_gbs": write, "pages_by_node": pages,
            "cpuless_nodes": sorted(n for n, c in numa_nodes().items() if not c)}


def variant_rows(sizes, nprocs, plan, base_options, progress=None):
    """Rows {group, variant, size, time_us, busbw_gbs | error} for each knob of VARIANTS (the
    "arrays" group: the given options, on private or on shared arrays)."""
    rows = []
    for key, value in VARIANTS:
        options = dict(base_options) if key == "arrays" else dict(base_options, **{key: value})
        if progress:
            progress.step(sizes[-1], f"{key}={value}")
        try:
            if (key, value) == ("arrays", "shared"):
                measured = {size: {"allreduce": summary} for size, summary in
                            sweep.run_shared(sizes, nprocs, plan, options).items()}
            else:
                measured = sweep.run_sweep(sizes, nprocs, plan, options, with_copy=False)
        except Exception as exc:  # one knob failing must not hide the others
            rows += [{"group": key, "variant": value, "size": _nbytes(s, plan.dtype),
                      "error": f"{type(exc).__name__}: {exc}"} for s in sizes]
            continue
        for size in sizes:
            r = sweep.row(size, plan.dtype, nprocs, measured[size]["allreduce"])
            rows.append({"group": key, "variant": value, **r})
    return rows


def _nbytes(size, dtype):
    return count_for(size, dtype) * np.dtype(dtype).itemsize


def one_node_note(mat):
    """The plain statement a one-node machine deserves, or None."""
    if len(mat["nodes"]) > 1:
        return None
    node = mat["nodes"][0]
    return (f"This machine has one NUMA node (node {node}, CPUs {mat['cpus'][str(node)]}): the "
            "matrix is 1x1, and the numa placement policies (consumer, producer, interleave) "
            "all put ring pages on that node, so their differences below are noise.")
