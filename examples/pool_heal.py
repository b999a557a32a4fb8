"""A Pool that heals: a worker dies in a task; that task fails, the pool goes on (issue 38)."""
import os
import signal
import sys
import tempfile

import numpy as np

import shmtree


def task(i, marker):
    if i == 3 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)      # its worker dies (once)
    return i * i


def total(comm):                                  # SPMD on the healed pool
    return float(comm.allreduce(np.ones(1))[0])


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "respawn"     # or "shrink"
    marker = os.path.join(tempfile.mkdtemp(), "killed")
    with shmtree.Pool(4, on_failure=mode) as pool:
        results = []
        for i in range(8):
            try:
                results.append(pool.apply_async(task, (i, marker)).get(timeout=60))
            except shmtree.PeerLostError as exc:  # "rank N died (...) while it ran this task"
                results.append(type(exc).__name__)
        print(results)
        print(pool.run(total))                    # 4 workers again (respawn), or 3 (shrink)
    os.remove(marker)
    os.rmdir(os.path.dirname(marker))

# Output:
# [0, 1, 4, 'PeerLostError', 16, 25, 36, 49]
# [4.0, 4.0, 4.0, 4.0]
