"""What a group runs: its plan (trees, schedule, chunks, pinning), for this machine or another."""
import shmtree
from shmtree.machine.plan import plan_group

if __name__ == "__main__":
    with shmtree.Group(2) as group:                       # this machine, detected from sysfs
        print(group.plan.describe())
    print(plan_group(8, topology="2x4", ncpus=8).describe())   # 2 sockets x 4 cores: no group
