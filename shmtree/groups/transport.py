"""Transport: the group's shared memory, laid out per tree edge.

One anonymous memory file (memfd) per group holds everything.  It has no name in /dev/shm, so
nothing can outlive the group: the kernel frees it when the last process that maps it or holds its
descriptor is gone, whatever way that process ends (SIGKILL of the whole job included).  Forked
workers inherit the mapping; spawn and forkserver workers receive the descriptor through
multiprocessing's descriptor passing and map it again (after checking the header: magic, version,
size, per-group random nonce).

Layout (offsets in bytes; every ring starts on a page of its own so that it can be placed on the
NUMA node of the process that uses it most):

    0                       header: magic, version, nranks, size, nonce, plan digest | abort
                            word | rank claims
    4096                    rank blocks, 1024 bytes each: bell + sleepers | join record, calls
                            completed, member state, call in progress | call descriptors (two,
                            by call parity) | abort note
    then, per channel and per rank r:
        up ring of edge r -> parent(r)      (absent at the root)   head | tail | S slots
        down ring of r's results            (absent at a leaf)     head | tail per child | S slots
    then, per rank r (a group of several):
        r's outbox for the exchange         (read by any rank)     S slots, no counters
    then the survive region (groups/survive.py) control line | per rank: words, two proposals

A slot is a 64-byte slot header (call seq, descriptor digest, chunk index, flags) followed by the
chunk payload.  Channel 0 is the latency channel (small slots, a flat tree): every call starts with
one round on it that carries the call descriptor, and messages that fit its payload travel inline
in that same round.  Channel 1 is the bandwidth channel (large chunks, a chain or the topology
tree) for the rest.  The memory used is O(P x slots x chunk), independent of the message size.
"""
from __future__ import annotations

import errno
import fcntl
import os
import resource
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..errors import ShmtreeError
from ..machine.topology import _cgroup_dirs, _proc_cgroups

# the layout constants are the engine's (one definition: _csrc/layout.h, exported by _engine)
from .._engine import (HEADER_BYTES as HDR_BYTES, LINE_BYTES as LINE, PAGE_BYTES as PAGE,
                      RANK_BLOCK_BYTES as RANK_BLOCK, SLOT_HDR_BYTES as SLOT_HDR)


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def ring_header_bytes(ntails: int) -> int:
    """Head line + one tail line per consumer, rounded to a page (slots start page-aligned)."""
    return round_up(LINE * (1 + ntails), PAGE)


