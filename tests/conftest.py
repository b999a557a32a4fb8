"""Shared fixtures of the multi-process test suite.

Every test runs under one autouse fixture, ``no_leaks``, that enforces the lifetime rules of the
contract (DESIGN.md section 5) from the outside:

- ``/dev/shm`` holds no new entry after the test.  multiprocessing creates and unlinks ``sem.*``
  entries transiently, so the listing is given up to ~1.5 s to settle before the test fails.
- no child process of the test process is left running.  After a grace period the survivors are
  killed (so that one failing test does not poison the next) and the test fails.  The helper
  processes that multiprocessing keeps for the whole session (the forkserver and the resource
  tracker) are not children of a test and are ignored; their children are not.

Note: ``/dev/shm`` is shared by everything on the machine.  A job started by someone else at the
same moment can make an entry appear; an entry held (mapped or open) only by processes outside
this test's process tree is therefore reported as a warning, not a failure.  An entry that nobody
holds cannot be attributed and fails the test.
"""
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import warnings

import psutil
import pytest

from procutil import SHM_DIR, new_shm_entries, shm_listing

SHM_SETTLE_S = 1.5          # how long a new /dev/shm entry may take to disappear
CHILD_GRACE_S = 3.0         # how long children may take to exit after the test


def shm_holders(name):
    """Pids of the processes that map or hold open /dev/shm/<name>."""
    path = os.path.join(SHM_DIR, name)
    holders = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    holders.add(int(pid))
                    continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    holders.add(int(pid))
                    break
        except OSError:
            pass
    return holders


def split_foreign(entries):
    """(ours, foreign): an entry is foreign when it is held only by processes outside this
    test's process tree (someone else's job running on the machine at the same time).  An entry
    that nobody holds any more cannot be attributed, and counts as ours."""
    me = psutil.Process()
    tree = {me.pid} | {c.pid for c in me.children(recursive=True)}
    ours, foreign = [], []
    for name in entries:
        holders = shm_holders(name)
        (foreign if holders and not holders & tree else ours).append(name)
    return ours, foreign


def _session_helper_pids():
    """Pids of multiprocessing's long-lived helpers (forkserver, resource tracker)."""
    pids = set()
    fs = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(fs, "_forkserver_pid", None)
    if pid:
        pids.add(pid)
    rt = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    pid = getattr(rt, "_pid", None)
    if pid:
        pids.add(pid)
    return pids


def stray_children():
    """Live descendants of this process, multiprocessing's session helpers excepted."""
    helpers = _session_helper_pids()
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    return [c for c in children if c.pid not in helpers]


def _describe(procs):
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid} ({p.status()}): {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"pid {p.pid} (gone)")
    return out


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail the test if it leaves an entry in /dev/shm or a child process behind."""
    shm_before = shm_listing()
    yield
    problems = []

    # children: give them a grace period (this also reaps our own zombies), then kill and fail
    strays = stray_children()
    if strays:
        _, alive = psutil.wait_procs(strays, timeout=CHILD_GRACE_S)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if alive:
            desc = _describe(alive)
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=5)
            problems.append("child processes still running after the test (killed now):\n  "
                            + "\n  ".join(desc))

    # /dev/shm: nothing new may remain (checked after the children are gone)
    leaked, foreign = split_foreign(new_shm_entries(shm_before))
    if foreign:
        warnings.warn(f"ignored new {SHM_DIR} entries held by processes of another job: "
                      f"{foreign}")
    if leaked:
        named = [n for n in leaked if "shmtree" in n.lower()]
        problems.append(f"new entries left in {SHM_DIR}: {leaked}"
                        + (f" (of which named shmtree: {named})" if named else ""))

    if problems:
        pytest.fail("leak check failed:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture
def repo_root():
    """The directory holding the shmtree package these tests import: the repository root with
    an in-place build, else the site-packages of the installed package (a fresh clone's source
    tree has no compiled extensions, so subprocesses must not import it)."""
    import shmtree

    return os.path.dirname(os.path.dirname(os.path.abspath(shmtree.__file__)))
