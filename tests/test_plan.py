"""The planner as pure data (no processes): every option set and machine gives a valid plan that
the Group runs, the digest names it, and the collectives always have a ring to run around."""
import os
import pickle
from pathlib import Path

import pytest

import shmtree
from shmtree.machine.plan import plan_group
from shmtree.machine.topology import Topology

MACHINES = ["2x4", "2x2x4", "1x8"] + Topology.fixtures()
TREES = [None, "chain", "binary", "flat", "ring", "topology", 3]


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("tree", TREES)
def test_every_plan_is_valid(machine, tree):
    for P in [1, 2, 3, 5, 8, 13, 32, 64]:
        for ncpus in (2, 64):
            plan = plan_group(P, topology=machine, tree=tree, ncpus=ncpus)
            for t in (plan.small_tree, plan.large_tree):
                t.validate()
                assert t.size == P and sorted(t.ring) == list(range(P))
            assert plan.large_schedule in ("tree", "ring")
            # the collectives other than allreduce run around the large tree's ring: on the
            # bandwidth channel under the ring schedule, else on a ring channel of their own
            assert plan.ring_channel == (plan.large_schedule == "tree" and P > 1)
            if plan.large_schedule == "ring":
                assert plan.slots >= 2
            assert plan.oversubscribed == (P > ncpus)
            assert plan.small_bytes == (64 * 1024 if P > ncpus else 4096)
            assert pickle.loads(pickle.dumps(plan)).digest() == plan.digest()
            assert f"group of {P} rank(s)" in plan.describe()


def test_digest_tells_plans_apart():
    seen = {}
    for P in (2, 3, 4):
        for tree in TREES:
            for chunk in (4096, 65536):
                d = plan_group(P, topology="2x2", tree=tree, chunk_bytes=chunk, ncpus=8).digest()
                seen.setdefault(d, []).append((P, tree, chunk))
    assert all(len(keys) == 1 for keys in seen.values()), seen     # every option set its own
    assert plan_group(3, topology="2x2", ncpus=8).digest() == \
        plan_group(3, topology="2x2", ncpus=8).digest()              # and the same one again


@pytest.mark.timeout(30)
def test_group_runs_its_plan():
    with shmtree.Group(4, topology="2x2", tree="binary", chunk_bytes=8192) as g:
        assert g.plan == plan_group(4, topology="2x2", tree="binary", chunk_bytes=8192)
        assert len(g.layout.channels) == 3 and g.layout.channels[2].ring
    with shmtree.Group(4, topology="2x2", tree="ring") as g:
        assert len(g.layout.channels) == 2 and g.layout.channels[1].ring


@pytest.mark.parametrize("bad", [dict(chunk_bytes=0), dict(slots=0), dict(placement="x"),
                                 dict(numa="y"), dict(spin_us=-1), dict(stall_timeout=0),
                                 dict(tree="nope")])
def test_bad_options_refused(bad):
    with pytest.raises(ValueError):
        plan_group(2, **bad)


def test_the_plan_names_each_collectives_algorithm():
    for P in (1, 2, 5):
        for tree in (None, "binary", "ring"):
            plan = plan_group(P, topology="2x2", tree=tree, ncpus=8)
            for coll in ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter"):
                for nbytes in (0, 8, plan.small_bytes, plan.small_bytes + 1, 1 << 26):
                    alg = plan.algorithm(coll, nbytes)
                    if P == 1:
                        assert alg == "copy"
                    elif nbytes <= plan.small_bytes:
                        assert alg == "inline"
                    elif coll == "allreduce":
                        assert alg == plan.large_schedule
                    else:
                        assert alg == ("chain" if coll in ("broadcast", "reduce") else "blocks")
    with pytest.raises(ValueError, match="unknown collective"):
        plan_group(2).algorithm("gather", 8)


# issue 21, item 20: the plan counts the cgroup's CPU quota among the usable cores

QUOTA_SYSFS = Path(__file__).resolve().parent / "fixtures_sysfs"


def test_usable_count_is_limited_by_the_cpu_quota():
    import shmtree.machine.plan as plan
    cpus = len(os.sched_getaffinity(0))
    assert plan.usable_count(QUOTA_SYSFS / "cgroup_v2_unlimited") == cpus
    assert plan.usable_count(QUOTA_SYSFS / "cgroup_v1_quota") == 1         # 0.5 CPU: one
    assert plan.usable_count(QUOTA_SYSFS / "cgroup_v2_quota") == min(cpus, 2)
    assert plan.usable_count(QUOTA_SYSFS / "cgroup_hybrid") == min(cpus, 3)


@pytest.mark.timeout(60)
def test_a_group_in_a_container_with_a_quota_is_oversubscribed(monkeypatch):
    """A container limited to 2 CPUs on a 64-core host: Pool(os.cpu_count()) planned as if it
    had 64 cores (spinning, the small inline limit, pinning).  Here: a quota of half a CPU."""
    import shmtree.machine.plan as plan
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable CPUs to tell the quota from the mask")
    monkeypatch.setattr(plan, "SYSFS_ROOT", str(QUOTA_SYSFS / "cgroup_v2_unlimited"))
    free = plan_group(2)
    assert free.ncpus >= 2 and not free.oversubscribed and free.spin_ns > 0
    monkeypatch.setattr(plan, "SYSFS_ROOT", str(QUOTA_SYSFS / "cgroup_v1_quota"))
    with shmtree.Group(2) as group:
        p = group.plan
        assert p.ncpus == 1 and p.oversubscribed
        assert p.spin_ns == 0 and p.small_bytes == plan.OVERSUBSCRIBED_SMALL_BYTES
        assert not p.pin
        assert "1 usable core(s) (oversubscribed)" in p.describe()


def _pool_size_task(_):
    return shmtree.size()


@pytest.mark.timeout(120)
def test_pool_without_a_size_has_one_worker_per_core_the_quota_allows(monkeypatch):
    """Pool() sizes itself by the cores it can keep busy: the CPU quota, not only the mask."""
    import shmtree.machine.plan as plan
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable CPUs to tell the quota from the mask")
    monkeypatch.setattr(plan, "SYSFS_ROOT", str(QUOTA_SYSFS / "cgroup_v1_quota"))
    with shmtree.Pool() as pool:
        assert pool.map(_pool_size_task, range(1)) == [1]
    monkeypatch.setattr(plan, "SYSFS_ROOT", str(QUOTA_SYSFS / "cgroup_v2_unlimited"))
    with shmtree.Pool() as pool:
        n = len(os.sched_getaffinity(0))
        assert pool.map(_pool_size_task, range(n)) == [n] * n
