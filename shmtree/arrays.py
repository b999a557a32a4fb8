"""Arrays of other libraries (docs/design.md, "Arrays of other libraries"): any CPU array with
`__dlpack__` (torch tensors, JAX arrays) or the array interface, as input and as `out=`.

The collectives work on numpy arrays; an array of another library is viewed as one - the same
memory, no copy (np.from_dlpack; a tensor that requires grad through its .detach(); torch.bfloat16 as an
ml_dtypes.bfloat16 array) - and the call runs on the view.  `out=` is written in place and returned as given; without `out=`, a call
given torch tensors returns a torch tensor (torch.from_numpy of the result: no copy either).
"""
from __future__ import annotations

import sys

import numpy as np

_CPU = 1                                # DLPack's kDLCPU


def is_foreign(x) -> bool:
    """An array of another library (not numpy's, not a plain Python value)?"""
    return (x is not None and not isinstance(x, np.ndarray)
            and (hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__")))


def as_numpy(x, what):
    """A numpy view of the memory of array x (of another library)."""
    if hasattr(x, "__dlpack__"):
        if hasattr(x, "detach") and callable(x.detach):     # torch: requires_grad is fine
            x = x.detach()
        try:
            device = x.__dlpack_device__()
        except (ValueError, RuntimeError, TypeError) as exc:    # (torch's meta tensors)
            device = (f"{getattr(x, 'device', '?')} ({exc})",)
        if not isinstance(device[0], int) or int(device[0]) != _CPU:
            raise ValueError(f"shmtree: {what}: the array lives on device {device}; shmtree "
                             "works on CPU memory only (copy it to the CPU first)")
        if _is_torch(x) and x.dtype == sys.modules["torch"].bfloat16:
            return _bf16_view(x, what)
        try:
            return np.from_dlpack(x)
        except (RuntimeError, BufferError, TypeError) as exc:
            raise TypeError(f"shmtree: {what}: cannot view a {type(x).__name__} of dtype "
                            f"{getattr(x, 'dtype', '?')} as a numpy array ({exc})") from None
    return np.asarray(x)


def _bf16_view(t, what):
    """A torch.bfloat16 tensor as a numpy array of ml_dtypes.bfloat16 (the same memory: numpy
    has no bfloat16 of its own, DLPack cannot carry one into numpy)."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"shmtree: {what}: bfloat16 tensors need the ml_dtypes package (pip "
                        "install ml_dtypes), numpy has no bfloat16 of its own") from None
    torch = sys.modules["torch"]
    return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)


def _to_torch(a):
    """A torch tensor over numpy array a's memory (bfloat16 included)."""
    import torch
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def call(fn, array, out, what, *args, **kwargs):
    """fn(array, *args, out=out, **kwargs) with foreign arrays viewed as numpy ones; the result
    as the caller expects it: `out` itself when given, a torch tensor for torch input, else
    numpy."""
    a = as_numpy(array, what) if is_foreign(array) else array
    o = as_numpy(out, what) if is_foreign(out) else out
    result = fn(a, *args, out=o, **kwargs)
    if out is not None and o is not out and result is o:
        return out
    if result is not None and out is None and _is_torch(array):
        return _to_torch(result)
    return result


def either_foreign(array, out) -> bool:
    """Is the input or out= an array of another library?  (Cheap for numpy's.)"""
    return ((type(array) is not np.ndarray and is_foreign(array))
            or (out is not None and type(out) is not np.ndarray and is_foreign(out)))


def numpy_args(array, out, what):
    """The input and out= of a nonblocking call, arrays of other libraries viewed as numpy's
    (its Request's result is then numpy's, or the view of out)."""
    if either_foreign(array, out):
        return (as_numpy(array, what) if is_foreign(array) else array,
                as_numpy(out, what) if is_foreign(out) else out)
    return array, out
