"""Topology: what the machine is, as plain data.

A `Topology` is an ordered list of CPU slots. Each slot is one logical CPU (a hardware thread)
with its place in the hierarchy machine > socket > NUMA node > L3 group > core > SMT thread:

    Slot(cpu, socket, numa, l3, core, smt)

- `cpu` is the OS CPU id, or None for a synthetic topology (one made from a spec string such as
  "2x4"). A synthetic slot never names a real CPU, so the API layer pins a rank only when its
  slot's `cpu` is not None and is in `os.sched_getaffinity(0)`.
- `socket` is the package id and `numa` the NUMA node id, as the OS numbers them (so `numa` can
  be handed to `mbind`); for synthetic topologies they are numbered 0.. machine-wide.
- `l3` and `core` are renumbered densely machine-wide, in the order they first appear (by CPU
  id); input ids need only be unique within a socket.
- `smt` is the thread's index within its core, counting only the CPUs the topology holds.

A topology comes from four places: `Topology.detect()` reads sysfs (honouring the CPUs this
process may run on; the reading itself is `shmtree.machine.sysfs`'s, as is the cgroup CPU quota),
`Topology.from_spec("2x2x4:2")` builds a synthetic one, `Topology.load()` reads the JSON that
`dump()` writes, and `Topology.fixture(name)` loads one of the checked-in machines under
shmtree/machine/fixtures/. `Topology.resolve()` accepts any of these (the API's `topology=`
argument).

`placement(nranks, policy)` maps ranks to slots: one rank per physical core before any SMT
sibling is used; "compact" fills socket 0 first, "spread" deals ranks round-robin across
sockets, then NUMA nodes, then L3 groups; more ranks than CPUs wrap around (ranks then share
CPUs). The tree builders in `shmtree.machine.schedule` group ranks by the slots they land on.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

# the reading of sysfs and of the cgroups is shmtree.machine.sysfs's; these names stay
# importable from here (groups/transport.py walks the memory cgroups with _proc_cgroups and _cgroup_dirs)
from .sysfs import (_cgroup_dirs, _dense, _detect_slots, _is_live_sysfs,  # noqa: F401
                    _proc_cgroups, cpu_quota, parse_cpulist)

__all__ = ["Slot", "Topology", "POLICIES", "parse_cpulist", "cpu_quota"]

POLICIES = ("compact", "spread")
FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures"

_FORMAT = "shmtree-topology"
_FORMAT_VERSION = 1
_MAX_SPEC_CPUS = 1 << 16
_SPEC_RE = re.compile(r"^\s*(\d+(?:\s*[xX]\s*\d+){0,3})\s*(?::\s*(\d+)\s*)?$")


class Slot(NamedTuple):
    """One logical CPU and its place in the hierarchy (see the module docstring)."""

    cpu: Optional[int]
    socket: int
    numa: int
    l3: int
    core: int
    smt: int


# --------------------------------------------------------------------------- canonical form


def _as_slot(item: Any) -> Slot:
    """Accept a Slot, a 6-sequence or a mapping with the Slot field names."""
    if isinstance(item, Mapping):
        missing = [f for f in Slot._fields if f not in item and f != "cpu"]
        if missing:
            raise ValueError(f"slot {dict(item)!r} lacks {', '.join(missing)}")
        item = [item.get(f) for f in Slot._fields]
    values = list(item)
    if len(values) != len(Slot._fields):
        raise ValueError(f"a slot has {len(Slot._fields)} fields {Slot._fields}, got {item!r}")
    for name, v in zip(Slot._fields, values):
        if v is None and name == "cpu":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"slot field {name} must be an int >= 0, got {v!r}")
    return Slot(*values)


def _canonical(items: Iterable[Any]) -> Tuple[Slot, ...]:
    """Validate slots, sort by CPU id (when real), renumber l3/core densely and smt per core."""
    slots = [_as_slot(s) for s in items]
    if not slots:
        raise ValueError("a topology needs at least one CPU")
    real = [s.cpu is not None for s in slots]
    if any(real) and not all(real):
        raise ValueError("either every slot has an OS cpu id or none has (synthetic)")
    if all(real):
        if len({s.cpu for s in slots}) != len(slots):
            raise ValueError("duplicate cpu ids in topology")
        slots.sort(key=lambda s: s.cpu)
    l3s = _dense([(s.socket, s.l3) for s in slots])
    cores = _dense([(s.socket, s.core) for s in slots])
    slots = [s._replace(l3=l3, core=core) for s, l3, core in zip(slots, l3s, cores)]
    return tuple(_renumber_smt(slots))


def _renumber_smt(slots: List[Slot]) -> List[Slot]:
    """Give each core's threads smt = 0.. in order of (given smt, position); check nesting."""
    by_core: Dict[int, List[int]] = {}
    for i, s in enumerate(slots):
        by_core.setdefault(s.core, []).append(i)
    out = list(slots)
    for core, members in by_core.items():
        places = {(slots[i].socket, slots[i].numa, slots[i].l3) for i in members}
        if len(places) != 1:
            raise ValueError(f"core {core} spans several NUMA nodes or L3 groups: {places}")
        for smt, i in enumerate(sorted(members, key=lambda i: (slots[i].smt, i))):
            out[i] = slots[i]._replace(smt=smt)
    return out


