"""shmtree.from_mpi across simulated nodes: tests/mpi_nodes_prog.py under the mpich wheel's
mpiexec, in a session of its own (killed whole on a timeout), nothing left behind."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import classify_shm, split_foreign, watcher_verdicts

pytest.importorskip("mpi4py")

PROG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_nodes_prog.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def _shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _reports(out, head):
    """The reports in mpiexec's output that begin with the regular expression `head`, each up to
    the end of its line or the next report: the ranks' lines reach mpiexec through separate
    pipes, and now and then one arrives glued to another without its newline."""
    starts = [m.start() for m in re.finditer(head, out)]
    return [out[a:b].split("\n")[0] for a, b in zip(starts, starts[1:] + [len(out)])]


def _launch(nprocs, mode, node_size, timeout=120, segment=None, start=None):
    """(returncode, output, ended) of `mpiexec -n nprocs prog mode node_size` (ended: the
    time.monotonic() at which mpiexec ended; segment: the segment_bytes option; start: the
    launchers' start method)."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    before = _shm()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), _import_root()) if p]))
    if segment is not None:
        env["PROG_SEGMENT"] = str(segment)
    if start is not None:
        env["PROG_START"] = start
    t0 = time.monotonic()
    proc = subprocess.Popen([mpiexec, "-n", str(nprocs), sys.executable, PROG, mode,
                             str(node_size)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
        ended = time.monotonic()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec -n {nprocs} {mode} hung:\n{out.decode(errors='replace')[-3000:]}")
    finally:
        _reap(proc.pid)
        _unlink_own_mpich_segments(before)
    leaked, _ = split_foreign(sorted(_shm() - before))   # (others' jobs: conftest warns)
    assert not leaked, f"left in /dev/shm: {leaked}"
    return proc.returncode, out.decode(errors="replace"), ended


# the job must end once one of its processes is killed: within this of the kill (a hang bound:
# the others would run on for 60 s, and then wait for the dead one for ever)
KILL_ENDS_JOB_S = 30


def _since_kill(out, ended):
    """Seconds from the kill that mpi_nodes_prog.killed reported in `out` to the job's end."""
    stamps = re.findall(r"killed at ([\d.]+)", out)
    assert len(stamps) == 1, out[-4000:]
    return ended - float(stamps[0])


def _unlink_own_mpich_segments(before):
    """MPICH's own segments that a killed job leaves: only this job's, never another job's on
    the machine.  An entry new since `before` is this job's when a process of the test's tree
    holds it, or when nobody holds it and the session's watcher (conftest, tests/shm_watch.py)
    did not see it held by another job: the job's processes are gone by now (_reap)."""
    new = [n for n in sorted(_shm() - before) if n.startswith("mpich_shm_")]
    ours, _, unheld = classify_shm(new)
    seen = watcher_verdicts()
    for name in ours + [n for n in unheld if seen.get(n) != "foreign"]:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


def _import_root():
    """Where `import shmtree` finds this checkout's package (an in-place build), else None:
    the installed one is used."""
    import shmtree
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(shmtree.__file__)))
    return pkg


def _reap(pgid):
    """No process of the job's session may outlive the test."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    pytest.fail("processes of the MPI job were still alive 10 s after it ended")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nprocs,node_size", [(4, 2), (3, 2), (4, 3), (3, 1), (5, 2)],
                         ids=["2x2", "2+1", "3+1", "1+1+1", "2+2+1"])
def test_every_collective_across_nodes(nprocs, node_size):
    rc, out, _ = _launch(nprocs, "collectives", node_size)
    assert rc == 0 and "OK collectives" in out, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,node_size", [(4, 2), (3, 2), (2, 2)], ids=["2x2", "2+1", "1"])
def test_what_the_parse_accepts_runs_across_nodes(nprocs, node_size):
    """calls.py decides what a call may be, for one node and across nodes alike: out= as a
    writable buffer, broadcast with only out= (a wrong shape: a mismatch on every rank),
    reduce_scatter into out= (mpi_nodes_prog.mode_parsed)."""
    rc, out, _ = _launch(nprocs, "parsed", node_size)
    assert rc == 0 and "OK parsed" in out, out[-4000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode,nprocs,size", [("collectives", 3, 2), ("collectives", 4, 2),
                                              ("launch-collectives", 2, 1)],
                         ids=["from_mpi 2+1", "from_mpi 2x2 lanes", "launchers 1+2"])
def test_small_segments(mode, nprocs, size):
    """4 KiB segments: every message of more than 4 KiB is pipelined in many segments (on the
    lanes too, from 1 MiB, with nodes of one size), and the launchers' allgathers no longer fit
    the mailbox (they go node by node)."""
    rc, out, _ = _launch(nprocs, mode, size, segment=4096)
    assert rc == 0 and f"OK {mode}" in out, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,node_size", [(4, 2), (3, 1)])
def test_mismatch_raises_on_every_rank_of_every_node(nprocs, node_size):
    rc, out, _ = _launch(nprocs, "mismatch", node_size)
    assert rc == 0 and "OK mismatch" in out, out[-4000:]


@pytest.mark.timeout(120)
def test_a_failure_in_one_node_reaches_every_node():
    rc, out, _ = _launch(4, "failure", 2)
    assert rc == 0 and "OK failure" in out, out[-4000:]
    raised = _reports(out, r"rank \d+ raised ")
    assert sorted(r.split()[1] for r in raised) == ["0", "1", "2", "3"], out[-4000:]
    # every rank's message names the global rank that timed out and the user's call (its
    # second), not a node-local rank and an internal step of the node ("broadcast(root=0) #7")
    for r in raised:
        assert "rank 3 timed out in allreduce #2 across nodes" in r, r
        assert not re.search(r"#\d+(?! across nodes)", r), r


@pytest.mark.timeout(120)
def test_a_node_peer_closing_after_its_result_leaves_a_lane_folding():
    """Nodes of one size, a small allreduce: rank 0 has its result and closes (its node's group
    with it) while rank 1's lane still folds with rank 3: rank 1 gets the sum, no error."""
    rc, out, _ = _launch(4, "earlyclose", 2)
    assert rc == 0 and "OK earlyclose" in out, out[-4000:]


@pytest.mark.timeout(120)
def test_a_timeout_in_an_inline_step_between_nodes():
    """Nodes of 1: rank 0 times out in its step between the nodes, which runs in its own
    thread (the link is idle): CollectiveTimeoutError, then PeerLostError on every rank."""
    rc, out, _ = _launch(2, "linktimeout", 1, timeout=60)
    assert rc == 0 and "OK linktimeout" in out, out[-4000:]
    assert "rank 0 raised CollectiveTimeoutError" in out, out[-4000:]
    assert len(_reports(out, r"rank \d+ raised PeerLostError")) == 2, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,node_size", [(3, 2), (4, 2)])
def test_a_timeout_names_the_late_rank_across_nodes(nprocs, node_size):
    """The last rank is late: every on-time rank's CollectiveTimeoutError names the user's
    call and the late rank (its global number) as the one that had not arrived (a node's
    leader waiting across nodes had been named instead); the late rank gets PeerLostError."""
    rc, out, _ = _launch(nprocs, "late", node_size, timeout=90)
    assert rc == 0 and "OK late" in out, out[-4000:]
    assert len(_reports(out, r"rank \d+ raised CollectiveTimeoutError")) == nprocs - 1, out[-4000:]
    assert len(_reports(out, rf"rank {nprocs - 1} raised PeerLostError")) == 1, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,node_size", [(4, 2), (2, 1)])
def test_simulated_nodes_do_not_spin_on_an_oversubscribed_machine(nprocs, node_size):
    """from_mpi: a node's group of 2 on a machine of 2 cores would spin, but the machine holds
    all of the job's processes: with more of them than cores, no group spins."""
    rc, out, _ = _launch(nprocs, "spin", node_size)
    assert rc == 0 and "OK spin" in out, out[-4000:]
    assert len(_reports(out, r"rank \d+: spin_ns \d+")) == nprocs, out[-4000:]


@pytest.mark.timeout(120)
def test_a_killed_rank_ends_the_job():
    rc, out, ended = _launch(4, "kill", 2)
    assert rc != 0 and "OK kill" not in out, out[-4000:]
    took = _since_kill(out, ended)
    assert took < KILL_ENDS_JOB_S, took


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nprocs,base", [(2, 1), pytest.param(3, 1, marks=pytest.mark.long)],
                         ids=["1+2", "1+2+3"])
