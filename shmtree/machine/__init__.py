"""The machine layer: what the machine is and what a group of it runs, as plain data.

    sysfs       what Linux says: CPUs, NUMA nodes, cores, L3 caches, the cgroup CPU quota
    topology    Topology: the machine as ordered CPU slots; placement of ranks on them;
                the machine fixtures (fixtures/*.json)
    schedule    Tree: the reduction trees as pure data (chain, k-ary, flat, ring, topology)
    plan        plan_group / Plan: every "auto" rule of a group in one place
    liveness    is a process still there (pidfds), and workers that die with their parent

It owns no shared memory and starts no process.  It may import: the standard library, psutil
(lazily), and within this layer; nothing else of shmtree (it sits above the leaves only, and
needs none of them).
"""
