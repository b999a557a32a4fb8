"""The planner: every "auto" rule of a group in one place, as pure data.

`plan_group(size, **options)` turns a group's options and the machine (its topology and the number
of usable cores) into a frozen `Plan`: the latency tree (channel 0), the bandwidth tree and its
schedule (channel 1: the pipelined tree, or the ring schedule around the tree's depth-first order),
the ring geometry (chunk bytes, slots), the inline limit, the waiting policy, pinning and NUMA
placement.  `Group` runs exactly the plan it is given, the bench prints it (`Plan.describe`), and a
spawned member receives it with the pickled group instead of planning again in a process whose CPU
affinity may differ.  `Plan.digest` is stored in the group's segment header; `join` refuses a plan
that is not the creator's.

The usable cores are the CPUs of this process's affinity mask, no more than its cgroup's CPU
quota allows (`usable_count`).

The rules (measured on a 2-core machine at P = 2 and 4; see docs/algorithms.md):
- latency tree: the topology tree where the machine has several sockets or NUMA nodes; else flat
  up to 8 ranks, 4-ary beyond;
- bandwidth channel: the topology tree on a multi-level machine; else the ring schedule
  (reduce-scatter + allgather around a chain: every rank reduces 1/P of the data), except when
  ranks outnumber the cores and are few (<= 8): a flat tree, the fewest context switches;
- inline limit (`small_bytes`): 4 KiB, or 64 KiB when ranks outnumber the usable cores (every
  hand-off is then a context switch: one round carrying the whole message wins);
- spin 20 us before yielding, none when ranks outnumber the cores; pin ranks to cores when they
  fit the usable cores of a detected (not synthetic) topology.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from .schedule import SMALL_MESSAGE_BYTES, Tree, build_tree, parse_tree_kind
from .topology import Topology, cpu_quota

DEFAULT_CHUNK_BYTES = 256 * 1024
AUTO_FLAT_OVERSUBSCRIBED = 8    # "auto" with more ranks than cores: a flat tree up to this size
DEFAULT_SLOTS = 4
DEFAULT_SMALL_BYTES = 4096
OVERSUBSCRIBED_SMALL_BYTES = 64 * 1024      # the default when ranks outnumber the usable cores
# messages of at least this many bytes write their output with streaming (non-temporal) stores:
# the output of so large a call is not read back from cache, and skipping the read-for-ownership
# of every output line saves a third of the traffic of the copy out; 0 disables
DEFAULT_NT_BYTES = 8 * 1024 * 1024
DEFAULT_SPIN_US = 20.0
SMALL_SLOTS = 2
MAX_RANKS = 4096
DEFAULT_STALL_TIMEOUT = 10.0

# NUMA placement of ring pages.  "consumer" (the default on a machine with several nodes): each
# ring lives on the node of the process that reads it, so the reader's loads are local and only
# the producer's stores cross the socket link, once per chunk; "producer": on the writer's node;
# "interleave": pages spread over the group's nodes; None: first touch by the producer.
NUMA_POLICIES = ("auto", "consumer", "producer", "interleave", None)

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")
# the collectives by number, as the engine and calls.py number them
ENGINE_ORDER = ("allreduce", "broadcast", "reduce", "reduce_scatter", "allgather", "alltoall")

OPTIONS = ("topology", "tree", "chunk_bytes", "pin", "slots", "placement", "numa", "small_bytes",
           "spin_us", "nt_bytes", "stall_timeout")


@dataclass(frozen=True)
class Plan:
    """Everything a group runs by: trees, schedule, geometry, waiting, pinning, placement."""

    size: int
    topology: Topology = field(repr=False, compare=False)
    tree_kind: object                 # the requested kind ("auto", "chain", ..., or an int k)
    placement: str
    ncpus: int                        # usable cores the plan was made for
    small_tree: Tree                  # channel 0: the latency round
    large_tree: Tree                  # channel 1
    large_schedule: str               # "tree" (pipelined up + down) or "ring"
    chunk_bytes: int
    slots: int                        # ring slots of channel 1 as run (the ring schedule needs 2)
    small_bytes: int                  # the largest message carried inline in the latency round
    nt_bytes: int
    spin_ns: int
    pin: bool
    cpu_of: Tuple[Optional[int], ...]  # the core each rank is pinned to (None: not pinned)
    node_of: Tuple[int, ...]          # the NUMA node of each rank's slot in the topology
    numa: Optional[str]               # the resolved policy ("consumer", ...) or None
    stall_timeout: Optional[float]    # seconds a Pool member may wait on idle members

    def algorithm(self, collective: str, nbytes: int) -> str:
        """Which algorithm runs `collective` ("allreduce", "broadcast", "reduce", "allgather",
        "reduce_scatter") on a message of nbytes (the whole buffer): "copy" in a group of one,
        "inline" (the latency round; the others run on the allreduce there), else the
        allreduce's "tree" or "ring" schedule on the bandwidth channel, or "chain" (broadcast,
        reduce) or "blocks" (reduce_scatter, allgather) around the ring order."""
        if collective not in COLLECTIVES:
            raise ValueError(f"shmtree: unknown collective {collective!r}; one of {COLLECTIVES}")
        if self.size == 1:
            return "copy"
        if nbytes <= self.small_bytes:
            return "inline"
        if collective == "allreduce":
            return self.large_schedule
        if collective == "alltoall":
            return "exchange"
        return "chain" if collective in ("broadcast", "reduce") else "blocks"

    def selection(self) -> dict:
        """The selection table the engine runs (Engine(selection=...)): by collective number
        (calls.ALLREDUCE ...), the largest message that travels inline and the algorithm of a
        larger one - algorithm() for a large message.  The one place a call's size is compared
        with small_bytes."""
        big = self.small_bytes + 1
        return {n: (self.small_bytes, self.algorithm(name, big))
                for n, name in enumerate(ENGINE_ORDER)}

    @property
    def ring_channel(self) -> bool:
        """Is a third channel laid, a ring around the bandwidth tree, for the collectives other
        than allreduce?  (Under the ring schedule they share the bandwidth channel.)"""
        return self.large_schedule != "ring" and self.size > 1

    @property
    def small_slots(self) -> int:
        return SMALL_SLOTS

    @property
    def oversubscribed(self) -> bool:
        return self.size > self.ncpus

    def digest(self) -> bytes:
        """16 bytes that differ between any two plans that would run differently."""
        parts = (self.size, self.topology.describe(), str(self.tree_kind), self.placement,
                 self.ncpus, self.small_tree.parent, self.small_tree.children,
                 self.large_tree.parent, self.large_tree.children, self.large_schedule,
                 self.chunk_bytes, self.slots, self.small_bytes, self.nt_bytes, self.spin_ns,
                 self.pin, self.cpu_of, self.node_of, self.numa, self.stall_timeout)
        return hashlib.sha256(repr(parts).encode()).digest()[:16]

    def describe(self) -> str:
        """A few lines for people: the trees drawn, the schedule, the geometry."""
        big = ("ring schedule (reduce-scatter + allgather) around "
               f"{' -> '.join(map(str, self.large_tree.ring))}"
               if self.large_schedule == "ring" else f"pipelined {self.large_tree.kind} tree")
        pinned = (", ".join(f"{r}:{c}" for r, c in enumerate(self.cpu_of) if c is not None)
                  if self.pin else "no")
        lines = [
            f"group of {self.size} rank(s) on {self.topology.describe()}; "
            f"{self.ncpus} usable core(s){' (oversubscribed)' if self.oversubscribed else ''}",
            f"tree option: {self.tree_kind!r}; placement: {self.placement}; numa: {self.numa}",
            f"messages <= {_size(self.small_bytes)}: one latency round on the "
            f"{self.small_tree.kind} tree (depth {self.small_tree.depth}), data inline:",
            _indent(self.small_tree.draw()),
            f"larger messages: {big}, {_size(self.chunk_bytes)} chunks, {self.slots} slots per "
            f"ring, depth {self.large_tree.depth}:",
            _indent(self.large_tree.draw()),
            "broadcast, reduce, reduce_scatter, allgather (larger messages): around "
            f"{' -> '.join(map(str, self.large_tree.ring))}"
            + (" (a ring channel of their own)" if self.ring_channel else ""),
            f"streaming stores from {_size(self.nt_bytes) if self.nt_bytes else 'never'}; "
            f"spin {self.spin_ns / 1000:g} us before yielding; pinned (rank:cpu): {pinned}",
        ]
        return "\n".join(lines)


def plan_group(size, *, topology=None, tree=None, chunk_bytes=None, pin=None, slots=None,
               placement="compact", numa="auto", small_bytes=None, spin_us=None, nt_bytes=None,
               stall_timeout=None, ncpus=None) -> Plan:
    """Validate a group's options and plan it (see the module docstring).  ncpus: the usable
    cores to plan for (None: `usable_count()` of this process: its CPUs within its cgroup's
    CPU quota)."""
    size = _group_size(size)
    if placement not in ("compact", "spread"):
        raise ValueError(f"shmtree: placement must be 'compact' or 'spread', got {placement!r}")
    if numa not in NUMA_POLICIES:
        raise ValueError(f"shmtree: numa must be one of {NUMA_POLICIES}, got {numa!r}")
    topology = Topology.resolve(topology)
    kind = parse_tree_kind("auto" if tree is None else tree)
    cpus = usable_cpus()
    if ncpus is None:
        ncpus = usable_count()
    over = size > ncpus
    chunk_bytes = _positive("chunk_bytes", chunk_bytes, DEFAULT_CHUNK_BYTES, 64)
    slots = _positive("slots", slots, DEFAULT_SLOTS, 1)
    small_bytes = _positive("small_bytes", small_bytes, OVERSUBSCRIBED_SMALL_BYTES if over
                            else DEFAULT_SMALL_BYTES, 0)
    nt_bytes = _positive("nt_bytes", nt_bytes, DEFAULT_NT_BYTES, 0)
    if spin_us is None:
        spin_us = 0.0 if over else DEFAULT_SPIN_US
    if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) or not spin_us >= 0:
        raise ValueError(f"shmtree: spin_us must be a number >= 0, got {spin_us!r}")
    if stall_timeout is not None and (isinstance(stall_timeout, bool) or not isinstance(
            stall_timeout, (int, float)) or not stall_timeout > 0):
        raise ValueError(f"shmtree: stall_timeout must be None or a number > 0, got "
                         f"{stall_timeout!r}")
    real = not topology.synthetic
    where = topology.placement(size, placement)
    cpu_of = tuple(s.cpu if (real and s.cpu in cpus) else None for s in where)
    if numa == "auto":
        numa = "consumer" if real and topology.nnodes > 1 else None
    elif numa is not None and not real:
        numa = None                       # a synthetic machine's nodes do not exist here
    if pin is None:
        pin = not over and real
    small, large, schedule = _trees(kind, size, topology, placement, small_bytes, chunk_bytes,
                                    ncpus)
    return Plan(size=size, topology=topology, tree_kind=kind, placement=placement, ncpus=ncpus,
                small_tree=small, large_tree=large, large_schedule=schedule,
                chunk_bytes=chunk_bytes, slots=max(slots, 2) if schedule == "ring" else slots,
                small_bytes=small_bytes, nt_bytes=nt_bytes, spin_ns=int(spin_us * 1000),
                pin=bool(pin), cpu_of=cpu_of, node_of=tuple(s.numa for s in where), numa=numa,
                stall_timeout=None if stall_timeout is None else float(stall_timeout))


def _trees(kind, size, topology, placement, small_bytes, chunk_bytes, ncpus):
    """(latency tree, bandwidth tree, bandwidth schedule).  tree="ring" runs the ring schedule
    around the bandwidth tree "auto" would pick (the machine's hierarchy: each socket link is
    crossed once per direction); the ring schedule needs two slots: each item waits for its
    successor to have consumed the previous one, which the successor does while producing its
    own."""
    small = build_tree("auto" if kind == "ring" else kind, size, topology, placement=placement,
                       message_bytes=min(small_bytes, SMALL_MESSAGE_BYTES - 1))
    large_kind, schedule = kind, "tree"
    if kind == "ring":
        large_kind, schedule = "auto", "ring"
    elif kind == "auto" and not topology.multi_level:
        if size <= ncpus or size > AUTO_FLAT_OVERSUBSCRIBED:
            large_kind, schedule = "chain", "ring"
        else:
            large_kind = "flat"
    large = build_tree(large_kind, size, topology, placement=placement,
                       message_bytes=max(chunk_bytes, SMALL_MESSAGE_BYTES))
    return small, large, schedule


# ---- the machine as this process may use it ----

_affinity_before_pin: Optional[frozenset] = None     # this process's mask before shmtree pinned it
_pinned_masks: set = set()                           # the masks shmtree set (one CPU each)


def usable_cpus() -> list:
    """The cores this process may run on, as the user left them: the CPU affinity mask from
    before shmtree pinned this process (a member is pinned to one core while it belongs to a
    group; that mask is not the machine's)."""
    if _affinity_before_pin is not None:
        return sorted(_affinity_before_pin)
    return sorted(os.sched_getaffinity(0))


SYSFS_ROOT = "/sys"      # where usable_count reads the cgroup CPU quota (tests: a fake tree)


def usable_count(sysfs_root=None) -> int:
    """How many cores this process can keep busy at once: its usable CPUs (`usable_cpus`), but
    no more than its cgroup's CPU quota (`topology.cpu_quota`, rounded down, at least one).  In
    a container limited to 2 CPUs on a 64-core host this is 2: a group of more ranks is
    oversubscribed (no spinning, the larger inline limit, no pinning)."""
    count = len(usable_cpus())
    quota = cpu_quota(SYSFS_ROOT if sysfs_root is None else sysfs_root)
    if quota is not None:
        count = min(count, max(1, math.floor(quota + 1e-9)))
    return count


def pin_to(cpu: int) -> None:
    """Pin the calling thread (the one that joins) to `cpu`, remembering the mask to restore
    (`unpin`).  Only this thread is pinned, and the threads it starts from now on (they
    inherit its mask: the progress thread, a user's); the process's other threads keep
    theirs."""
    global _affinity_before_pin
    before = frozenset(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    _pinned_masks.add(frozenset((cpu,)))
    if _affinity_before_pin is None:
        _affinity_before_pin = before


def _threads():
    """The ids of this process's threads (Linux: /proc/self/task); just this one elsewhere."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return [0]


def unpin() -> None:
    """Give the process back the CPU mask it had before shmtree pinned it (no-op otherwise):
    every thread of the process that still runs on a mask shmtree set (the joining thread, and
    the threads started while it was pinned, which inherited its one core) gets the original
    mask again, whichever thread calls this; a thread whose mask was changed since (by the
    user) is left alone."""
    global _affinity_before_pin
    if _affinity_before_pin is not None:
        mask, _affinity_before_pin = _affinity_before_pin, None
        pinned = set(_pinned_masks)
        _pinned_masks.clear()
        for tid in _threads():
            try:
                if tid == 0 or frozenset(os.sched_getaffinity(tid)) in pinned:
                    os.sched_setaffinity(tid, mask)
            except OSError:
                pass                  # a thread that ended meanwhile, or a mask now refused


# a forked child is not the member its parent is: it starts with the parent's original mask
os.register_at_fork(after_in_child=unpin)


# ---- small helpers ----

def _group_size(size) -> int:
    if isinstance(size, bool) or not hasattr(size, "__index__"):
        raise ValueError(f"shmtree: group size must be an int >= 1, got {size!r}")
    n = size.__index__()
    if n < 1:
        raise ValueError(f"shmtree: group size must be an int >= 1, got {size!r}")
    if n > MAX_RANKS:
        raise ValueError(f"shmtree: group size is limited to {MAX_RANKS} ranks")
    return n


def _positive(name, value, default, minimum):
    if value is None:
        return default
    if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < minimum:
        raise ValueError(f"shmtree: {name} must be an int >= {minimum}, got {value!r}")
    return value.__index__()


def _size(n: int) -> str:
    for unit, div in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
