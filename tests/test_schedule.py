"""Tests for shmtree.machine.schedule: every tree kind for P = 1..64, topology trees on every
fixture.

Pure data, no processes. The topology-tree property checked everywhere: each socket (and each
NUMA node within a socket, and each L3 group within a node) that does not hold the root is
entered by exactly one tree edge, from its leader (its lowest rank) to the leader of the
enclosing group.
"""

import dataclasses
import re

import pytest

from shmtree.machine.schedule import (
    AUTO_FLAT_MAX_SIZE,
    SMALL_MESSAGE_BYTES,
    TREE_KINDS,
    Tree,
    build_tree,
    parse_tree_kind,
)
from shmtree.machine.topology import Topology

SIZES = range(1, 65)
SYNTHETIC = ["2x4", "2x2x4", "4x8", "8x4", "2x2x2x4:2"]
MACHINES = Topology.fixtures() + SYNTHETIC
MULTI_LEVEL = [m for m in MACHINES if Topology.resolve(m).multi_level]
LEVELS = {  # level name -> group key of a slot
    "socket": lambda s: (s.socket,),
    "numa": lambda s: (s.socket, s.numa),
    "l3": lambda s: (s.socket, s.numa, s.l3),
}


def kary_depth(size, k):
    """Depth of a heap-ordered k-ary tree of `size` nodes."""
    if k == 1:
        return size - 1
    depth, full = 0, 1
    while full < size:
        depth, full = depth + 1, full + k ** (depth + 1)
    return depth


def check_common(tree, size):
    """Invariants every tree must satisfy."""
    assert tree.validate() is tree
    assert tree.size == size and tree.root == 0 and tree.parent[0] == -1
    assert sorted(tree.ring) == list(range(size)) and tree.ring[0] == tree.root
    seen = set()
    for r in tree.ring:  # depth-first: a parent comes before its children
        assert r == tree.root or tree.parent[r] in seen
        seen.add(r)
    assert len(tree.edges()) == size - 1
    assert all(tree.is_leaf(r) == (not tree.children[r]) for r in range(size))
    drawing = tree.draw()
    assert len(drawing.splitlines()) == size
    assert sorted(int(re.search(r"\d+", line).group()) for line in drawing.splitlines()) \
        == list(range(size))


# --------------------------------------------------------------------------- parse_tree_kind


@pytest.mark.parametrize("value, expected", [
    *[(k, k) for k in TREE_KINDS], (" Chain ", "chain"), ("BINARY", "binary"), (None, "auto"),
    (1, 1), (3, 3), ("4", 4), (" 16 ", 16), ("3-ary", 3),
])
def test_parse_tree_kind(value, expected):
    assert parse_tree_kind(value) == expected


@pytest.mark.parametrize("value", [0, -2, "0", "-1", "tree", "", "2.5", 2.5, True, [2], "k-ary"])
def test_parse_tree_kind_rejects(value):
    with pytest.raises(ValueError):
        parse_tree_kind(value)


def test_parse_tree_kind_numpy_int():
    np = pytest.importorskip("numpy")
    assert parse_tree_kind(np.int64(3)) == 3


# --------------------------------------------------------------------------- simple kinds


