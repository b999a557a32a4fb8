"""A local error only the root can see (DESIGN section 6, last bullet): the root raises its
TypeError/ValueError, every other rank's call raises CollectiveMismatchError naming the root and
its error, within the same call; the group stays usable and in step (the next collective matches
on every rank).  Blocking and nonblocking, broadcast and reduce, small and large messages, P=2
(the two-rank exchange) and P=3 (the tree)."""
import numpy as np
import pytest

import shmtree
from procutil import run_ok

N_LARGE = 50001


def _cases(comm):
    r = comm.rank
    obj = np.array([object(), 1, 2], dtype=object)
    return {
        "bcast_object_root": lambda: comm.broadcast(obj if r == 0 else None, root=0),
        "bcast_object_root_large": lambda: comm.broadcast(
            obj if r == 1 else np.zeros(N_LARGE), root=1),
        "bcast_masked_root": lambda: comm.broadcast(
            np.ma.masked_array(np.ones(3), [0, 1, 0]) if r == 0 else None, root=0),
        "ibcast_object_root": lambda: comm.ibroadcast(obj if r == 0 else None,
                                                      root=0).wait(60),
        "reduce_object_root": lambda: comm.reduce(obj if r == 0 else np.ones(3), root=0),
        "reduce_unreducible_root_large": lambda: comm.reduce(
            np.ones(N_LARGE, complex) if r == 1 else np.ones(N_LARGE), op="max", root=1),
        "ireduce_object_root": lambda: comm.ireduce(obj if r == 0 else np.ones(3),
                                                    root=0).wait(60),
        # every rank makes the error: each raises its own, and all stay in step
        "reduce_all_unreducible": lambda: comm.reduce(np.ones(3, complex), op="max"),
    }


def worker(comm, names):
    out = []
    cases = _cases(comm)
    for name in names:
        try:
            cases[name]()
            out.append((name, None, ""))
        except Exception as exc:
            out.append((name, type(exc).__name__, str(exc)))
        got = comm.allreduce(np.array([comm.rank + 1.0]), timeout=60)     # in step
        out.append(("after " + name, float(got[0]), ""))
    return out


ROOT = {"bcast_object_root_large": 1, "reduce_unreducible_root_large": 1}
ROOT_ERROR = {"bcast_object_root": "TypeError", "bcast_object_root_large": "TypeError",
              "bcast_masked_root": "TypeError", "ibcast_object_root": "TypeError", "reduce_object_root": "TypeError",
              "reduce_unreducible_root_large": "TypeError", "ireduce_object_root": "TypeError", "reduce_all_unreducible": "TypeError"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3])
def test_root_only_error_raises_on_every_rank_within_the_call(P):
    names = list(ROOT_ERROR)
    outs = run_ok(worker, P, args=(names,), stall_timeout=None)
    for rank, out in enumerate(outs):
        for name, what, msg in out:
            if name.startswith("after "):
                assert what == P * (P + 1) / 2, (rank, name)
                continue
            root = ROOT.get(name, 0)
            if rank == root or name == "reduce_all_unreducible":
                assert what == ROOT_ERROR[name], (rank, name, what, msg)
                assert "raised" not in msg, (rank, name, msg)      # its own error, as is
            else:
                assert what == "CollectiveMismatchError", (rank, name, what, msg)
                assert f"rank {root} (the root) raised {ROOT_ERROR[name]}" in msg, \
                    (rank, name, msg)
