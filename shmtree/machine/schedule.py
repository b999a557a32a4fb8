"""Schedule: the reduction tree as pure data.

A `Tree` says, for ranks 0..size-1, who is whose parent. Data flows up the tree (each interior
rank reduces its children's chunk with its own and passes the result to its parent) and back
down (the root's result is copied from parent to child), chunk after chunk, so the cost of
depth is paid once per message, not once per chunk (Patarasuk & Yuan). A tree also defines a
logical ring, `Tree.ring`: its depth-first order from the root. Around that ring the "ring"
schedule (reduce-scatter then allgather) uses every tree edge once per direction.

Tree kinds (`build_tree(kind, size, topology, ...)`):

- "chain": rank 0 is the root, rank r's parent is r-1 (bandwidth-optimal extreme);
- "binary", or an int k >= 1: k-ary heap order, parent of r is (r-1)//k (k=1 is a chain);
- "flat": rank 0 the parent of every other rank (latency-optimal extreme);
- "ring": the chain, whose `ring` order the ring schedule walks;
- "topology": the machine's hierarchy (socket > NUMA node > L3 group) laid over the ranks, so
  that only socket leaders cross the socket links, once per direction;
- "auto": "topology" on a machine with more than one socket or NUMA node; otherwise "flat"
  (size <= 8) or a 4-ary tree for small messages, "chain" for large ones.

Everything here is deterministic: the same inputs give the same tree, so the reduction order,
and therefore every bit of the result, is fixed by (kind, size, topology, placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .topology import Topology

__all__ = [
    "SMALL_MESSAGE_BYTES",
    "AUTO_FLAT_MAX_SIZE",
    "AUTO_SMALL_ARITY",
    "TREE_KINDS",
    "Tree",
    "build_tree",
    "parse_tree_kind",
    "chain_tree",
    "kary_tree",
    "flat_tree",
    "topology_tree",
]

#: Messages below this many bytes take the latency path (flatter trees).
SMALL_MESSAGE_BYTES = 64 * 1024
#: "auto" on a flat machine: a flat tree up to this many ranks for small messages ...
AUTO_FLAT_MAX_SIZE = 8
#: ... and a tree of this arity beyond it.
AUTO_SMALL_ARITY = 4
#: The named kinds `parse_tree_kind` accepts (besides an int k or "k-ary").
TREE_KINDS = ("auto", "topology", "chain", "binary", "flat", "ring")

TreeKind = Union[str, int]


# --------------------------------------------------------------------------- Tree


@dataclass(frozen=True)
class Tree:
    """A rooted tree over ranks 0..size-1.

    `parent[r]` is r's parent (-1 for the root); `children[r]` lists r's children in a fixed
    order (the order a rank visits them; also the depth-first order of `ring`). Sequences given
    as lists are stored as tuples. `build_tree` returns validated trees; call `validate()` on
    one built by hand.
    """

    kind: str
    size: int
    root: int
    parent: Tuple[int, ...]
    children: Tuple[Tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parent", tuple(self.parent))
        object.__setattr__(self, "children", tuple(tuple(c) for c in self.children))

    @cached_property
    def depth(self) -> int:
        """The most edges on a path from the root to a leaf (0 for a single rank)."""
        deepest, level = 0, {self.root: 0}
        for r in self.ring:
            for c in self.children[r]:
                level[c] = level[r] + 1
                deepest = max(deepest, level[c])
        return deepest

    @cached_property
    def ring(self) -> Tuple[int, ...]:
        """The ranks in depth-first (pre-)order from the root: the logical ring."""
        order, stack = [], [self.root]
        while stack:
            r = stack.pop()
            order.append(r)
            _check(len(order) <= self.size, "children links form a cycle")
            stack.extend(reversed(self.children[r]))
        return tuple(order)

    def edges(self) -> List[Tuple[int, int]]:
        """(child, parent) for every rank but the root, by child rank."""
        return [(r, p) for r, p in enumerate(self.parent) if p >= 0]

    def is_leaf(self, rank: int) -> bool:
        """True when `rank` has no children."""
        return not self.children[rank]

    def draw(self, labels: Optional[Union[Sequence[str], Mapping[int, str],
                                          Callable[[int], str]]] = None) -> str:
        """An ASCII drawing, indented like the `tree` command; `labels` annotate ranks."""
        def text(r: int) -> str:
            if labels is None:
                return str(r)
            extra = labels(r) if callable(labels) else labels[r]
            return f"{r} {extra}"

        lines = [text(self.root)]
        stack = [(c, "", i == len(self.children[self.root]) - 1)
                 for i, c in enumerate(self.children[self.root])][::-1]
        while stack:
            r, prefix, last = stack.pop()
            lines.append(prefix + ("`-- " if last else "|-- ") + text(r))
            inner = prefix + ("    " if last else "|   ")
            kids = self.children[r]
            stack.extend((c, inner, i == len(kids) - 1) for i, c in reversed(list(enumerate(kids))))
        return "\n".join(lines)

    def validate(self) -> "Tree":
        """Check the structural invariants; raise AssertionError naming the first broken one.

        Every rank 0..size-1 appears once, parent and children links agree, the root has no
        parent, and following parents from any rank reaches the root (acyclic, connected).
        Returns self.
        """
        n = self.size
        _check(isinstance(self.kind, str) and self.kind, f"kind must be a name, got {self.kind!r}")
        _check(isinstance(n, int) and n >= 1, f"size must be >= 1, got {n!r}")
        _check(len(self.parent) == n and len(self.children) == n,
               f"parent/children must have {n} entries")
        _check(0 <= self.root < n and self.parent[self.root] == -1,
               f"root {self.root} must be a rank with parent -1")
        for r, p in enumerate(self.parent):
            if r != self.root:
                _check(0 <= p < n and p != r, f"rank {r} has bad parent {p}")
                _check(self.children[p].count(r) == 1, f"rank {r} missing from children[{p}]")
        for p, kids in enumerate(self.children):
            for c in kids:
                _check(0 <= c < n and self.parent[c] == p, f"children[{p}] lists {c} wrongly")
        _check(sum(map(len, self.children)) == n - 1, "children lists hold extra entries")
        _check(sorted(self.ring) == list(range(n)), "some rank is unreachable from the root")
        return self


def _check(ok: Any, message: str) -> None:
    """Raise AssertionError(message) unless ok (independent of python -O)."""
    if not ok:
        raise AssertionError(message)


def _tree(kind: str, parent: Sequence[int], children: Optional[Sequence[List[int]]] = None) -> Tree:
    """A validated tree rooted at 0; children default to ascending rank order."""
    if children is None:
        children = [[] for _ in parent]
        for r, p in enumerate(parent):
            if p >= 0:
                children[p].append(r)
    return Tree(kind, len(parent), 0, tuple(parent), tuple(map(tuple, children))).validate()


# --------------------------------------------------------------------------- kinds


def parse_tree_kind(value: Any) -> TreeKind:
    """Normalise a tree kind: one of TREE_KINDS, or an int k >= 1 for a k-ary tree.

    Accepts the names (any case, surrounding spaces ignored), an int, a numeric string ("3"),
    or "k-ary" ("3-ary", the form `Tree.kind` uses); None means "auto". Raises ValueError
    for anything else.
    """
    if value is None:
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"tree kind must be a name or an int k >= 1, not {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TREE_KINDS:
            return text
        digits = text[:-4] if text.endswith("-ary") else text
        if digits.isascii() and digits.isdigit():
            return _arity(int(digits), value)
    elif hasattr(value, "__index__"):  # int, numpy integers
        return _arity(value.__index__(), value)
    raise ValueError(f"unknown tree kind {value!r}: expected one of {', '.join(TREE_KINDS)} "
                     f"or an int k >= 1 (k-ary tree)")


def _arity(k: int, original: Any) -> int:
    """k when k >= 1, else ValueError."""
    if k < 1:
        raise ValueError(f"k-ary tree needs k >= 1, got {original!r}")
    return k


def _kind_name(kind: TreeKind) -> str:
    """The `Tree.kind` string of a parsed kind ("3-ary" for 3)."""
    return f"{kind}-ary" if isinstance(kind, int) else kind


def chain_tree(size: int, kind: str = "chain") -> Tree:
    """Rank 0 the root, rank r's parent r-1."""
    return _tree(kind, [r - 1 for r in range(size)])


