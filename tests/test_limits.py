"""Every limit that can refuse a shared allocation refuses it up front (issue 34, item 1;
docs/design.md, "Shared arrays"): comm.zeros past the file-size limit (RLIMIT_FSIZE, set in the
workers or by `ulimit -f` in a shell), the address-space limit (RLIMIT_AS), a memory cgroup's
limit (a real one, where this test can make one), or an ftruncate the kernel refuses (EFBIG,
ENOSPC, ENOMEM) raises MemoryError on every rank, naming the sizes and the limit, with nothing
allocated (no memory file left open, no mapping, nothing in /dev/shm: the autouse leak check of
conftest.py), and the group stays usable (a smaller comm.zeros and an allreduce work).  No
memory file is sized past the file-size limit: its ftruncate would raise SIGXFSZ, which kills a
process that has not ignored it (the workers here restore its default action).  A group's own
segment (transport.create_memfd) is refused the same way, with a SharedMemoryError (a
ShmtreeError and a MemoryError).

Worker functions are module-level so that they pickle for spawn and forkserver; every
multi-process test has a timeout.
"""
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import shmtree
import shmtree.groups.transport as transport
from procutil import run_ok

LIMIT = 8 << 20                 # the file-size limit the workers set
ASKED = 16 << 20                # what each rank asks for (uint8): above the limit
FITS = 1 << 20                  # what each rank asks for afterwards: below it


def array_traces():
    """(memory files of shared arrays open here, their mappings here)."""
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += "shmtree-array" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum("shmtree-array" in line for line in f)
    return fds, maps


def after_refusal(comm, res, before):
    """What every worker checks once its allocation was refused: nothing of it remains, and
    the group is usable (a smaller allocation, a collective on it, an allreduce)."""
    res["left"] = tuple(a - b for a, b in zip(array_traces(), before))
    y = comm.zeros(FITS, np.uint8)
    y[:] = 1
    comm.allreduce(y, out=y)
    res["fits"] = int(y[0]), int(y[-1])
    res["after"] = float(comm.allreduce(np.ones(3))[0])
    return res


def check_refused(outs, *words, kind=MemoryError, asked=ASKED):
    for rank, res in enumerate(outs):
        assert res["error"] is not None, f"rank {rank}: the allocation was not refused: {res}"
        name, text = res["error"]
        assert name == kind.__name__, (rank, name, text)
        for w in (str(asked), str(2 * asked)) + words:          # the sizes, and the limit
            assert w in text, (rank, w, text)
        assert res["left"] == (0, 0), res                        # nothing allocated
        assert res["fits"] == (2, 2) and res["after"] == 2.0, res


def _attempt(comm, res, asked=ASKED):
    try:
        comm.zeros(asked, np.uint8)
        res["error"] = None
    except Exception as exc:                    # (any kind: the test names what it wants)
        res["error"] = (type(exc).__name__, str(exc))


# ---------------------------------------------------------------------------------------------
# the file-size limit (RLIMIT_FSIZE)