def _interleave(items: List[Slot], levels: Sequence[str]) -> List[Slot]:
    """Deal items round-robin over the groups of levels[0], recursively over deeper levels."""
    if not levels or len(items) <= 1:
        return items
    groups: Dict[int, List[Slot]] = {}
    for s in items:
        groups.setdefault(getattr(s, levels[0]), []).append(s)
    dealt = [_interleave(g, levels[1:]) for g in groups.values()]
    width = max(len(g) for g in dealt)
    return [g[i] for i in range(width) for g in dealt if i < len(g)]


# --------------------------------------------------------------------------- Topology


class Topology:
    """The CPUs of a machine (or of a synthetic one) and their hierarchy.

    `Topology(slots, name=None, note=None)`: `slots` is an iterable of `Slot`, 6-sequences or
    mappings with the Slot field names; they are validated and put in canonical form (see the
    module docstring). Instances are immutable; equality compares the slots only.
    """

    def __init__(self, slots: Iterable[Any], name: Optional[str] = None,
                 note: Optional[str] = None) -> None:
        self._slots = _canonical(slots)
        self.name = name or (self.to_spec() if self.synthetic else None) or "topology"
        self.note = note
        self._orders: Dict[str, Tuple[Slot, ...]] = {}

    # ------------------------------------------------------------------ constructors

    @classmethod
    def detect(cls, sysfs_root: "str | os.PathLike[str]" = "/sys",
               allowed_cpus: Optional[Iterable[int]] = None) -> "Topology":
        """Read the machine's topology from sysfs.

        Reads cpu*/topology/{physical_package_id,core_id,thread_siblings_list},
        node*/cpulist and cpu*/cache/index*/ (level 3 -> shared_cpu_list). Only online CPUs in
        `allowed_cpus` are kept; `allowed_cpus=None` means `os.sched_getaffinity(0)` (which
        reflects cgroup cpusets) when `sysfs_root` is the live /sys, and every CPU otherwise
        (a copied or fake sysfs tree). Missing files degrade: no node dirs -> NUMA node 0;
        no L3 -> one L3 group per NUMA node; no sibling list -> core_id, else one core per CPU;
        no cpu dirs at all -> one socket with one core per allowed CPU.
        Raises ValueError when no CPU is left.
        """
        root = Path(sysfs_root)
        allowed = None if allowed_cpus is None else {int(c) for c in allowed_cpus}
        if allowed is None and _is_live_sysfs(root) and hasattr(os, "sched_getaffinity"):
            allowed = set(os.sched_getaffinity(0))
        slots = _detect_slots(root, allowed)
        if not slots:
            raise ValueError(f"no allowed CPU found under {root} (allowed: {allowed})")
        return cls(slots, name="detected")

    @classmethod
    def from_spec(cls, spec: str) -> "Topology":
        """Build a synthetic topology from a spec string.

        Grammar (whitespace ignored, "x" or "X" between numbers, every number >= 1):

            spec  := dims [":" threads]
            dims  := C | S "x" C | S "x" N "x" C | S "x" N "x" L "x" C

        S sockets, N NUMA nodes per socket, L L3 groups per NUMA node, C cores per innermost
        group, threads SMT threads per core (default 1). So "2x4" is 2 sockets of 4 cores,
        "2x2x4" 2 sockets x 2 NUMA nodes x 4 cores, "2x2x2x4" adds 2 L3 groups per node, and
        "2x4:2" has 2 threads per core. Slots have cpu=None (synthetic) and are ordered
        socket, node, L3 group, core, thread. Raises ValueError on anything else.
        """
        s, n, l3, c, t = _parse_spec(spec)
        slots = []
        for core in range(s * n * l3 * c):
            group = core // c
            node, sock = group // l3, group // (l3 * n)
            slots.extend(Slot(None, sock, node, group, core, k) for k in range(t))
        return cls(slots, name=_format_spec(s, n, l3, c, t))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        """Inverse of `to_dict()`; slots may be lists in `fields` order or mappings."""
        if not isinstance(data, Mapping) or "slots" not in data:
            raise ValueError("a topology dict needs a 'slots' list")
        if data.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"not a {_FORMAT} document: format={data.get('format')!r}")
        if int(data.get("version", _FORMAT_VERSION)) > _FORMAT_VERSION:
            raise ValueError(f"topology format version {data['version']} is newer than "
                             f"this shmtree understands ({_FORMAT_VERSION})")
        fields = list(data.get("fields", Slot._fields))
        if sorted(fields) != sorted(Slot._fields):
            raise ValueError(f"topology fields must be {Slot._fields}, got {fields}")
        rows = [s if isinstance(s, Mapping) else dict(zip(fields, s)) for s in data["slots"]]
        return cls(rows, name=data.get("name"), note=data.get("note"))

    @classmethod
    def load(cls, path: "str | os.PathLike[str]") -> "Topology":
        """Read a topology from the JSON file `dump()` writes."""
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        topo = cls.from_dict(data)
        if not data.get("name"):
            topo.name = Path(path).stem
        return topo

    @classmethod
    def fixtures(cls) -> List[str]:
        """Names of the machine fixtures shipped in shmtree/machine/fixtures/."""
        return sorted(p.stem for p in FIXTURE_DIR.glob("*.json"))

    @classmethod
    def fixture(cls, name: str) -> "Topology":
        """Load a shipped machine fixture by name (see `fixtures()`)."""
        if name not in cls.fixtures():
            raise ValueError(f"unknown topology fixture {name!r}; known: {cls.fixtures()}")
        return cls.load(FIXTURE_DIR / f"{name}.json")

    @classmethod
    def resolve(cls, value: Any = None) -> "Topology":
        """Turn the API's `topology=` argument into a Topology.

        None -> `detect()`; a Topology -> itself; a dict -> `from_dict()`; a string matching
        the spec grammar -> `from_spec()`; a path to an existing file -> `load()`; a fixture
        name -> `fixture()`. Anything else raises ValueError (TypeError for other types).
        """
        if value is None:
            return cls.detect()
        if isinstance(value, Topology):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"topology must be None, a Topology, a spec string or a path, "
                            f"not {type(value).__name__}")
        text = os.fspath(value)
        if isinstance(value, str) and _SPEC_RE.match(text):
            return cls.from_spec(text)
        if os.path.isfile(text):
            return cls.load(text)
        if text in cls.fixtures():
            return cls.fixture(text)
        raise ValueError(f"topology {text!r} is neither a spec like '2x4' or '2x2x4', "
                         f"an existing JSON file, nor a fixture name {cls.fixtures()}")

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict: format, version, name, note, fields and one list per slot."""
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "name": self.name,
            "note": self.note,
            "summary": self.describe(),
            "fields": list(Slot._fields),
            "slots": [list(s) for s in self._slots],
        }

    def dump(self, path: "str | os.PathLike[str]") -> None:
        """Write `to_dict()` as JSON, one slot per line."""
        data = self.to_dict()
        rows = ",\n    ".join(json.dumps(row) for row in data.pop("slots"))
        head = json.dumps(data, indent=2)[:-2]  # drop the closing "\n}"
        with open(path, "w", encoding="utf-8") as f:
            f.write(f'{head},\n  "slots": [\n    {rows}\n  ]\n}}\n')

    # ------------------------------------------------------------------ properties

    @property
    def slots(self) -> Tuple[Slot, ...]:
        """All slots, in canonical order (by CPU id, or construction order when synthetic)."""
        return self._slots

    @property
    def synthetic(self) -> bool:
        """True when no slot names an OS CPU (cpu is None everywhere)."""
        return self._slots[0].cpu is None

    @property
    def cpus(self) -> Tuple[int, ...]:
        """The OS CPU ids of the slots (empty for a synthetic topology)."""
        return tuple(s.cpu for s in self._slots if s.cpu is not None)

    @property
    def ncpus(self) -> int:
        """Number of logical CPUs (hardware threads)."""
        return len(self._slots)

    @property
    def ncores(self) -> int:
        """Number of physical cores."""
        return len({s.core for s in self._slots})

    @property
    def nsockets(self) -> int:
        """Number of sockets (packages)."""
        return len({s.socket for s in self._slots})

    @property
    def nnodes(self) -> int:
        """Number of NUMA nodes holding at least one of the CPUs."""
        return len({s.numa for s in self._slots})

    @property
    def nl3(self) -> int:
        """Number of L3 groups (CPUs sharing one last-level cache)."""
        return len({s.l3 for s in self._slots})

    @property
    def multi_level(self) -> bool:
        """True when there is more than one socket or more than one NUMA node."""
        return self.nsockets > 1 or self.nnodes > 1

    @property
    def is_flat(self) -> bool:
        """True for one socket with one NUMA node (the negation of `multi_level`)."""
        return not self.multi_level

    # ------------------------------------------------------------------ placement

    def placement(self, nranks: int, policy: str = "compact") -> List[Slot]:
        """The slot of each rank 0..nranks-1.

        Every physical core gets one rank before any core gets a second (SMT sibling).
        "compact" fills socket 0 first (then NUMA node, L3 group, core order); "spread" deals
        ranks round-robin over sockets, within a socket over NUMA nodes, within a node over L3
        groups. With more ranks than CPUs the order wraps: rank i gets slot i mod ncpus.
        """
        if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 0:
            raise ValueError(f"nranks must be an int >= 0, got {nranks!r}")
        order = self._order(policy)
        return [order[i % len(order)] for i in range(nranks)]

    def _order(self, policy: str) -> Tuple[Slot, ...]:
        """The full placement order for `policy`, cached."""
        if policy not in POLICIES:
            raise ValueError(f"placement policy must be one of {POLICIES}, got {policy!r}")
        if policy not in self._orders:
            rounds = self._smt_rounds()
            if policy == "spread":
                rounds = [_interleave(r, ("socket", "numa", "l3")) for r in rounds]
            self._orders[policy] = tuple(s for r in rounds for s in r)
        return self._orders[policy]

    def _smt_rounds(self) -> List[List[Slot]]:
        """Round t lists thread t of every core having one, cores in hierarchical order."""
        key = lambda s: (s.socket, s.numa, s.l3, s.core)  # noqa: E731
        threads = sorted(self._slots, key=lambda s: (s.smt,) + key(s))
        rounds: List[List[Slot]] = []
        for s in threads:
            if len(rounds) <= s.smt:
                rounds.append([])
            rounds[s.smt].append(s)
        return rounds

    # ------------------------------------------------------------------ text

    def to_spec(self) -> Optional[str]:
        """The spec string of a regular topology (same counts at every level), else None."""
        groups = _count_tree(self._slots)
        shape = []
        for level in groups:
            widths = {len(v) for v in level.values()}
            if len(widths) != 1:
                return None
            shape.append(widths.pop())
        s, n, l3, c, t = shape
        return _format_spec(s, n, l3, c, t)

    def describe(self) -> str:
        """One line of text: name, shape and counts."""
        spec = self.to_spec()
        shape = f" [{spec}]" if spec and spec != self.name else ""
        kind = ", synthetic" if self.synthetic else ""
        return (f"{self.name}{shape}: {self.nsockets} socket(s), {self.nnodes} NUMA node(s), "
                f"{self.nl3} L3 group(s), {self.ncores} cores, {self.ncpus} CPUs{kind}")

    def __repr__(self) -> str:
        return f"<Topology {self.describe()}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._slots == other._slots

    def __hash__(self) -> int:
        return hash(self._slots)


# --------------------------------------------------------------------------- spec helpers


def _parse_spec(spec: str) -> Tuple[int, int, int, int, int]:
    """(sockets, nodes per socket, L3 groups per node, cores per group, threads per core)."""
    if not isinstance(spec, str):
        raise ValueError(f"topology spec must be a string like '2x4', got {spec!r}")
    m = _SPEC_RE.match(spec)
    if not m:
        raise ValueError(f"bad topology spec {spec!r}: expected e.g. '2x4' (sockets x cores), "
                         f"'2x2x4' (sockets x NUMA x cores), '2x2x2x4' (with L3 groups), "
                         f"optionally ':2' for 2 SMT threads per core")
    dims = [int(d) for d in re.split(r"\s*[xX]\s*", m.group(1).strip())]
    threads = int(m.group(2)) if m.group(2) else 1
    cores = dims.pop()
    dims = dims + [1] * (3 - len(dims)) + [cores]  # sockets, nodes, L3 groups, cores
    if min(dims + [threads]) < 1:
        raise ValueError(f"bad topology spec {spec!r}: every count must be >= 1")
    total = dims[0] * dims[1] * dims[2] * dims[3] * threads
    if total > _MAX_SPEC_CPUS:
        raise ValueError(f"topology spec {spec!r} has {total} CPUs (limit {_MAX_SPEC_CPUS})")
    return dims[0], dims[1], dims[2], dims[3], threads


def _format_spec(s: int, n: int, l3: int, c: int, t: int) -> str:
    """Shortest spec string for the given counts."""
    if l3 > 1:
        dims = [s, n, l3, c]
    elif n > 1:
        dims = [s, n, c]
    else:
        dims = [s, c]
    return "x".join(map(str, dims)) + (f":{t}" if t > 1 else "")


def _count_tree(slots: Sequence[Slot]) -> List[Dict[Any, set]]:
    """For each level (machine, socket, node, L3 group, core): parent key -> child keys."""
    keys = [
        lambda s: (),
        lambda s: (s.socket,),
        lambda s: (s.socket, s.numa),
        lambda s: (s.socket, s.numa, s.l3),
        lambda s: (s.socket, s.numa, s.l3, s.core),
        lambda s: (s.socket, s.numa, s.l3, s.core, s.smt),
    ]
    levels: List[Dict[Any, set]] = [{} for _ in range(len(keys) - 1)]
    for s in slots:
        for i in range(len(keys) - 1):
            levels[i].setdefault(keys[i](s), set()).add(keys[i + 1](s))
    return levels
