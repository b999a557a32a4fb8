"""Tests for shmtree.machine.topology: sysfs detection, specs, JSON, fixtures and placement.

Detection runs against small fake sysfs trees in tests/fixtures_sysfs/ and against sysfs trees
written on the fly from the shipped machine fixtures (detect(write(fixture)) == fixture).
No processes are started.
"""

import json
import os
from pathlib import Path

import pytest

from shmtree.machine.topology import Slot, Topology, parse_cpulist

SYSFS = Path(__file__).resolve().parent / "fixtures_sysfs"
FIXTURES = Topology.fixtures()

# name -> (nsockets, nnodes, nl3, ncores, ncpus)
FIXTURE_SHAPES = {
    "xeon-2s-snc2": (2, 4, 2, 112, 224),
    "epyc-2s-nps4": (2, 8, 16, 128, 256),
    "xeon-4s": (4, 4, 4, 96, 96),
    "laptop-4c": (1, 1, 1, 4, 8),
}


def shape(topo):
    return (topo.nsockets, topo.nnodes, topo.nl3, topo.ncores, topo.ncpus)


def write_fake_sysfs(topo, root):
    """Write the sysfs files Topology.detect reads, describing `topo` (real cpu ids)."""
    cpu_dir = root / "devices/system/cpu"

    def put(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def cpulist(cpus):
        return ",".join(str(c) for c in sorted(cpus))

    cores, l3s, nodes = {}, {}, {}  # id -> cpus
    for s in topo.slots:
        cores.setdefault(s.core, []).append(s.cpu)
        l3s.setdefault(s.l3, []).append(s.cpu)
        nodes.setdefault(s.numa, []).append(s.cpu)
    first_core = {}
    for s in topo.slots:
        first_core.setdefault(s.socket, s.core)
    for s in topo.slots:
        d = cpu_dir / f"cpu{s.cpu}"
        put(d / "topology/physical_package_id", str(s.socket))
        put(d / "topology/core_id", str(s.core - first_core[s.socket]))
        put(d / "topology/thread_siblings_list", cpulist(cores[s.core]))
        put(d / "cache/index2/level", "2")
        put(d / "cache/index2/shared_cpu_list", cpulist(cores[s.core]))
        put(d / "cache/index3/level", "3")
        put(d / "cache/index3/shared_cpu_list", cpulist(l3s[s.l3]))
    for n, cpus in nodes.items():
        put(root / f"devices/system/node/node{n}/cpulist", cpulist(cpus))
    put(cpu_dir / "online", cpulist(topo.cpus))
    return root


# --------------------------------------------------------------------------- cpulists


@pytest.mark.parametrize("text, cpus", [
    ("", []), ("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,4-5", [0, 1, 4, 5]),
    (" 7,2-3 \n", [2, 3, 7]), ("3,3", [3]),
])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "1-2-3"])
def test_parse_cpulist_rejects(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


# --------------------------------------------------------------------------- detect


def test_detect_two_socket_smt():
    topo = Topology.detect(SYSFS / "two_socket_smt")
    assert shape(topo) == (2, 2, 2, 4, 8)  # cpu8 is offline
    assert topo.cpus == tuple(range(8))
    by_cpu = {s.cpu: s for s in topo.slots}
    assert by_cpu[0].core == by_cpu[4].core and (by_cpu[0].smt, by_cpu[4].smt) == (0, 1)
    assert by_cpu[0].core != by_cpu[2].core  # same core_id, other socket
    assert {s.numa for s in topo.slots if s.socket == 1} == {1}
    assert topo.multi_level and not topo.is_flat and not topo.synthetic
    assert topo.to_spec() == "2x2:2"


def test_detect_without_node_and_cache_dirs():
    topo = Topology.detect(SYSFS / "no_node_no_cache")
    assert shape(topo) == (1, 1, 1, 2, 4)
    assert [s.smt for s in topo.slots] == [0, 1, 0, 1]
    assert topo.is_flat


def test_detect_core_id_only():
    topo = Topology.detect(SYSFS / "core_id_only")
    assert shape(topo) == (1, 1, 1, 2, 4)
    assert [s.core for s in topo.slots] == [0, 0, 1, 1]


@pytest.mark.parametrize("allowed, expect_shape, expect_smt", [
    ({0, 2, 4}, (2, 2, 2, 2, 3), [0, 0, 1]),
    ({4, 5}, (1, 1, 1, 2, 2), [0, 0]),  # second threads only: renumbered smt 0
    (range(100), (2, 2, 2, 4, 8), [0, 0, 0, 0, 1, 1, 1, 1]),
])
def test_detect_allowed_cpus(allowed, expect_shape, expect_smt):
    topo = Topology.detect(SYSFS / "two_socket_smt", allowed_cpus=allowed)
    assert shape(topo) == expect_shape
    assert [s.smt for s in topo.slots] == expect_smt
    assert set(topo.cpus) <= set(allowed)


def test_detect_allowed_cpus_nothing_left():
    with pytest.raises(ValueError, match="no allowed CPU"):
        Topology.detect(SYSFS / "two_socket_smt", allowed_cpus={42})


def test_detect_missing_sysfs_falls_back(tmp_path):
    topo = Topology.detect(tmp_path / "nothing", allowed_cpus={0, 1, 5})
    assert topo.cpus == (0, 1, 5) and shape(topo) == (1, 1, 1, 3, 3)
    assert Topology.detect(tmp_path / "nothing").ncpus >= 1


def test_detect_live_machine_honours_affinity():
    topo = Topology.detect()
    assert set(topo.cpus) == set(os.sched_getaffinity(0))
    assert topo.ncores <= topo.ncpus
    assert Topology.resolve(None) == topo


@pytest.fixture(scope="module")
def fixture_sysfs(tmp_path_factory):
    """name -> root of a fake sysfs tree describing that machine fixture (written once)."""
    roots = {}

    def get(name):
        if name not in roots:
            roots[name] = write_fake_sysfs(Topology.fixture(name), tmp_path_factory.mktemp(name))
        return roots[name]
    return get


@pytest.mark.parametrize("name", FIXTURES)
def test_detect_reproduces_fixture_from_fake_sysfs(name, fixture_sysfs):
    assert Topology.detect(fixture_sysfs(name)) == Topology.fixture(name)


def test_detect_fixture_sysfs_with_cpuset(fixture_sysfs):
    root = fixture_sysfs("epyc-2s-nps4")
    topo = Topology.detect(root, allowed_cpus=range(16, 32))  # one NUMA node, thread 0 only
    assert shape(topo) == (1, 1, 2, 16, 16)
    assert all(s.smt == 0 for s in topo.slots)


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize("spec, expect_shape, threads", [
    ("8", (1, 1, 1, 8, 8), 1),
    ("2x4", (2, 2, 2, 8, 8), 1),
    ("2x2x4", (2, 4, 4, 16, 16), 1),
    ("2x2x2x4", (2, 4, 8, 32, 32), 1),
    ("2x4:2", (2, 2, 2, 8, 16), 2),
    (" 4 X 8 ", (4, 4, 4, 32, 32), 1),
    ("1x1x1x1:1", (1, 1, 1, 1, 1), 1),
])
def test_from_spec(spec, expect_shape, threads):
    topo = Topology.from_spec(spec)
    assert shape(topo) == expect_shape
    assert topo.synthetic and topo.cpus == () and all(s.cpu is None for s in topo.slots)
    assert max(s.smt for s in topo.slots) == threads - 1
    assert Topology.from_spec(topo.to_spec()) == topo
    assert topo.multi_level == (expect_shape[0] > 1 or expect_shape[1] > 1)


@pytest.mark.parametrize("spec", [
    "", "x", "0x4", "2x0", "2x", "x4", "2x2x2x2x2", "2x4:0", "2x4:", "abc", "2*4", "2x4x",
    "-2x4", "2.5x4", "256x256x256", None, 8,
])
def test_from_spec_rejects(spec):
    with pytest.raises(ValueError):
        Topology.from_spec(spec)


def test_spec_layout_nests():
    topo = Topology.from_spec("2x2x2x3:2")
    for s in topo.slots:
        assert s.numa // 2 == s.socket and s.l3 // 2 == s.numa and s.core // 3 == s.l3


# --------------------------------------------------------------------------- JSON, fixtures


def test_fixture_names():
    assert set(FIXTURES) == set(FIXTURE_SHAPES)
    with pytest.raises(ValueError, match="unknown topology fixture"):
        Topology.fixture("no-such-machine")


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_shape_and_json_round_trip(name, tmp_path):
    topo = Topology.fixture(name)
    assert shape(topo) == FIXTURE_SHAPES[name]
    assert topo.name == name and topo.note and not topo.synthetic
    assert Topology.from_dict(json.loads(json.dumps(topo.to_dict()))) == topo
    path = tmp_path / "t.json"
    topo.dump(path)
    again = Topology.load(path)
    assert again == topo and again.name == name and again.note == topo.note
    assert Topology.resolve(str(path)) == topo and Topology.resolve(path) == topo
    assert Topology.resolve(name) == topo


@pytest.mark.parametrize("spec", ["2x4", "2x2x4:2"])
def test_synthetic_json_round_trip(spec, tmp_path):
    topo = Topology.from_spec(spec)
    topo.dump(tmp_path / "s.json")
    assert Topology.load(tmp_path / "s.json") == topo


def test_from_dict_accepts_mapping_slots_and_rejects_bad_documents():
    rows = [{"cpu": 3, "socket": 0, "numa": 0, "l3": 0, "core": 0, "smt": 0},
            {"cpu": 1, "socket": 0, "numa": 0, "l3": 0, "core": 1, "smt": 0}]
    topo = Topology.from_dict({"slots": rows})
    assert topo.cpus == (1, 3)
    with pytest.raises(ValueError):
        Topology.from_dict({"format": "other", "slots": rows})
    with pytest.raises(ValueError):
        Topology.from_dict({"version": 99, "slots": rows})
    with pytest.raises(ValueError):
        Topology.from_dict({"fields": ["cpu"], "slots": [[0]]})
    with pytest.raises(ValueError):
        Topology.from_dict({"nothing": []})


@pytest.mark.parametrize("slots, match", [
    ([], "at least one CPU"),
    ([(0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 1, 0)], "duplicate cpu"),
    ([(0, 0, 0, 0, 0, 0), (None, 0, 0, 0, 1, 0)], "every slot"),
    ([(0, 0, 0, 0, 0, 0), (1, 0, 1, 0, 0, 1)], "spans"),
    ([(0, 0, 0, 0, -1, 0)], ">= 0"),
    ([(0, 0, 0, 0, 0)], "fields"),
    ([{"cpu": 0, "socket": 0}], "lacks"),
])
def test_constructor_rejects(slots, match):
    with pytest.raises(ValueError, match=match):
        Topology(slots)


def test_constructor_canonicalises_ids():
    topo = Topology([(9, 1, 3, 7, 5, 1), (8, 1, 3, 7, 5, 0), (2, 0, 0, 7, 5, 0)])
    assert topo.slots == (Slot(2, 0, 0, 0, 0, 0), Slot(8, 1, 3, 1, 1, 0), Slot(9, 1, 3, 1, 1, 1))


def test_resolve():
    topo = Topology.from_spec("2x4")
    assert Topology.resolve(topo) is topo
    assert Topology.resolve("2x2x4") == Topology.from_spec("2x2x4")
    assert Topology.resolve(topo.to_dict()) == topo
    with pytest.raises(ValueError, match="neither a spec"):
        Topology.resolve("no/such/file.json")
    with pytest.raises(TypeError):
        Topology.resolve(3.5)


def test_equality_describe_repr():
    a, b = Topology.from_spec("2x4"), Topology.from_spec("2x4")
    b.name = "other"
    assert a == b and hash(a) == hash(b) and a != Topology.from_spec("4x2")
    assert a != "2x4"
    text = Topology.fixture("xeon-2s-snc2").describe()
    assert "xeon-2s-snc2" in text and "2x2x28:2" in text and "224 CPUs" in text
    assert "2x4" in repr(a) and "synthetic" in repr(a)
    irregular = Topology([(0, 0, 0, 0, 0, 0), (1, 0, 0, 0, 1, 0), (2, 1, 1, 1, 2, 0)])
    assert irregular.to_spec() is None and "2 socket(s)" in irregular.describe()


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("name", FIXTURES + ["2x4", "2x2x2x4:2"])
@pytest.mark.parametrize("policy", ["compact", "spread"])
def test_placement_cores_before_smt_and_wraps(name, policy):
    topo = Topology.resolve(name)
    cores = topo.placement(topo.ncores, policy)
    assert len({s.core for s in cores}) == topo.ncores and all(s.smt == 0 for s in cores)
    full = topo.placement(topo.ncpus, policy)
    assert sorted(full) == sorted(topo.slots)
    over = topo.placement(2 * topo.ncpus + 3, policy)
    assert all(over[i] == full[i % topo.ncpus] for i in range(len(over)))


def test_placement_compact_fills_socket_zero_first():
    topo = Topology.fixture("xeon-2s-snc2")
    slots = topo.placement(56)
    assert {s.socket for s in slots} == {0}
    assert [s.cpu for s in slots] == list(range(56))
    assert [s.numa for s in slots[:28]] == [0] * 28
    assert [s.cpu for s in Topology.fixture("laptop-4c").placement(6)] == [0, 1, 2, 3, 4, 5]


def test_placement_spread_round_robins():
    epyc = Topology.fixture("epyc-2s-nps4")
    assert [s.socket for s in epyc.placement(4, "spread")] == [0, 1, 0, 1]
    assert len({s.numa for s in epyc.placement(8, "spread")}) == 8
    assert len({s.l3 for s in epyc.placement(16, "spread")}) == 16
    quad = Topology.fixture("xeon-4s")
    assert [s.cpu for s in quad.placement(6, "spread")] == [0, 24, 48, 72, 1, 25]


def test_placement_errors_and_empty():
    topo = Topology.from_spec("2x4")
    assert topo.placement(0) == []
    with pytest.raises(ValueError, match="policy"):
        topo.placement(4, "scatter")
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError):
            topo.placement(bad)