def fsize_worker(comm, limited):
    # SIGXFSZ's default action (Python ignores it): a memory file sized past the limit would
    # kill this process, not fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    res = {}
    before = array_traces()
    if comm.rank in limited:
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        _attempt(comm, res)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return after_refusal(comm, res, before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limited", [(0,), (1,), (0, 1)])
def test_zeros_past_the_file_size_limit_is_a_memory_error_on_every_rank(limited):
    outs = run_ok(fsize_worker, 2, args=(limited,))
    check_refused(outs, "RLIMIT_FSIZE", str(LIMIT), "ranks 0,1" if len(limited) == 2
                  else f"rank {limited[0]}")


JOB = """
import os, sys
import numpy as np
import shmtree

ASKED, FITS = {asked}, {fits}

def worker(comm):
    try:
        comm.zeros(ASKED, np.uint8)
        error = None
    except MemoryError as exc:
        error = str(exc)
    y = comm.zeros(FITS, np.uint8)
    y[:] = 1
    return error, int(comm.allreduce(y)[0])

if __name__ == "__main__":
    print("limit", __import__("resource").getrlimit(__import__("resource").RLIMIT_FSIZE)[0])
    for error, total in shmtree.run(worker, 2):
        print("zeros:", error)
        print("after:", total)
    try:                                    # a group's own segment past the limit
        shmtree.Group(2, chunk_bytes=1 << 25, slots=4)
        print("group: made")
    except shmtree.ShmtreeError as exc:
        print("group:", type(exc).__name__, isinstance(exc, MemoryError), exc)
    links = []
    for n in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{{n}}"))
        except OSError:
            pass
    print("fds:", [t for t in links if "memfd" in t])
"""


@pytest.mark.timeout(120)
def test_zeros_under_ulimit_f_in_a_shell(tmp_path, repo_root):
    """The whole job under `ulimit -f` (a shell's, in 1024-byte blocks): the group is made
    (its segment fits), comm.zeros past the limit is a MemoryError on both ranks, a smaller one
    works; a group whose segment is past the limit is refused with a MemoryError too."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB.format(asked=ASKED, fits=FITS)))
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    job = subprocess.Popen([bash, "-c", f'ulimit -S -f {LIMIT // 1024} && exec "$0" "$1"',
                            sys.executable, str(script)], cwd=str(tmp_path), env=env,
                           start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        out, _ = job.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail(f"the job did not end in 100 s:\n{out.decode()}")
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = out.decode()
    assert job.returncode == 0, out
    assert f"limit {LIMIT}" in out, out
    zeros = [line for line in out.splitlines() if line.startswith("zeros:")]
    assert len(zeros) == 2, out
    for line in zeros:
        assert "RLIMIT_FSIZE" in line and str(ASKED) in line and str(LIMIT) in line, out
    assert out.count(f"after: {2}") == 2, out
    group = [line for line in out.splitlines() if line.startswith("group:")]
    assert group and group[0].startswith("group: SharedMemoryError True") \
        and "RLIMIT_FSIZE" in group[0], out
    assert "fds: []" in out, out                    # the refused segment left no descriptor


# ---------------------------------------------------------------------------------------------
# the kernel refuses to size the memory file (ftruncate: EFBIG, ENOSPC, ENOMEM)

def refused_worker(comm, who, code):
    res = {}
    before = array_traces()
    real = os.ftruncate

    def refusing(fd, size):
        raise OSError(code, os.strerror(code))

    if comm.rank == who:
        os.ftruncate = refusing
    try:
        _attempt(comm, res)
    finally:
        os.ftruncate = real
    return after_refusal(comm, res, before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", [errno.EFBIG, errno.ENOSPC, errno.ENOMEM])
def test_a_refused_ftruncate_is_a_memory_error_on_every_rank(code):
    outs = run_ok(refused_worker, 2, args=(1, code))
    check_refused(outs, errno.errorcode[code], "rank 1")


@pytest.mark.timeout(120)
def test_another_ftruncate_error_is_said_on_every_rank_too():
    """Not a limit (EPERM): a ShmtreeError, on every rank alike, the group usable."""
    outs = run_ok(refused_worker, 2, args=(0, errno.EPERM))
    check_refused(outs, "EPERM", "rank 0", kind=shmtree.ShmtreeError)


# ---------------------------------------------------------------------------------------------
# the address-space limit (RLIMIT_AS): every rank maps every rank's array

def as_worker(comm):
    res = {}
    before = array_traces()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        vsize = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    # room for one rank's array (and this process's own needs), not for both
    resource.setrlimit(resource.RLIMIT_AS, (vsize + ASKED + (ASKED >> 1), hard))
    try:
        _attempt(comm, res)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return after_refusal(comm, res, before)


@pytest.mark.timeout(120)
def test_zeros_past_the_address_space_limit_is_a_memory_error_on_every_rank():
    check_refused(run_ok(as_worker, 2), "RLIMIT_AS")


# ---------------------------------------------------------------------------------------------
# a real memory cgroup (where this test may make one: skipped otherwise)

CGROUP_LIMIT = 96 << 20


def _own_memory_cgroup():
    """(directory of this process's memory cgroup, 'v1' or 'v2', its limit file), or a reason
    why none can be used."""
    from shmtree.machine.sysfs import _proc_cgroups
    paths = _proc_cgroups("memory")
    if "memory" in paths:
        d = Path("/sys/fs/cgroup/memory", *[p for p in paths["memory"].split("/") if p])
        if (d / "memory.limit_in_bytes").exists():
            return d, "v1", "memory.limit_in_bytes"
    if "v2" in paths:
        d = Path("/sys/fs/cgroup", *[p for p in paths["v2"].split("/") if p])
        try:
            enabled = (d / "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        if "memory" in enabled:          # (children of d get the memory controller)
            return d, "v2", "memory.max"
        return "the memory controller is not enabled for this cgroup's children (cgroup v2)"
    return "no memory cgroup here"


@pytest.fixture
def memory_cgroup():
    """A child of this process's memory cgroup, limited to CGROUP_LIMIT: (its directory, the
    directory workers go back to)."""
    found = _own_memory_cgroup()
    if isinstance(found, str):
        pytest.skip(found)
    parent, kind, limit_file = found
    child = parent / f"shmtree-test-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {parent}: {exc}")
    try:
        try:
            (child / limit_file).write_text(str(CGROUP_LIMIT))
            if kind == "v1":
                (child / "memory.move_charge_at_immigrate").write_text("0")
        except OSError as exc:
            pytest.skip(f"cannot limit the memory of {child}: {exc}")
        yield str(child), str(parent), kind
    finally:
        deadline = time.monotonic() + 10    # (its workers are gone: it empties as they go)
        while True:
            try:
                child.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def cgroup_worker(comm, child, parent, asked):
    res = {}
    with open(os.path.join(child, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    try:
        before = array_traces()
        res["room"] = transport.memory_room()
        _attempt(comm, res, asked)
        after_refusal(comm, res, before)
    finally:
        with open(os.path.join(parent, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return res


@pytest.mark.timeout(120)
def test_zeros_past_a_memory_cgroups_limit_is_a_memory_error_on_every_rank(memory_cgroup):
    child, parent, kind = memory_cgroup
    asked = CGROUP_LIMIT // 2 + (8 << 20)          # the two ranks together: above the limit
    outs = run_ok(cgroup_worker, 2, args=(child, parent, asked))
    for res in outs:
        room, room_kind = res["room"]
        assert room <= CGROUP_LIMIT, res           # the check reads the new cgroup
        assert room_kind == (transport.ROOM_CGROUP_V1 if kind == "v1"
                             else transport.ROOM_CGROUP_V2), res
    check_refused(outs, "memory cgroup", "available", asked=asked)
