"""Start methods: Python 3.14 makes forkserver multiprocessing's default on Linux.

shmtree's own launchers (`run`, `Pool`) keep fork as their default where the platform has it,
whatever multiprocessing's default is; `Group` works with processes made by any start method,
multiprocessing's default included.  Each case runs in a fresh interpreter whose multiprocessing
default is set first (`set_start_method`), as a 3.14 program starts with forkserver, and reports
what it saw as one JSON line.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import json, multiprocessing as mp, sys
    import numpy as np
    import shmtree

    MARK = "import-time"          # a fork sees the parent's later value, spawn/forkserver not

    def step(comm):
        y = comm.allreduce(np.arange(4.0) * (comm.rank + 1))
        b = comm.broadcast(np.arange(3) if comm.rank == 0 else None)
        return dict(rank=comm.rank, y=y.tolist(), b=b.tolist(), mark=MARK)

    def task(i):
        return dict(y=shmtree.allreduce(np.ones(2) * (shmtree.rank() + 1)).tolist(), mark=MARK)

    def member(group, rank, q):
        with group.join(rank) as comm:
            q.put((rank, comm.allreduce(np.array([rank + 1.0])).tolist(),
                   mp.current_process()._start_method if hasattr(mp.current_process(),
                   "_start_method") else None))

    if __name__ == "__main__":
        mp.set_start_method(sys.argv[1])
        MARK = "set-by-parent"
        out = dict(default=mp.get_start_method())
        out["run"] = shmtree.run(step, 3)
        out["run_explicit"] = shmtree.run(step, 2, start_method=sys.argv[1])
        if sys.argv[1] == "forkserver":         # the server imported shmtree once, for all
            import multiprocessing.forkserver as fs
            with open(f"/proc/{fs._forkserver._forkserver_pid}/maps") as f:
                out["server_has_shmtree"] = "_engine" in f.read()
        with shmtree.Pool(2) as pool:
            out["pool"] = pool.map(task, range(2))
        with shmtree.Pool(2, context=mp.get_context()) as pool:
            out["pool_default_context"] = pool.map(task, range(2))
        q = mp.Queue()
        with shmtree.Group(2) as group:
            procs = [mp.Process(target=member, args=(group, r, q)) for r in range(2)]
            for p in procs:
                p.start()
            got = sorted(q.get(timeout=60) for _ in procs)
            for p in procs:
                p.join(30)
            out["group"] = [g[1] for g in got]
            out["group_exitcodes"] = [p.exitcode for p in procs]
        print("RESULT " + json.dumps(out))
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("default", ["forkserver", "spawn", "fork"])
def test_every_start_method_as_multiprocessing_default(tmp_path, default, repo_root):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=repo_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(prog), default], capture_output=True, text=True,
                          timeout=150, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(line[0][len("RESULT "):])
    assert out["default"] == default
    # run and Pool: fork by default (the workers see the parent's later MARK), whatever
    # multiprocessing's default is
    assert [r["rank"] for r in out["run"]] == [0, 1, 2]
    for r in out["run"]:
        assert r["y"] == [0.0, 6.0, 12.0, 18.0] and r["b"] == [0, 1, 2]
        assert r["mark"] == "set-by-parent"
    explicit_mark = "set-by-parent" if default == "fork" else "import-time"
    for r in out["run_explicit"]:
        assert r["y"] == [0.0, 3.0, 6.0, 9.0] and r["mark"] == explicit_mark
    if default == "forkserver":
        assert out["server_has_shmtree"], "run preloads shmtree in the fork server"
    for r in out["pool"]:
        assert r["y"] == [3.0, 3.0] and r["mark"] == "set-by-parent"
    for r in out["pool_default_context"]:
        assert r["y"] == [3.0, 3.0] and r["mark"] == explicit_mark
    # Group with multiprocessing's default Process
    assert out["group"] == [[3.0], [3.0]] and out["group_exitcodes"] == [0, 0]
