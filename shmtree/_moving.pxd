# The parts of _moving.pyx (broadcast's first round) that the engine calls in C
# (Engine.quick_broadcast), without going through Python calls.

cimport numpy as cnp

cpdef object bcast_fill(object a, bint is_root, int rank, int P, Py_ssize_t room)
cpdef Py_ssize_t next_room(cnp.ndarray buf, int P, Py_ssize_t cap) except -1
cpdef object bcast_read(cnp.ndarray buf, object out, int P, Py_ssize_t room)
cpdef bint fits(object out, object a) except -1