def test_launchers_every_collective(nprocs, base):
    """mpiexec starts one launcher per node; each forks its workers with run(..., inter=);
    the workers never call MPI (their results are checked through shmtree itself)."""
    rc, out, _ = _launch(nprocs, "launch-collectives", base)
    assert rc == 0 and "OK launch-collectives" in out, out[-4000:]


@pytest.mark.timeout(200)
def test_launchers_spawn_their_workers():
    """Spawned workers import the program again, mpi4py with it: MPI must not start there."""
    rc, out, _ = _launch(2, "launch-mismatch", 1, start="spawn")
    assert rc == 0 and "OK launch-mismatch" in out, out[-4000:]


@pytest.mark.timeout(120)
def test_launchers_pools():
    rc, out, _ = _launch(2, "launch-pool", 1)
    assert rc == 0 and "OK launch-pool" in out, out[-4000:]


@pytest.mark.timeout(120)
def test_launchers_mismatch():
    rc, out, _ = _launch(2, "launch-mismatch", 1)
    assert rc == 0 and "OK launch-mismatch" in out, out[-4000:]


@pytest.mark.timeout(120)
def test_launchers_worker_killed_on_a_remote_node():
    """A worker of node 1 is SIGKILLed: every launcher's run raises WorkerError (the dead one's
    global rank on its own node), mpiexec exits, nothing is left."""
    rc, out, ended = _launch(2, "launch-kill", 1)
    assert rc == 0, out[-4000:]
    lines = sorted(_reports(out, r"launcher \d+: WorkerError "))
    assert len(lines) == 2, out[-4000:]
    assert lines[1].startswith("launcher 1: WorkerError rank 2 ") and "SIGKILL" in lines[1]
    assert "PeerLostError" in lines[0]
    took = _since_kill(out, ended)
    assert took < KILL_ENDS_JOB_S, took


