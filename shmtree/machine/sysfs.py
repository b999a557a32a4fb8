"""What Linux says about this machine's CPUs: sysfs (CPUs, NUMA nodes, cores, L3 caches) and
the cgroup CPU quota, read into plain data for `shmtree.machine.topology` (which builds its
`Topology` model from it) and `shmtree.groups.transport` (the memory cgroups, through the same cgroup walk).

- `parse_cpulist` reads a kernel cpulist ("0-3,8").
- `_detect_slots(root, allowed)` reads sysfs under `root` (a fake tree in tests) into one
  record per CPU, `(cpu, socket, numa, l3, core, smt)` in the field order of
  `shmtree.machine.topology.Slot`, with `core` and `l3` numbered densely; missing files degrade (see
  `Topology.detect`).
- `cpu_quota()` is the CPU time the process's cgroups allow, in CPUs (`_proc_cgroups` and
  `_cgroup_dirs` are the walk over /proc/self/cgroup and the hierarchy).

Every file that is missing or malformed reads as "not known" (None), never as an error: a
container or an unusual kernel must not stop a group from starting.  This module imports only
the standard library (psutil, lazily, when sysfs has no CPUs at all).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["parse_cpulist", "cpu_quota"]

CpuRecord = Tuple[int, int, int, int, int, int]   # (cpu, socket, numa, l3, core, smt)


# --------------------------------------------------------------------------- cpulists


def parse_cpulist(text: str) -> List[int]:
    """Parse a kernel cpulist such as "0-3,8,10-11" (empty text is an empty list).

    Raises ValueError on malformed text.
    """
    cpus: List[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"malformed cpulist {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"malformed cpulist {text!r}")
        cpus.extend(range(first, last + 1))
    return sorted(set(cpus))


def _format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids as a compact cpulist ("0-3,8")."""
    runs: List[List[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


# --------------------------------------------------------------------------- sysfs reading


def _read_text(path: Path) -> Optional[str]:
    """A sysfs file's stripped text, or None when it is missing or unreadable."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> Optional[int]:
    """A sysfs file holding one integer, or None when missing or malformed."""
    text = _read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _read_cpulist(path: Path) -> Optional[List[int]]:
    """A sysfs cpulist file, or None when missing or malformed."""
    text = _read_text(path)
    try:
        return parse_cpulist(text) if text is not None else None
    except ValueError:
        return None


def _sysfs_cpus(cpu_dir: Path) -> List[int]:
    """Online CPU ids under /sys/devices/system/cpu (all cpuN dirs when "online" is missing)."""
    present = []
    for entry in cpu_dir.glob("cpu[0-9]*"):
        if entry.name[3:].isdigit():
            present.append(int(entry.name[3:]))
    online = _read_cpulist(cpu_dir / "online")
    if online is not None:
        keep = set(online)
        present = [c for c in present if c in keep]
    return sorted(present)


def _node_map(root: Path, cpu_dir: Path, cpus: Sequence[int]) -> Dict[int, int]:
    """cpu -> NUMA node, from node*/cpulist, else from cpuN/nodeM links; missing -> node 0."""
    nodes: Dict[int, int] = {}
    for entry in (root / "devices/system/node").glob("node[0-9]*"):
        if entry.name[4:].isdigit():
            for c in _read_cpulist(entry / "cpulist") or ():
                nodes[c] = int(entry.name[4:])
    for c in cpus:
        if c not in nodes:
            links = [p.name for p in (cpu_dir / f"cpu{c}").glob("node[0-9]*")]
            ids = [int(n[4:]) for n in links if n[4:].isdigit()]
            nodes[c] = min(ids) if ids else 0
    return nodes


def _l3_cpus(cpu_dir: Path, cpu: int) -> Optional[Tuple[int, ...]]:
    """The CPUs sharing `cpu`'s level-3 cache, or None when sysfs has no L3 for it."""
    for index in sorted((cpu_dir / f"cpu{cpu}/cache").glob("index[0-9]*")):
        if _read_int(index / "level") != 3:
            continue
        if _read_text(index / "type") == "Instruction":
            continue
        shared = _read_cpulist(index / "shared_cpu_list")
        if shared:
            return tuple(sorted(set(shared) | {cpu}))
    return None


def _cpu_slot_keys(cpu_dir: Path, cpu: int, numa: int) -> Tuple[int, Any, int, Any]:
    """(socket, core key, smt position, l3 key) for one CPU, degrading on missing files."""
    topo = cpu_dir / f"cpu{cpu}/topology"
    socket = _read_int(topo / "physical_package_id")
    socket = socket if socket is not None and socket >= 0 else 0
    siblings = _read_cpulist(topo / "thread_siblings_list") or _read_cpulist(
        topo / "core_cpus_list"
    )
    if siblings:
        siblings = sorted(set(siblings) | {cpu})
        core_key: Any = ("siblings", socket, siblings[0])
        smt = siblings.index(cpu)
    else:
        core_id = _read_int(topo / "core_id")
        core_key = ("core_id", socket, core_id if core_id is not None else -1 - cpu)
        smt = cpu  # ordered by cpu id within the core; renumbered by Topology
    l3 = _l3_cpus(cpu_dir, cpu)
    l3_key: Any = ("l3", l3) if l3 is not None else ("node", socket, numa)
    return socket, core_key, smt, l3_key


def _dense(keys: Sequence[Any]) -> List[int]:
    """Map hashable keys to 0.. in order of first appearance."""
    ids: Dict[Any, int] = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def _detect_slots(root: Path, allowed: Optional[set]) -> List[CpuRecord]:
    """Read sysfs under `root` into one (cpu, socket, numa, l3, core, smt) record per CPU
    (CPUs restricted to `allowed` when given)."""
    cpu_dir = root / "devices/system/cpu"
    cpus = _sysfs_cpus(cpu_dir) if cpu_dir.is_dir() else []
    if not cpus:
        return _fallback_slots(allowed)
    if allowed is not None:
        cpus = [c for c in cpus if c in allowed]
    nodes = _node_map(root, cpu_dir, cpus)
    keys = [_cpu_slot_keys(cpu_dir, c, nodes[c]) for c in cpus]
    cores = _dense([k[1] for k in keys])
    l3s = _dense([k[3] for k in keys])
    return [
        (c, k[0], nodes[c], l3, core, k[2])
        for c, k, l3, core in zip(cpus, keys, l3s, cores)
    ]


def _fallback_slots(allowed: Optional[set]) -> List[CpuRecord]:
    """No readable sysfs: one socket, one node, one core per allowed CPU (psutil for the count)."""
    if allowed is None:
        try:
            import psutil

            count = psutil.cpu_count(logical=True)
        except ImportError:  # pragma: no cover - psutil is a dependency
            count = None
        allowed = set(range(count or os.cpu_count() or 1))
    return [(c, 0, 0, 0, i, 0) for i, c in enumerate(sorted(allowed))]


def _is_live_sysfs(root: Path) -> bool:
    """True when `root` is this machine's /sys (so the process affinity applies to it)."""
    try:
        return os.path.realpath(root) == os.path.realpath("/sys")
    except OSError:  # pragma: no cover
        return False


# --------------------------------------------------------------------------- cgroup CPU quota


def _proc_cgroups(controller: str = "cpu",
                  proc_cgroup: "str | os.PathLike[str]" = "/proc/self/cgroup") -> Dict[str, str]:
    """This process's cgroup paths from /proc/self/cgroup: "v2" (the unified hierarchy) and
    `controller` (the v1 hierarchy holding that controller: "cpu", "memory"), where present.
    (transport.available_memory reads the memory cgroups through this and _cgroup_dirs.)"""
    text = _read_text(Path(proc_cgroup)) or ""
    paths: Dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths["v2"] = path
        elif controller in controllers.split(","):
            paths[controller] = path
    return paths


def _cgroup_dirs(mount: Path, path: str) -> List[Path]:
    """The cgroup directory of `path` under a hierarchy's mount and its ancestors up to the
    mount (a limit set on any of them applies).  Inside a container the mount is the container's
    own cgroup while the path may name it as the host sees it: the mount alone then."""
    parts = [p for p in path.strip("/").split("/") if p]
    here = mount.joinpath(*parts) if parts else mount
    if not here.is_dir():
        return [mount]
    dirs = [here]
    while here != mount and here.parent != here:
        here = here.parent
        dirs.append(here)
    return dirs


def _v2_limit(d: Path) -> Optional[float]:
    text = _read_text(d / "cpu.max")            # "QUOTA PERIOD" in us, or "max PERIOD"
    if not text:
        return None
    fields = text.split()
    try:
        if fields[0] == "max":
            return None
        quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100000
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(d: Path) -> Optional[float]:
    quota, period = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
    if quota is None or period is None or quota <= 0 or period <= 0:      # -1: no limit
        return None
    return quota / period


def cpu_quota(sysfs_root: "str | os.PathLike[str]" = "/sys",
              cgroup: Optional[str] = None) -> Optional[float]:
    """The CPU time this process's cgroup may use, in CPUs (quota / period: 2.0 in a container
    limited to two CPUs, whatever the host's core count), the tightest limit of its cgroup and
    their ancestors under cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us` /
    `cpu.cfs_period_us`); None when no limit is set or none can be read.

    `sysfs_root` is where sysfs is (a fake tree in tests: tests/fixtures_sysfs); `cgroup` the
    process's cgroup path within each hierarchy (None: from /proc/self/cgroup for the live
    /sys, the hierarchy's root for any other tree)."""
    root = Path(sysfs_root) / "fs" / "cgroup"
    if cgroup is not None:
        paths = {"v2": cgroup, "cpu": cgroup}
    elif _is_live_sysfs(Path(sysfs_root)):
        paths = _proc_cgroups()
    else:
        paths = {"v2": "/", "cpu": "/"}
    limits = []
    if (root / "cgroup.controllers").exists():                       # v2 mounted here
        limits += [_v2_limit(d) for d in _cgroup_dirs(root, paths.get("v2", "/"))]
    elif (root / "unified" / "cgroup.controllers").exists():         # hybrid: v2 beside v1
        limits += [_v2_limit(d) for d in _cgroup_dirs(root / "unified", paths.get("v2", "/"))]
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):               # v1
        mount = root / name
        if (mount / "cpu.cfs_quota_us").exists():
            limits += [_v1_limit(d) for d in _cgroup_dirs(mount, paths.get("cpu", "/"))]
            break
    limits = [q for q in limits if q is not None]
    return min(limits) if limits else None
