"""Shared fixtures of the multi-process test suite.

Every test runs under one autouse fixture, ``no_leaks``, that enforces the lifetime rules of the
contract (docs/design.md, "Lifetime and security") from the outside:

- ``/dev/shm`` holds no new entry after the test.  multiprocessing creates and unlinks ``sem.*``
  entries transiently, so the listing is given up to ~1.5 s to settle before the test fails.
- no child process of the test process is left running.  After a grace period the survivors are
  killed (so that one failing test does not poison the next) and the test fails.  The helper
  processes that multiprocessing keeps for the whole session (the forkserver and the resource
  tracker) are not children of a test and are ignored; their children are not.

Note: ``/dev/shm`` is shared by everything on the machine.  A job started by someone else at the
same moment can make an entry appear; an entry held (mapped or open) only by processes outside
this test's process tree is therefore reported as a warning, not a failure.  An entry that nobody
holds cannot be attributed at that moment: most often it is another job's, between its holders'
exit and its unlink (an MPICH segment, multiprocessing's semaphores), a moment that a loaded
machine stretches to seconds, or for good when that job's processes were killed.  Its creator
held it, though: a watcher process (tests/shm_watch.py, one for the session) looks at every new
entry as it appears and notes whether the test's tree or someone else held it.  An entry nobody
holds at the check is given up to SHM_UNHELD_SETTLE_S more to go, or to be found another job's
(by the watcher, or by a holder that shows up); one still held by nobody after that, and never
seen held by another job, fails the test.

shmtree's segment is a memfd, which never appears in ``/dev/shm``; so the fixture also looks at
the test process itself (when something new is found, after ``gc.collect()``: a dropped Group
goes with its last reference, which a reference cycle may keep until a collection):

- no new memfd descriptor (``/proc/self/fd`` entries whose link reads ``/memfd:...``) and no new
  memfd mapping (``/proc/self/maps``, counted per segment: the NUMA binding of the rings splits
  one mapping into several lines) remains after the test; they are given up to
  procutil.FD_SETTLE_S to go (threads of a Pool may hold the last reference for a moment);
- other descriptors: multiprocessing opens a few for the whole session, once (the forkserver's
  alive pipe, the resource tracker's pipe, the resource sharer's listening socket, which a Group
  pickled outside a process start uses); those are left out.  Anything else new is reported: a
  warning for up to procutil.FD_ALLOWANCE of them (a library may open a file of its own for good
  the first time it is used), a failure above that (given FD_SETTLE_S to go: a pipe to a child
  closes as the child is reaped).  When the test itself failed, these findings
  are warnings only: the failure's traceback keeps the test's locals alive;
- the CPU affinity of the test process is what it was before (Group.join pins the process that
  joins; a test that joins in the test process must leave it unpinned).  A changed mask is
  restored before the test fails, so that the next test is not run on one CPU.
"""
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import psutil
import pytest

# A job that a non-interactive shell starts in the background (`bash .ci/run &`) inherits SIGINT
# ignored, and so would every worker and subprocess the tests start; the Ctrl-C tests need the
# ordinary disposition (an ignored signal stays ignored across fork and exec, a handler does not).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from procutil import (FD_SETTLE_S, SHM_DIR, fd_and_map_problems, memfd_mappings, new_shm_entries,
                      open_fds, shm_listing)

SHM_SETTLE_S = 1.5          # how long a new /dev/shm entry may take to disappear
SHM_UNHELD_SETTLE_S = 20.0  # ... one that nobody holds (only waited for when there is one)
CHILD_GRACE_S = 20.0        # how long children may take to exit after the test (only waited
                            # for when there are some; a loaded machine stretches an exit)


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


_watcher = {"pid": None, "verdicts": None}     # the session's shm_watch.py process
SHM_WATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_watch.py")


def start_shm_watch(verdicts, directory=None):
    """Start shm_watch.py for this process, writing to `verdicts` (a path): its Popen.  In a
    session of its own (no signal a test sends to a process group reaches it) and with no pipe
    to it (nothing for a forked child to inherit, no descriptor left in this process)."""
    return subprocess.Popen([sys.executable, SHM_WATCH, str(os.getpid()), verdicts]
                            + ([directory] if directory else []), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def watcher_verdicts():
    """{name: "ours" | "foreign"} of the new /dev/shm entries the watcher saw held ({} when it
    does not run)."""
    path = _watcher["verdicts"]
    if path is None:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="session", autouse=True)