# --------------------------------------------------------------------------- cgroup CPU quota
# (issue 21, item 20: the usable cores of a container limited to 2 CPUs on a 64-core host are 2)


@pytest.mark.parametrize("tree, cgroup, quota", [
    ("cgroup_v2_quota", None, 2.0),                 # cpu.max "200000 100000" at the root
    ("cgroup_v2_unlimited", None, None),            # "max 100000"
    ("cgroup_v2_nested", "/app/job", 1.5),          # the tightest of the cgroup and ancestors
    ("cgroup_v2_nested", "/app", None),
    ("cgroup_v2_nested", "/docker/0123abcd", None),  # a host's path inside a container: mount
    ("cgroup_v1_quota", None, 0.5),                 # cpu,cpuacct/cpu.cfs_quota_us 50000
    ("cgroup_hybrid", None, 3.0),                   # v2 "unified" beside v1's cpu controller
    ("two_socket_smt", None, None),                 # no cgroup tree at all
])
def test_cpu_quota(tree, cgroup, quota):
    from shmtree.machine.topology import cpu_quota
    assert cpu_quota(SYSFS / tree, cgroup) == quota


def test_cpu_quota_of_the_live_machine_reads_this_process_cgroup():
    from shmtree.machine.topology import cpu_quota
    got = cpu_quota()
    assert got is None or got > 0
