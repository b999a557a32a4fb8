"""Engine.stats(): per-rank counters of completed calls and of waiting."""
import numpy as np
import pytest

from procutil import run_ok


def stats_worker(comm, calls):
    before = comm._engine.stats()
    for _ in range(calls):
        comm.allreduce(np.ones(1000))
    comm.barrier()
    after = comm._engine.stats()
    return {k: after[k] - before[k] for k in after}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [1, 3])
def test_stats_count_calls_and_waits(P):
    for delta in run_ok(stats_worker, P, args=(25,)):
        assert delta["calls"] == 26                     # 25 allreduce calls and the barrier
        assert all(delta[k] >= 0 for k in ("yields", "sleeps", "sleep_timeouts"))
        assert delta["sleep_timeouts"] <= delta["sleeps"]
        if P == 1:
            assert delta["yields"] == delta["sleeps"] == 0   # nobody to wait for
