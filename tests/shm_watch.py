"""Watches /dev/shm for the test session (started by conftest.py; not a test module).

/dev/shm is shared by everything on the machine, and an entry that another job creates and then
abandons (its processes killed before they unlink it: an MPICH segment, multiprocessing's
semaphores) is held by nobody when the leak check of conftest.py looks at it, so it cannot be
told from a leak of the test.  Its creator held it, though: this process looks at every new
entry as it appears (every POLL_S) and writes down whose it is while someone holds it, "ours"
when a process of the test process's tree holds it, else "foreign", into a JSON file
({name: verdict}, replaced atomically; written first when the watch begins) that the leak
check reads.  An entry seen held by the
test's tree stays "ours"; one that nobody holds is looked at again for up to PENDING_S.

usage: python shm_watch.py TEST_PID VERDICT_FILE [DIR]  (DIR: /dev/shm unless said; started by
the test process TEST_PID, and exits when that is gone)
"""
import json
import os
import sys
import time

import psutil

shm_dir = "/dev/shm"
POLL_S = 0.05
PENDING_S = 5.0


def holders(path):
    # (conftest.shm_holders' twin: this script runs alone, importing nothing of the tests',
    # which import shmtree, under PYTHONSAFEPATH in a fresh clone)
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    found.add(int(pid))
                    continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    found.add(int(pid))
                    break
        except OSError:
            pass
    return found


def tree_of(pid):
    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.Error:
        return {pid}


def listing():
    try:
        return set(os.listdir(shm_dir))
    except OSError:
        return set()


def write(out, verdicts):
    with open(out + ".tmp", "w") as f:
        json.dump(verdicts, f)
    os.replace(out + ".tmp", out)


def main():
    global shm_dir
    test_pid, out = int(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3:
        shm_dir = sys.argv[3]
    me = os.getpid()
    known = listing()                 # there before the session: never the session's
    verdicts, pending = {}, {}        # name -> verdict; name -> first seen (no holder yet)
    write(out, verdicts)              # (the file's existence says: watching now)
    while os.getppid() == test_pid:   # (reparented once the test process is gone)
        now = listing()
        changed = False
        for name in now - known:
            pending.setdefault(name, time.monotonic())
        known |= now
        for name in list(pending):
            if name not in now:
                del pending[name]
                continue
            held = holders(os.path.join(shm_dir, name)) - {me}
            if held:
                verdict = "ours" if held & tree_of(test_pid) else "foreign"
                if verdicts.get(name) != "ours" and verdicts.get(name) != verdict:
                    verdicts[name] = verdict
                    changed = True
                del pending[name]
            elif time.monotonic() - pending[name] > PENDING_S:
                del pending[name]
        for name in [n for n in verdicts if n not in now]:
            del verdicts[name]        # (a name may be used again, by anyone)
            changed = True
        known = now
        if changed:
            write(out, verdicts)
        time.sleep(POLL_S)


if __name__ == "__main__":
    main()
