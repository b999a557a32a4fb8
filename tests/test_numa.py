"""NUMA placement of ring pages: the policy, and reading back where the pages are."""
import numpy as np
import pytest

import shmtree


def placement_worker(comm):
    y = comm.allreduce(np.ones(300_000))            # through both channels
    return float(y[0]), comm.group.numa, comm.group.numa_errno, comm.ring_placement()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numa", ["consumer", "producer", "interleave", None, "auto"])
def test_ring_pages_are_placed_and_read_back(numa):
    P = 3
    results = shmtree.run(placement_worker, P, numa=numa, tree="chain")
    detected = shmtree.Topology.detect()
    for value, policy, err, rings in results:
        assert value == P
        if numa == "auto":
            assert policy == ("consumer" if detected.nnodes > 1 else None)
        else:
            assert policy == numa
        if rings is None:                     # the kernel refused move_pages: nothing to check
            continue
        assert rings, "every rank of a chain of 3 produces rings"
        nodes = {n for n in detected_nodes(detected)}
        for ring in rings:
            pages = ring["pages"]
            assert sum(pages.values()) * 4096 >= ring["bytes"] - 4095
            # every page was touched at join (no -2 = "not present") and sits on a real node
            assert all(node in nodes for node in pages), (ring, nodes)
            if policy in ("consumer", "producer") and err is None and len(nodes) > 1:
                assert len(pages) == 1


def detected_nodes(topology):
    return {slot.numa for slot in topology.slots}


def test_numa_policy_is_validated():
    with pytest.raises(ValueError, match="numa"):
        shmtree.Group(2, numa="somewhere")


def test_synthetic_topology_binds_nothing():
    with shmtree.Group(8, topology="2x2x2", numa="consumer") as group:
        assert group.numa is None             # its nodes do not exist on this machine
        assert group.pin is False


def test_ring_placement_before_join_shows_untouched_pages():
    with shmtree.Group(2, numa=None) as group:
        rings = group.ring_placement()
        if rings is None:
            pytest.skip("move_pages is not allowed here")
        # nobody joined: the pages of the rings were never touched (-2: ENOENT)
        assert all(set(r["pages"]) == {-2} for r in rings)
