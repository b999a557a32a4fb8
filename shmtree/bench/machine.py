"""What machine the numbers come from: the facts every results file records.

Read from Linux's own files (``/proc/cpuinfo``, ``/sys/devices/system/node``, the cache entries
under ``/sys/devices/system/cpu``) so that it works before, and independently of, shmtree's
``Topology``; when shmtree imports, its ``Topology.describe()`` is recorded too.  Also here: the
NUMA nodes with their CPUs (the ``numa`` command pins to them) and the last-level cache size
(``--fresh`` rotates through more memory than that).
"""
import datetime
import glob
import os
import platform
import re
import socket
import sys

import numpy as np

from .units import parse_size

SYS_NODE = "/sys/devices/system/node"
SYS_CPU = "/sys/devices/system/cpu"


def parse_cpulist(text):
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def numa_nodes():
    """{node: [usable CPUs]} for every NUMA node (CPU-less nodes map to []); {0: all} if none."""
    usable = os.sched_getaffinity(0)
    nodes = {}
    for path in glob.glob(os.path.join(SYS_NODE, "node[0-9]*")):
        node = int(re.search(r"(\d+)$", path).group(1))
        nodes[node] = sorted(set(parse_cpulist(_read(os.path.join(path, "cpulist")))) & usable)
    return dict(sorted(nodes.items())) or {0: sorted(usable)}


def cpu_model():
    for line in _read("/proc/cpuinfo").splitlines():
        if line.lower().startswith(("model name", "cpu model", "processor\t: ")):
            value = line.split(":", 1)[1].strip()
            if value and not value.isdigit():
                return value
    return platform.processor() or platform.machine()


def last_level_cache():
    """(bytes, number of CPUs sharing it) of CPU 0's last-level cache; (32 MiB, 1) if unknown."""
    best = (0, 0, 1)
    for index in glob.glob(os.path.join(SYS_CPU, "cpu0", "cache", "index[0-9]*")):
        if _read(os.path.join(index, "type")) == "Instruction":
            continue
        level = int(_read(os.path.join(index, "level"), "0") or 0)
        size = parse_size(_read(os.path.join(index, "size"), "0").upper() or "0")
        sharing = len(parse_cpulist(_read(os.path.join(index, "shared_cpu_list"), "0")))
        best = max(best, (level, size, sharing))
    return (best[1], best[2]) if best[1] else (32 << 20, 1)


def rotation_bytes(nprocs):
    """How much memory each rank rotates through with --fresh: twice its share of an LLC."""
    llc, sharing = last_level_cache()
    ncpus = max(1, os.cpu_count() or 1)
    ranks_per_llc = max(1, -(-nprocs * sharing // ncpus))
    return max(2 * llc // ranks_per_llc, 1 << 20)


def shmtree_version():
    """shmtree.__version__, read from shmtree/_version.py itself: importing the package would
    load its compiled extensions, and the version must be known even when they are broken."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "_version.py")
    try:
        with open(path) as f:
            found = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", f.read(), re.MULTILINE)
        if found:
            return found.group(1)
        from shmtree._version import __version__
        return __version__
    except Exception as exc:  # the bench must describe the machine even when shmtree is broken
        return f"unknown ({type(exc).__name__}: {exc})"


def topology_description(spec=None):
    """shmtree's Topology.describe() for spec (None: the detected machine), or why not."""
    try:
        import shmtree
        return shmtree.Topology.resolve(spec).describe()
    except Exception as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"


def describe(topology=None):
    """The machine facts recorded at the top of every JSON results file."""
    llc, sharing = last_level_cache()
    nodes = numa_nodes()
    return {
        "host": socket.gethostname(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "ncpus": os.cpu_count(),
        "usable_cpus": sorted(os.sched_getaffinity(0)),
        "numa_nodes": {str(n): cpus for n, cpus in nodes.items()},
        "llc_bytes": llc,
        "llc_shared_by_cpus": sharing,
        "topology": topology_description(topology),
        "shmtree_version": shmtree_version(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
    }
