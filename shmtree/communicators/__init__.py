"""The communicators: one machine's Communicator and the sub-communicators made of it.

    communicator  Communicator: the front end's hooks for one machine (with quick.py, its
                  mixin: the engine's C parse taken straight, and persistent calls bound to
                  it), running calls, peer and stall checks, close
    subcomm       split, dup, split_by: SubCommunicator and its group

It may import every layer below it: the front end, the groups, p2p and the internode layer;
never launching or torch.
"""