def shm_watcher():
    """Start tests/shm_watch.py for the session."""
    tmp = tempfile.mkdtemp(prefix="shmtree-shm-watch-")
    path = os.path.join(tmp, "verdicts.json")
    proc = start_shm_watch(path)
    _watcher.update(pid=proc.pid, verdicts=path)
    try:
        yield
    finally:
        _watcher.update(pid=None, verdicts=None)
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def classify_shm(entries):
    """(ours, foreign, unheld): an entry is foreign when it is held only by processes outside
    this test's process tree (someone else's job running on the machine at the same time), ours
    when a process of the tree holds it; one that nobody holds cannot be attributed."""
    if not entries:
        return [], [], []
    me = psutil.Process()
    tree = {me.pid} | {c.pid for c in me.children(recursive=True)}
    ours, foreign, unheld = [], [], []
    for name in entries:
        holders = shm_holders(name)
        (ours if holders & tree else foreign if holders else unheld).append(name)
    return ours, foreign, unheld


def split_foreign(entries):
    """(ours, foreign) of classify_shm, an entry that nobody holds counted as ours; one nobody
    holds is watched up to SHM_UNHELD_SETTLE_S first: it goes, or its holder shows whose it is
    (an entry nobody holds is most often another job's, between its holders' exit and its
    unlink, which a loaded machine stretches to seconds).  Only an unheld entry costs time."""
    ours, foreign, unheld = classify_shm(entries)
    deadline = time.monotonic() + SHM_UNHELD_SETTLE_S
    while unheld:
        seen = watcher_verdicts()                 # held by another job when it appeared?
        foreign += [n for n in unheld if seen.get(n) == "foreign"]
        unheld = [n for n in unheld if seen.get(n) != "foreign"]
        if not unheld or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
        present = shm_listing()
        o, f, unheld = classify_shm([n for n in unheld if n in present])
        ours += o
        foreign += f
    return ours + unheld, foreign


def _session_helper_pids():
    """Pids of the session's long-lived helpers: multiprocessing's (forkserver, resource
    tracker) and the /dev/shm watcher."""
    pids = set()
    fs = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(fs, "_forkserver_pid", None)
    if pid:
        pids.add(pid)
    rt = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    pid = getattr(rt, "_pid", None)
    if pid:
        pids.add(pid)
    if _watcher["pid"]:
        pids.add(_watcher["pid"])
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep the outcome of the test's call on the item (the leak check looks at it)."""
    outcome = yield
    if call.when == "call":
        item.shmtree_call_failed = outcome.get_result().failed


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail the test if it leaves an entry in /dev/shm, a child process, a memfd descriptor or
    mapping, too many descriptors, or a changed CPU affinity behind."""
    shm_before = shm_listing()
    fds_before = open_fds()           # (no gc.collect here: see fd_and_map_problems)
    maps_before = memfd_mappings()
    affinity_before = os.sched_getaffinity(0)
    yield
    problems = []

    # CPU affinity: restore it first, whatever else fails
    affinity_after = os.sched_getaffinity(0)
    if affinity_after != affinity_before:
        os.sched_setaffinity(0, affinity_before)
        problems.append(f"the test process's CPU affinity was left at {sorted(affinity_after)} "
                        f"(was {sorted(affinity_before)}; restored now)")

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
    leaked, foreign = split_foreign(new_shm_entries(shm_before, SHM_SETTLE_S))
    if foreign:
        warnings.warn(f"ignored new {SHM_DIR} entries held by processes of another job: "
                      f"{foreign}")
    if leaked:
        named = [n for n in leaked if "shmtree" in n.lower()]
        problems.append(f"new entries left in {SHM_DIR}: {leaked}"
                        + (f" (of which named shmtree: {named})" if named else ""))

    # this process's descriptors and memfd mappings (checked after the children are gone:
    # pipes to them close as they are reaped).  When the test itself failed, its traceback
    # keeps its locals (a Group, a Process and its pipes) alive: what is found then cannot be
    # told from a leak, and is only a warning
    failed = getattr(request.node, "shmtree_call_failed", False)
    failures, warns = fd_and_map_problems(fds_before, maps_before,
                                          settle_s=0.0 if failed else FD_SETTLE_S)
    if failed:
        warns += [f"(the test failed; its traceback may hold these) {f}" for f in failures]
        failures = []
    problems += failures
    for w in warns:
        warnings.warn(w)

    if problems:
        pytest.fail("leak check failed:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture
def repo_root():
    """The directory holding the shmtree package these tests import: the repository root with
    an in-place build, else the site-packages of the installed package (a fresh clone's source
    tree has no compiled extensions, so subprocesses must not import it)."""
    import shmtree

    return os.path.dirname(os.path.dirname(os.path.abspath(shmtree.__file__)))


# ---- long tests: opt-in (SHMTREE_LONG=1), as the full fault matrix and torch's world size 3 ----
# A test marked `long` repeats at a larger size what a default test checks already (more nodes,
# more processes, torchrun at world size 4): CI keeps the default suite under 10 minutes.

LONG = os.environ.get("SHMTREE_LONG", "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "long: a larger variant of a default test; runs only "
                                       "with SHMTREE_LONG=1")


def pytest_collection_modifyitems(config, items):
    if LONG:
        return
    skip = pytest.mark.skip(reason="a larger variant of a default test: set SHMTREE_LONG=1")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
