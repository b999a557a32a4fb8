"""The front end: every collective call as the user makes it, parsed once and run.

    front         Front: every public collective, its i- and _init forms, written once over a
                  communicator's hooks (with moves.py, forms.py and memory.py, its mixins:
                  the data-moving collectives, the persistent forms, shared arrays and
                  sub-communicators); the module-level calls are made from it
    calls         CallSpec and one parser per collective: every rule about a call's arguments
    persistent    Persistent: a call checked and bound once (*_init), run by p() / p.start()
    requests      Request, wait_all, the progress thread of nonblocking calls
    collectives   Executors: a parsed call normalised into what the engine takes, and what
                  follows an engine call (with rounds.py: the rounds of words, bytes and
                  counts that follow a call when the ranks disagree)

The engine itself (shmtree._engine, Cython) sits in this layer too.  It may import: the
leaves (errors, codes, ops, arrays, _kernels, _moving, _p2p), the machine layer, and within this
layer; never the groups, p2p, internode, communicators, launching or torch layers (a
communicator comes in through the hooks).
"""