def survive_geometry(nranks: int) -> tuple:
    """(bytes per rank, bytes per proposal) of the survive region (groups/survive.py): after its
    control line, per rank a line of words and two proposals (by agree's epoch parity: tag,
    value and a bitmask of the failed ranks)."""
    prop = round_up(16 + (nranks + 7) // 8, LINE)
    return LINE + 2 * prop, prop


@dataclass(frozen=True)
class ChannelPlan:
    """One channel: a tree and the geometry of its rings."""

    tree: object          # shmtree.machine.schedule.Tree
    nslots: int
    payload: int          # chunk payload bytes per slot
    ring: bool = False    # True: the ring schedule around tree.ring (one ring per rank, to its
                          # successor) instead of the tree's up and down rings

    @property
    def stride(self) -> int:
        return round_up(SLOT_HDR + self.payload, LINE)

    def ring_bytes(self, ntails: int) -> int:
        return ring_header_bytes(ntails) + round_up(self.nslots * self.stride, PAGE)


class Layout:
    """Offsets of every ring in the group's segment (pure arithmetic, the same in every process)."""

    def __init__(self, nranks: int, channels: list[ChannelPlan]):
        self.nranks = nranks
        self.channels = channels
        off = HDR_BYTES + round_up(nranks * RANK_BLOCK, PAGE)
        self.up: list[list[int]] = []
        self.down: list[list[int]] = []
        for plan in channels:
            up, down = [-1] * nranks, [-1] * nranks
            for r in range(nranks):
                if plan.ring:
                    if nranks > 1:
                        up[r] = off
                        off += plan.ring_bytes(1)
                    continue
                if plan.tree.parent[r] >= 0:
                    up[r] = off
                    off += plan.ring_bytes(1)
                nchild = len(plan.tree.children[r])
                if nchild:
                    down[r] = off
                    off += plan.ring_bytes(nchild)
            self.up.append(up)
            self.down.append(down)
        # the exchange's outboxes (engine/alg_exchange.pxi): one per rank, read by any rank,
        # slots of the bandwidth channel's geometry, no counters (each slot has its own words)
        self.outbox: list[int] = [-1] * nranks
        self.box_plan = channels[min(1, len(channels) - 1)]
        if nranks > 1:
            for r in range(nranks):
                self.outbox[r] = off
                off += self.outbox_bytes
        # the survive region (groups/survive.py: agree, shrink, a Pool worker's task), last
        self.survive = off
        off += round_up(LINE + nranks * survive_geometry(nranks)[0], PAGE)
        self.total = off

    @property
    def outbox_bytes(self) -> int:
        return round_up(self.box_plan.nslots * self.box_plan.stride, PAGE)

    def exchange_spec(self):
        """What every rank's engine needs of the exchange: (every rank's outbox offset, nslots,
        stride, payload); None in a group of one."""
        if self.nranks == 1:
            return None
        plan = self.box_plan
        return (tuple(self.outbox), plan.nslots, plan.stride, plan.payload)

    def engine_spec(self, ch: int, rank: int) -> "ChannelSpec":
        """What rank needs to run channel ch: its neighbours and the offsets of their rings."""
        plan = self.channels[ch]
        if plan.ring:
            return self._ring_spec(plan, ch, rank)
        tree = plan.tree
        parent = tree.parent[rank]
        children = tuple(tree.children[rank])
        return ChannelSpec(
            parent=parent,
            index=tree.children[parent].index(rank) if parent >= 0 else 0,
            parent_nchild=len(tree.children[parent]) if parent >= 0 else 0,
            children=children,
            up=self.up[ch][rank],
            down=self.down[ch][rank],
            child_up=tuple(self.up[ch][c] for c in children),
            parent_down=self.down[ch][parent] if parent >= 0 else -1,
            nslots=plan.nslots, stride=plan.stride, payload=plan.payload)

    def _ring_spec(self, plan: ChannelPlan, ch: int, rank: int) -> "ChannelSpec":
        """The ring order: rank sends to its successor in tree.ring and receives from its
        predecessor.  In the engine's terms the successor is the 'parent' that consumes this
        rank's ring buffer, and the predecessor the single 'child' whose buffer it consumes."""
        order = list(plan.tree.ring)
        pos = order.index(rank)
        n = len(order)
        succ, pred = order[(pos + 1) % n], order[(pos - 1) % n]
        alone = n == 1
        return ChannelSpec(
            ring=True, ring_pos=pos,
            parent=-1 if alone else succ,
            index=0,
            parent_nchild=0 if alone else 1,
            children=() if alone else (pred,),
            up=self.up[ch][rank],
            down=-1,
            child_up=() if alone else (self.up[ch][pred],),
            parent_down=-1,
            nslots=plan.nslots, stride=plan.stride, payload=plan.payload)

    def produced_rings(self, rank: int):
        """(offset, length, consumers) of each ring rank produces: it first-touches them at join,
        after pinning, so that their pages land where the NUMA policy says."""
        for ch, plan in enumerate(self.channels):
            spec = self.engine_spec(ch, rank)       # its parent consumes its up ring (ring: the
            if spec.up >= 0:                        # successor), its children its result ring
                yield spec.up, plan.ring_bytes(1), [spec.parent]
            if spec.down >= 0:
                yield spec.down, plan.ring_bytes(len(spec.children)), list(spec.children)
        if self.outbox[rank] >= 0:                  # (read by every other rank)
            yield (self.outbox[rank], self.outbox_bytes,
                   [r for r in range(self.nranks) if r != rank])


@dataclass(frozen=True)
class ChannelSpec:
    """What one rank's engine needs of one channel (Layout.engine_spec): its neighbours and the
    segment offsets of the rings it uses (-1: none).  parent / children are the tree's, or under
    the ring order the successor / the predecessor; index is this rank's tail in the parent's
    result ring; nslots, stride and payload the ring geometry."""

    parent: int
    index: int
    parent_nchild: int
    children: tuple
    up: int                   # the ring this rank produces towards its parent
    down: int                 # this rank's result ring, read by its children
    child_up: tuple           # the children's up rings, consumed here
    parent_down: int          # the parent's result ring, read here
    nslots: int
    stride: int
    payload: int
    ring: bool = False        # the ring order (one ring per rank, to its successor)
    ring_pos: int = 0         # this rank's position in the ring order


MEMORY_ROOT = "/"         # where available_memory reads /proc and /sys (tests: a fake tree)

NO_LIMIT = (1 << 64) - 1  # (a limit that is not set, in the tables of comm.zeros: shared.py)

# what binds the memory a process can still get (memory_room's kind; codes that travel in
# comm.zeros's table, so that every rank names the same limit)
ROOM_MEMAVAILABLE, ROOM_CGROUP_V2, ROOM_CGROUP_V1 = 1, 2, 3
ROOM_NAMES = {
    ROOM_MEMAVAILABLE: "MemAvailable (/proc/meminfo)",
    ROOM_CGROUP_V2: "memory cgroup limit (cgroup v2 memory.max less memory.current)",
    ROOM_CGROUP_V1: "memory cgroup limit (cgroup v1 memory.limit_in_bytes less "
                    "memory.usage_in_bytes)",
}

# what ftruncate (or a first write) of a memory file answers when a limit refuses the size
MEMORY_ERRNOS = (errno.EFBIG, errno.ENOSPC, errno.ENOMEM)


def memory_room(root=None):
    """(bytes, kind): the bytes a new anonymous shared mapping can still get, and which limit
    binds (ROOM_*): the smaller of MemAvailable (/proc/meminfo) and what the memory cgroup of
    this process, and every cgroup above it that is visible, still allows (cgroup v2:
    memory.max - memory.current; v1: memory.limit_in_bytes - memory.usage_in_bytes; the
    inactive file cache a cgroup would reclaim counts as free).  root: where /proc and /sys are
    read (MEMORY_ROOT)."""
    root = MEMORY_ROOT if root is None else root
    free, kind = _mem_available(root), ROOM_MEMAVAILABLE
    for d, limit_name, usage_name, cache_name in _memory_cgroups(root):
        try:
            with open(os.path.join(d, limit_name)) as f:
                limit = f.read().strip()
            with open(os.path.join(d, usage_name)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit():           # ("max": no limit here)
            continue
        usage -= min(usage, _stat_field(os.path.join(d, "memory.stat"), cache_name))
        room = max(0, int(limit) - usage)
        if room < free:
            free = room
            kind = ROOM_CGROUP_V2 if limit_name == "memory.max" else ROOM_CGROUP_V1
    return free, kind


def available_memory(root=None) -> int:
    """Bytes a new anonymous shared mapping can still get (memory_room's, without the kind)."""
    return memory_room(root)[0]


def file_size_limit() -> int:
    """This process's file-size limit (RLIMIT_FSIZE's soft limit, `ulimit -f`), which every
    memory file it sizes is held to (NO_LIMIT when none).  Past it, ftruncate raises SIGXFSZ
    (which kills a process that has not ignored it, as Python does) and fails with EFBIG: a
    size is checked against it before any file is sized."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return NO_LIMIT if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def address_space_room() -> int:
    """Bytes this process can still map (RLIMIT_AS's soft limit, `ulimit -v`, less its address
    space in use now; NO_LIMIT when no limit is set)."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY or soft < 0:
        return NO_LIMIT
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0
    return max(0, int(soft) - used)


class SharedMemoryError(ShmtreeError, MemoryError):
    """A group's shared memory is refused by a limit (create_memfd): a ShmtreeError, as every
    error of making a group, and a MemoryError, as every refusal of memory."""


def _mem_available(root) -> int:
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return psutil.virtual_memory().available


def _stat_field(path, name) -> int:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _memory_cgroups(root):
    """(directory, limit file, usage file, reclaimable cache field) of this process's memory
    cgroup and of each one above it, v2 (also under unified/ of a hybrid mount) and v1, as far
    as they are mounted where they are expected (in a container the mount's root is often the
    container's own cgroup): the cgroup walk of topology.cpu_quota's, for the memory
    controller."""
    paths = _proc_cgroups("memory", os.path.join(root, "proc/self/cgroup"))
    out = []
    for base, key, names in (
            ("sys/fs/cgroup", "v2", ("memory.max", "memory.current", "inactive_file")),
            ("sys/fs/cgroup/unified", "v2", ("memory.max", "memory.current", "inactive_file")),
            ("sys/fs/cgroup/memory", "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                "total_inactive_file"))):
        for d in _cgroup_dirs(Path(root, base), paths.get(key, "/")):
            out.append((str(d),) + names)
    return out


def create_memfd(total: int) -> int:
    """A sealed-size anonymous memory file of `total` bytes, after checking that the limits let
    this process have it (the memory there is, its file-size limit, its address space): a
    shortfall is a SharedMemoryError now, not a SIGBUS, a SIGXFSZ or an OOM kill later."""
    mib = f"{total / 2**20:.1f} MiB ({total} bytes)"
    fix = "use fewer ranks, fewer slots or a smaller chunk_bytes"
    free, kind = memory_room()
    if total > free:
        raise SharedMemoryError(
            f"shmtree: the group needs {total / 2**20:.1f} MiB of shared memory but only "
            f"{free / 2**20:.1f} MiB is free (bound by this process's {ROOM_NAMES[kind]}); {fix}")
    limit = file_size_limit()
    if total > limit:                   # (before ftruncate: past the limit it raises SIGXFSZ)
        raise SharedMemoryError(
            f"shmtree: the group needs {mib} of shared memory, more than this process's "
            f"file-size limit (RLIMIT_FSIZE, ulimit -f) of {limit} bytes; raise the limit "
            f"(ulimit -f unlimited) or {fix}")
    room = address_space_room()
    if total > room:
        raise SharedMemoryError(
            f"shmtree: the group needs {mib} of shared memory, more than this process's "
            f"address-space limit (RLIMIT_AS, ulimit -v) leaves it ({room} bytes); raise the "
            f"limit or {fix}")
    fd = os.memfd_create(f"shmtree-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        try:
            os.ftruncate(fd, total)
        except OSError as exc:
            if exc.errno not in MEMORY_ERRNOS:
                raise
            raise SharedMemoryError(
                f"shmtree: the group needs {mib} of shared memory, which the kernel refused "
                f"({errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}); {fix}") \
                from None
        # nobody may resize it afterwards (a shrink would turn accesses into SIGBUS)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def new_nonce() -> bytes:
    return secrets.token_bytes(16)