@pytest.mark.parametrize("size", SIZES)
def test_simple_kinds(size):
    chain = build_tree("chain", size)
    check_common(chain, size)
    assert chain.depth == size - 1 and chain.ring == tuple(range(size))
    assert chain.parent == tuple(range(-1, size - 1))

    ring = build_tree("ring", size)
    check_common(ring, size)
    assert ring.kind == "ring" and ring.parent == chain.parent and ring.ring == chain.ring

    flat = build_tree("flat", size)
    check_common(flat, size)
    assert flat.depth == min(1, size - 1) and flat.children[0] == tuple(range(1, size))

    binary = build_tree("binary", size)
    check_common(binary, size)
    assert binary.kind == "binary" and binary.depth == size.bit_length() - 1


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 100])
def test_kary(k):
    for size in SIZES:
        tree = build_tree(k, size)
        check_common(tree, size)
        assert tree.kind == f"{k}-ary" and tree.depth == kary_depth(size, k)
        assert all(len(c) <= k for c in tree.children)
        assert all(tree.parent[r] == (r - 1) // k for r in range(1, size))
    assert build_tree(str(k), 20) == build_tree(k, 20)


def test_one_is_a_chain_and_two_is_binary():
    assert build_tree(1, 9).parent == build_tree("chain", 9).parent
    assert build_tree(2, 9).parent == build_tree("binary", 9).parent


def test_single_rank():
    for kind in ("chain", "binary", "flat", "ring", 3, "topology", "auto"):
        tree = build_tree(kind, 1, "2x4")
        assert tree.depth == 0 and tree.ring == (0,) and tree.edges() == []
        assert tree.draw() == "0" and tree.is_leaf(0)


@pytest.mark.parametrize("size", [0, -1, "3", 2.5, True, None])
def test_bad_size(size):
    with pytest.raises(ValueError, match="size"):
        build_tree("chain", size)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown tree kind"):
        build_tree("star", 4)
    with pytest.raises(ValueError, match="policy"):
        build_tree("topology", 4, "2x4", placement="scatter")
    with pytest.raises(ValueError, match="message_bytes"):
        build_tree("auto", 4, "2x4", message_bytes=-1)


# --------------------------------------------------------------------------- Tree


def test_tree_is_frozen_hashable_and_deterministic():
    tree = build_tree("topology", 12, "2x2x4", message_bytes=100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.root = 1
    assert tree == build_tree("topology", 12, "2x2x4", message_bytes=100)
    assert hash(tree) == hash(build_tree("topology", 12, "2x2x4", message_bytes=100))
    assert Tree("chain", 2, 0, [-1, 0], [[1], []]) == build_tree("chain", 2)


def test_draw():
    assert build_tree("binary", 6).draw() == "\n".join([
        "0",
        "|-- 1",
        "|   |-- 3",
        "|   `-- 4",
        "`-- 2",
        "    `-- 5",
    ])
    labelled = build_tree("flat", 3).draw(labels=["root", "a", "b"])
    assert labelled.splitlines() == ["0 root", "|-- 1 a", "`-- 2 b"]
    assert build_tree("flat", 2).draw(labels=lambda r: f"<{r}>").endswith("`-- 1 <1>")


@pytest.mark.parametrize("parent, children, root", [
    ((-1, 0, 1), ((1,), (2,), ()), 1),             # root has a parent
    ((-1, 0, 0), ((1,), (), ()), 0),               # 2 missing from children[0]
    ((-1, 2, 1), ((), (2,), (1,)), 0),             # cycle 1 <-> 2, unreachable
    ((-1, 0), ((1, 1), ()), 0),                    # duplicate child
    ((-1, 0, 5), ((1,), (), ()), 0),               # parent out of range
    ((-1, 0), ((1,), (), ()), 0),                  # wrong length
])
def test_validate_rejects(parent, children, root):
    with pytest.raises(AssertionError):
        Tree("custom", len(parent), root, parent, children).validate()


# --------------------------------------------------------------------------- topology trees


def check_hierarchy(tree, slots, star):
    """Socket/NUMA/L3 crossing property and leader links (see the module docstring)."""
    size = tree.size
    up_leader = [0] * size  # leader of each rank's enclosing group (the machine: rank 0)
    up_keys = [()] * size
    for level, group_of in LEVELS.items():
        keys = [group_of(slots[r]) for r in range(size)]
        leader = {}
        for r in range(size):
            leader.setdefault(keys[r], r)  # lowest rank
        entries = dict.fromkeys(leader, 0)
        for child, par in tree.edges():
            if keys[child] != keys[par]:  # the edge enters the child's group
                assert child == leader[keys[child]], (level, child, par)
                entries[keys[child]] += 1
                if up_keys[child] == up_keys[par]:  # ... from within the enclosing group
                    assert par == up_leader[child], (level, child, par)
        for g, count in entries.items():
            assert count == (0 if g == keys[0] else 1), (level, g)
        up_leader = [leader[keys[r]] for r in range(size)]
        up_keys = keys
    previous = {}  # L3 leader -> last member seen
    for r in range(size):
        if r != up_leader[r]:  # an ordinary member of an L3 group: star or chain link
            assert tree.parent[r] == (up_leader[r] if star else previous[up_leader[r]])
        previous[up_leader[r]] = r


def topology_sizes(topo):
    """1..ncpus plus a few oversubscribed sizes."""
    n = topo.ncpus
    return list(range(1, n + 1)) + [n + 1, n + 7, 2 * n + 3]


def test_check_hierarchy_catches_a_bad_tree():
    slots = Topology.from_spec("2x4").placement(8, "spread")  # sockets alternate
    with pytest.raises(AssertionError):
        check_hierarchy(build_tree("chain", 8), slots, star=False)
    with pytest.raises(AssertionError):
        check_hierarchy(build_tree("flat", 8), slots, star=True)


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("policy", ["compact", "spread"])
def test_topology_tree(machine, policy):
    topo = Topology.resolve(machine)
    for size in topology_sizes(topo):
        slots = topo.placement(size, policy)
        for message_bytes, star in ((None, False), (100, True)):
            tree = build_tree("topology", size, topo, placement=policy,
                              message_bytes=message_bytes)
            check_common(tree, size)
            assert tree.kind == "topology"
            check_hierarchy(tree, slots, star)
            if star:
                assert tree.depth <= 4  # socket, node, L3 leader, member


def test_topology_tree_shapes():
    tree = build_tree("topology", 16, "2x2x4")
    assert tree.children[0] == (1, 4, 8) and tree.children[8] == (9, 12)
    assert tree.ring == tuple(range(16)) and tree.depth == 5
    assert build_tree("topology", 16, "2x2x4", message_bytes=SMALL_MESSAGE_BYTES) == tree
    assert build_tree("topology", 16, "2x2x4", message_bytes=SMALL_MESSAGE_BYTES - 1) != tree
    star = build_tree("topology", 16, "2x2x4", message_bytes=1)
    assert star.children[0] == (1, 2, 3, 4, 8) and star.depth == 3
    spread = build_tree("topology", 4, "2x2x4", placement="spread")
    assert spread.parent == (-1, 0, 0, 1)  # ranks 0,2 on socket 0; 1,3 on socket 1


def test_topology_tree_on_flat_machine_is_chain_or_star():
    assert build_tree("topology", 8, "1x8").parent == build_tree("chain", 8).parent
    assert build_tree("topology", 8, "1x8", message_bytes=8).parent == \
        build_tree("flat", 8).parent


def test_snc_l3_spanning_nodes_is_split_by_node():
    topo = Topology.fixture("xeon-2s-snc2")
    tree = build_tree("topology", 56, topo)
    assert tree.parent[28] == 0  # node 1's leader hangs off the socket leader
    assert tree.parent[29] == 28


# --------------------------------------------------------------------------- auto


@pytest.mark.parametrize("machine", ["1x8", "1x16:2", "laptop-4c"])
def test_auto_on_flat_machine(machine):
    for size in (1, 2, AUTO_FLAT_MAX_SIZE, AUTO_FLAT_MAX_SIZE + 1, 40):
        small = "flat" if size <= AUTO_FLAT_MAX_SIZE else "4-ary"
        for message_bytes in (None, 0, SMALL_MESSAGE_BYTES - 1):
            tree = build_tree("auto", size, machine, message_bytes=message_bytes)
            assert tree.kind == small and tree == build_tree(tree.kind, size)
        for message_bytes in (SMALL_MESSAGE_BYTES, 1 << 30):
            tree = build_tree("auto", size, machine, message_bytes=message_bytes)
            assert tree.kind == "chain"


@pytest.mark.parametrize("machine", MULTI_LEVEL)
def test_auto_on_multi_level_machine(machine):
    topo = Topology.resolve(machine)
    for message_bytes in (None, 8, 1 << 20):
        tree = build_tree("auto", 24, topo, message_bytes=message_bytes)
        assert tree == build_tree("topology", 24, topo, message_bytes=message_bytes)


def test_auto_detects_this_machine():
    tree = build_tree("auto", 6)
    expected = "topology" if Topology.detect().multi_level else "flat"
    assert tree.kind == expected and tree.size == 6
