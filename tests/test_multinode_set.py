"""alltoall, gather, scatter, scan and exscan across nodes (DESIGN sections 9 and 11):
tests/mpi_nodes_prog.py's mode `set` under the mpich wheel's mpiexec, as test_multinode.py runs
its modes (a session of its own, killed whole on a timeout, nothing left behind).

Each run checks every new collective against numpy on every rank and, under from_mpi, against
MPI's own Alltoall(v), Gather(v), Scatter(v), Scan and Exscan on the same inputs; the same bits
on every rank; an i-form of each and persistent forms; then a mismatch of each kind in one
node, raising CollectiveMismatchError on every rank of every node with the same text."""
import pytest
from test_multinode import _launch, _reports

pytest.importorskip("mpi4py")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode,nprocs,size", [
    ("set", 4, 2),            # 2 nodes of 2 (from_mpi: lanes)
    ("set", 5, 3),            # nodes of 3 and 2
    ("set", 5, 2),            # 3 nodes: 2, 2, 1
    ("set-rr", 5, 2),         # 3 nodes of ranks dealt round-robin: {0,3} {1,4} {2}
    ("launch-set", 2, 2),     # launchers: nodes of 2 and 3 workers
], ids=["from_mpi 2x2", "from_mpi 3+2", "from_mpi 2+2+1", "from_mpi round-robin 2+2+1",
        "launchers 2+3"])
def test_the_complete_set_across_nodes(mode, nprocs, size):
    rc, out, _ = _launch(nprocs, mode, size)
    assert rc == 0 and f"OK {mode.removesuffix('-rr')}" in out, out[-4000:]


@pytest.mark.timeout(200)
def test_the_complete_set_in_a_launchers_small_slots():
    """Segments of 4 KiB: a launcher's mailbox takes the exchanges between the nodes in many
    rounds, and the agreement's tables node by node."""
    rc, out, _ = _launch(2, "launch-set", 1, segment=4096)
    assert rc == 0 and "OK launch-set" in out, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,node_size", [(5, 3), (4, 2)], ids=["leaders 3+2", "lanes 2x2"])
def test_a_failure_inside_an_exchange_reaches_every_node(nprocs, node_size):
    """Rank 0 fails inside alltoall's exchange across nodes: every rank of every node raises
    (none waits in its node or in Link.exchange between the nodes), naming the call."""
    rc, out, _ = _launch(nprocs, "setfail", node_size, timeout=90)
    assert rc == 0 and "OK setfail" in out, out[-4000:]
    raised = _reports(out, r"rank \d+ raised ")
    assert sorted(int(r.split()[1]) for r in raised) == list(range(nprocs)), out[-4000:]