@pytest.mark.timeout(120)
def test_launcher_killed_ends_the_job_and_its_workers():
    rc, out, ended = _launch(2, "launch-exit", 1)
    assert rc != 0 and "OK" not in out, out[-4000:]
    took = _since_kill(out, ended)
    assert took < KILL_ENDS_JOB_S, took
    assert not _alive_of_prog(), "workers outlived their launcher"


def _alive_of_prog():
    import psutil
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if PROG in " ".join(p.info["cmdline"] or []) and \
                    p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.timeout(60)
def test_rendezvous_refuses_another_users_segment():
    """A group created by a process of another user: from_token refuses it (root may open the
    descriptor, the owner check still refuses)."""
    import shmtree
    if os.getuid() != 0:
        pytest.skip("needs root to create a process of another user")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the other user's process
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            g = shmtree.Group(2, pin=False)
            os.write(w, len(g.rendezvous_token()).to_bytes(4, "little") + g.rendezvous_token())
            time.sleep(30)
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            n = int.from_bytes(f.read(4), "little")
            token = f.read(n)
        with pytest.raises(shmtree.ShmtreeError, match="another user"):
            shmtree.Group.from_token(token)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nprocs", [2, 3], ids=["1+2", "1+2+3"])
def test_launchers_groups_again_and_again(nprocs):
    """run(inter=) and Pool(inter=) twelve times each in a row: a launcher that closes its
    group when its workers are done must not fail a node still finishing the last call (nor a
    later group of any node: control messages carry the link's epoch)."""
    rc, out, _ = _launch(nprocs, "launch-loop", 1)
    assert rc == 0 and "OK launch-loop" in out, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,node_size,fail", [(4, 2, "join"), (4, 2, "create"),
                                                   (3, 2, "create"), (3, 1, "create")],
                         ids=["2x2 member", "2x2 creator", "2+1 creator", "1+1+1 creator"])
def test_a_node_that_cannot_form_its_group_fails_every_node(nprocs, node_size, fail, monkeypatch):
    """from_mpi agrees on success over the whole communicator before any global step: the
    other nodes raise too, instead of waiting in MPI for the failed one."""
    monkeypatch.setenv("PROG_FAIL", fail)
    rc, out, _ = _launch(nprocs, "formfail", node_size, timeout=60)
    assert rc == 0 and "OK formfail" in out, out[-4000:]
    assert len(_reports(out, r"rank \d+ raised ")) == nprocs, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nbytes", [64, 8 << 20], ids=["64B leaders", "8MiB lanes"])
def test_sigint_in_one_node_fails_its_peer_at_once(nbytes, monkeypatch):
    """from_mpi(node_size=2), rank 1 interrupted inside an allreduce that rank 2 (node 1's
    first rank, rank 0's partner between the nodes) has not entered: rank 0 (rank 1's own
    node) and rank 3 raise without waiting for rank 2 (which enters only once they have told
    it so, through MPI, or after 30 s), within a few seconds of the interrupt; then rank 2's
    call fails at once."""
    monkeypatch.setenv("PROG_BYTES", str(nbytes))
    rc, out, _ = _launch(4, "sigint", 2, timeout=90)
    assert rc == 0 and "OK sigint" in out, out[-4000:]
    raised = {r.split()[1]: r for r in _reports(out, r"rank \d+ raised ")}
    assert sorted(raised) == ["0", "1", "2", "3"], out[-4000:]
    assert "KeyboardInterrupt" in raised["1"] and "PeerLostError" in raised["0"]
    for r in ("0", "3"):
        took = float(re.search(r"after ([\d.]+) s", raised[r]).group(1))
        assert took < 0.3 + 5, raised[r]     # (the interrupt comes at 0.3 s)


@pytest.mark.timeout(120)
def test_a_failed_step_keeps_its_posted_receives():
    """An inter-node step that fails while its MPI receive is posted keeps the request and its
    buffer (MPI may still write there): a late sender's data lands in memory nobody uses,
    not in a freed temporary (a SIGSEGV or another array's contents)."""
    rc, out, _ = _launch(2, "orphans", 1, timeout=60)
    assert rc == 0 and "OK orphans" in out, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3], ids=["1+2", "1+2+3"])
def test_a_launcher_that_cannot_start_fails_every_launcher(nprocs):
    """Group(inter=) agrees on success over the launchers before any step of all of them."""
    rc, out, _ = _launch(nprocs, "launch-startfail", 1, timeout=60)
    assert rc == 0 and "OK launch-startfail" in out, out[-4000:]


@pytest.mark.timeout(120)
def test_closing_a_link_under_a_running_step():
    """Link.close while another thread (a launcher's proxy thread) runs a step inline: the step
    fails with PeerLostError, the other leader is told, close returns; close does not act on
    the link's MPI requests under the running step."""
    rc, out, _ = _launch(2, "closebusy", 1, timeout=60)
    assert rc == 0 and "OK closebusy" in out, out[-4000:]