def kary_tree(size: int, k: int, kind: Optional[str] = None) -> Tree:
    """Heap-ordered k-ary tree: rank r's parent (r-1)//k; kind defaults to "k-ary"."""
    return _tree(kind or _kind_name(k), [-1] + [(r - 1) // k for r in range(1, size)])


def flat_tree(size: int) -> Tree:
    """Rank 0 the parent of every other rank."""
    return _tree("flat", [-1] + [0] * (size - 1))


# --------------------------------------------------------------------------- topology tree


def topology_tree(size: int, topology: Topology, placement: str = "compact",
                  message_bytes: Optional[int] = None) -> Tree:
    """The hierarchy-aware tree (see the module docstring and `build_tree`)."""
    slots = topology.placement(size, placement)
    keys = [((s.socket,), (s.socket, s.numa), (s.socket, s.numa, s.l3)) for s in slots]
    star = message_bytes is not None and message_bytes < SMALL_MESSAGE_BYTES
    parent = [-1] * size
    children: List[List[int]] = [[] for _ in range(size)]

    def link(child: int, par: int) -> None:
        parent[child] = par
        children[par].append(child)

    def build(ranks: List[int], level: int) -> int:
        """Link `ranks` (ascending) into a subtree; return its leader (lowest rank)."""
        if level == 3:  # ranks sharing one L3 group
            for prev, r in zip(ranks, ranks[1:]):
                link(r, ranks[0] if star else prev)
            return ranks[0]
        groups: Dict[Any, List[int]] = {}
        for r in ranks:
            groups.setdefault(keys[r][level], []).append(r)
        subgroups = iter(groups.values())
        leader = build(next(subgroups), level + 1)  # holds ranks[0]
        for group in subgroups:
            link(build(group, level + 1), leader)
        return leader

    build(list(range(size)), 0)
    return _tree("topology", parent, children)


# --------------------------------------------------------------------------- build_tree


def build_tree(kind: Any, size: int, topology: Any = None, *, placement: Optional[str] = None,
               message_bytes: Optional[int] = None) -> Tree:
    """Build the tree of `kind` over ranks 0..size-1; the result is validated.

    kind: see `parse_tree_kind` and the module docstring. topology (only read by "topology"
    and "auto"): anything `Topology.resolve` accepts; None detects this machine. placement:
    "compact" (default) or "spread", the policy mapping rank i to slot i of
    `topology.placement(size, placement)`. message_bytes: the message size; below
    SMALL_MESSAGE_BYTES the "topology" tree makes each L3 group a star under its leader
    instead of a chain, and "auto" on a flat machine picks "flat"/4-ary instead of "chain";
    None means the bandwidth path for "topology" and the latency path for "auto" (a flat
    machine). The root is always rank 0. Raises ValueError for a bad kind, size, placement or
    message_bytes.
    """
    kind = parse_tree_kind(kind)
    size = _check_size(size)
    if message_bytes is not None and (isinstance(message_bytes, bool) or message_bytes < 0):
        raise ValueError(f"message_bytes must be None or >= 0, got {message_bytes!r}")
    if kind in ("topology", "auto"):
        topo = Topology.resolve(topology)
        if kind == "auto":
            kind = _auto_kind(size, topo, message_bytes)
        if kind == "topology":
            return topology_tree(size, topo, placement or "compact", message_bytes)
    return _simple_tree(kind, size)


def _simple_tree(kind: TreeKind, size: int) -> Tree:
    """The trees that ignore the topology."""
    if kind == "chain" or kind == "ring":
        return chain_tree(size, kind)
    if kind == "flat":
        return flat_tree(size)
    if kind == "binary":
        return kary_tree(size, 2, "binary")
    return kary_tree(size, int(kind))


def _auto_kind(size: int, topology: Topology, message_bytes: Optional[int]) -> TreeKind:
    """The kind "auto" stands for (see the module docstring)."""
    if topology.multi_level:
        return "topology"
    if message_bytes is None or message_bytes < SMALL_MESSAGE_BYTES:
        return "flat" if size <= AUTO_FLAT_MAX_SIZE else AUTO_SMALL_ARITY
    return "chain"


def _check_size(size: Any) -> int:
    """size as an int >= 1, else ValueError."""
    if isinstance(size, bool):
        raise ValueError(f"tree size must be an int >= 1, got {size!r}")
    try:
        n = size.__index__()
    except (AttributeError, TypeError):
        raise ValueError(f"tree size must be an int >= 1, got {size!r}") from None
    if n < 1:
        raise ValueError(f"tree size must be >= 1, got {n}")
    return n
