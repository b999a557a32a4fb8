"""Tensors as the backend takes them: gloo's checks of the lists (dtypes, shapes, layouts, roots,
split sizes), numpy views of the tensors, packing into one byte buffer, and the local reduction
of a list."""
from __future__ import annotations

import torch

from ..arrays import as_numpy
from .options import _invalid, _invalid_value

_Tensor = torch.Tensor
_STRIDED = torch.strided
_SPARSE = torch.sparse_coo


def _tensors(x, what, name="tensors"):
    """A list of tensors: a list or tuple as given, a single tensor as a list of one."""
    if isinstance(x, _Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(x)
    raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: {name} must be a tensor or a list of "
                    f"tensors, got {type(x).__name__}")


def _tensor_lists(x, what, name):
    """A list of lists of tensors."""
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, (list, tuple)) for v in x):
        raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: {name} must be a list of lists "
                        f"of tensors, got {type(x).__name__}")
    return [list(v) for v in x]


def _layout_name(t):
    return "Strided" if t.layout == _STRIDED else "Sparse" if t.layout == _SPARSE \
        else str(t.layout)


def _size_text(t):
    return "(" + ", ".join(str(int(n)) for n in t.shape) + ")"


def _check_match(what, tensors, dtype=None, shape=None, start=0):
    """gloo's assertTypeAndSizesMatch: every tensor of the list has the dtype and the shape of
    the first (or those given)."""
    first = tensors[0] if tensors else None
    dtype = first.dtype if dtype is None else dtype
    shape = first.shape if shape is None else shape
    for i, t in enumerate(tensors):
        if not isinstance(t, _Tensor):
            raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: expected a torch.Tensor at "
                            f"index {start + i}, got {type(t).__name__}")
        if t.dtype != dtype:
            raise _invalid(what, f"invalid tensor type at index {start + i} (expected {dtype}, "
                                 f"got {t.dtype})")
        if t.shape != shape:
            raise _invalid(what, f"invalid tensor size at index {start + i} (expected "
                                 f"({', '.join(str(int(n)) for n in shape)}), got "
                                 f"{_size_text(t)})")


def _check_root_list(what, lists, side, stop, size, like):
    """gloo's checks of the root's list of lists in gather (side "output") and scatter
    ("input"): one list of `size` dense tensors of `like`'s dtype and shape (gloo ends the
    first message with `stop`)."""
    if len(lists) != 1:
        raise _invalid(what, f"requires a single-element {side} list containing a list "
                             f"with {size} tensors{stop}")
    if len(lists[0]) != size:
        raise _invalid(what, f"Incorrect {side} list size {len(lists[0])}. "
                             f"{side.capitalize()} list size should be {size}, same as size of "
                             "the process group.")
    _check_dense(what, lists[0])
    _check_match(what, lists[0], like.dtype, like.shape)
    for t in lists[0]:
        _view(t)


def _check_pairs(what, outputs, inputs, size, gathered):
    """gloo's checks of a coalesced call's (output, input) pairs: non-empty lists of one
    length, each pair of one dtype, the larger of each pair holding `size` times the smaller
    (gathered: the output, allgather; else the input, reduce_scatter), dense tensors."""
    if not inputs:
        raise _invalid(what, "requires non-empty input tensor list")
    if len(outputs) != len(inputs):
        raise _invalid(what, "requires input/output tensor lists to have the same length")
    for i, (o, t) in enumerate(zip(outputs, inputs)):
        if o.dtype != t.dtype:
            raise _invalid(what, f"invalid tensor type at index {i} (expected {t.dtype}, "
                                 f"got {o.dtype})")
        whole, part = (o, t) if gathered else (t, o)
        if whole.numel() != size * part.numel():
            raise _invalid(what, f"invalid tensor size at index {i} (expected {size} x "
                                 f"{_size_text(part)}, got {_size_text(whole)})")
    _check_dense(what, inputs + outputs)


def _check_dense(what, tensors):
    """gloo's assertDense / assertLayoutMatch for a collective of strided tensors on the CPU."""
    for i, t in enumerate(tensors):
        if isinstance(t, _Tensor) and t.layout != _STRIDED:
            raise _invalid(what, f"invalid tensor layout at index {i} (expected Strided, got "
                                 f"{_layout_name(t)})")


def _check_root(what, root, size):
    if not 0 <= root < size:
        raise _invalid(what, f"invalid root rank: {root}")


def _check_splits(what, splits, t, size, side):
    """gloo's checkSplitSizes: no splits, dim 0 divides by the size; else `size` of them
    summing to dim 0 (gloo's words; an ArgumentError: a RuntimeError and a ValueError)."""
    rows = int(t.shape[0])
    if not splits:
        if rows % size:
            raise _invalid_value(what, f"Tensor's dim 0 does not divide equally across group "
                                       f"size (the {side} has {rows} rows, the group {size} "
                                       "ranks)")
    elif len(splits) != size:
        raise _invalid_value(what, f"Number of tensor splits not equal to group size "
                                   f"({side}_split_sizes {splits}: {len(splits)} for {size} "
                                   "ranks)")
    elif sum(splits) != rows or any(n < 0 for n in splits):
        raise _invalid_value(what, f"Split sizes doesn't match total dim 0 size "
                                   f"({side}_split_sizes {splits} sum to {sum(splits)}, the "
                                   f"{side} has {rows} rows)")


def _single_p2p(what, tensors, tag):
    """gloo's checkSingleTensor and checkTag: (the one contiguous dense tensor, the tag)."""
    tensors = _tensors(tensors, what)
    if len(tensors) != 1:
        raise _invalid(what, "takes a single tensor")
    t = tensors[0]
    if not isinstance(t, _Tensor):
        raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: expected a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.layout != _STRIDED:
        raise _invalid(what, "input tensor has to be dense")
    if not t.is_contiguous():
        raise _invalid(what, "input tensor has to be contiguous")
    tag = int(tag)
    if tag < 0:
        raise _invalid(what, "Tag must be nonnegative")
    return t, tag


def _p2p_bytes(t):
    """A contiguous CPU tensor's bytes, as a 1-d uint8 numpy view (a message carries bytes:
    the receiver's tensor gives them their dtype and shape, as gloo's)."""
    _view(t)                                      # (its checks: a CPU tensor)
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _blocks_of_one(tensors, avoid=None):
    """The tensor of shape (n, *shape) whose rows are `tensors` - n contiguous tensors of one
    shape and dtype lying one after the other in the same memory (list(x.chunk(n)) of a
    contiguous x) - as a view of that memory; None when they are not (or when that memory
    overlaps the tensor `avoid`).  gather and scatter use it instead of a copy."""
    try:
        t0 = tensors[0].detach()
        nbytes = t0.numel() * t0.element_size()
        if not nbytes:
            return None
        start = t0.data_ptr()
        for i, t in enumerate(tensors):
            if t.layout != _STRIDED or t.dtype != t0.dtype or t.shape != t0.shape \
                    or not t.is_contiguous() or t.data_ptr() != start + i * nbytes \
                    or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr():
                return None
        if avoid is not None:
            lo, hi = avoid.data_ptr(), avoid.data_ptr() + avoid.numel() * avoid.element_size()
            if lo < start + len(tensors) * nbytes and start < hi:
                return None
        whole = t0.as_strided((len(tensors), t0.numel()), (t0.numel(), 1))
        return whole.view((len(tensors),) + tuple(t0.shape))
    except (RuntimeError, TypeError, ValueError):
        return None


def _view(t):
    """A numpy view of a CPU tensor's memory (a tensor that requires grad: of its detach();
    bfloat16 as ml_dtypes.bfloat16)."""
    if isinstance(t, _Tensor) and t.layout != _STRIDED:
        raise ValueError(f"shmtree: the shmtree backend takes strided tensors here, got "
                         f"{t.layout}")
    return _strided_view(t)


def _strided_view(t):
    """_view of a tensor known to be strided."""
    if not isinstance(t, _Tensor):
        raise TypeError(f"shmtree: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"shmtree: the shmtree backend takes CPU tensors, got one on {t.device}")
    if t.dtype == torch.bfloat16:
        return as_numpy(t, "the shmtree backend")
    return t.detach().numpy()


def _shaped(t, shape, what):
    """(a numpy array of `shape` over tensor t's memory, for an operation to write; a step
    that puts the result into t, or None).  When t's layout has no view of that shape (a
    non-contiguous tensor), the operation writes a contiguous temporary, and the step copies
    it into t: the output is written either way (numpy's reshape would copy, and the copy be
    filled and dropped)."""
    _view(t)                                      # (its checks: a CPU tensor)
    shape = tuple(int(n) for n in shape)
    n = 1
    for d in shape:
        n *= d
    if t.numel() != n:
        raise _invalid(what, f"invalid tensor size: the output tensor has {t.numel()} elements "
                             f"(shape {tuple(t.shape)}), expected {n}")
    try:
        return _view(t.detach().view(shape)), None
    except RuntimeError:                          # (no view of that shape over t's strides)
        tmp = torch.empty(shape, dtype=t.dtype)
        return _view(tmp), lambda: t.detach().copy_(tmp.view(t.shape))


def _flat(t):
    """t's elements in order, as a 1-d tensor (a view when t is contiguous)."""
    return t.detach().reshape(-1)


def _bytes(t):
    """t's elements as a contiguous 1-d uint8 tensor (a view when t is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


_ALIGN = 16                     # pieces packed into one byte buffer start at multiples of this


def _packed(tensors):
    """(a contiguous uint8 tensor holding each tensor's bytes, each piece starting at a
    multiple of _ALIGN; the pieces' (offset, nbytes))."""
    pieces, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        pieces.append((offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    buf = torch.empty(max(offset, _ALIGN), dtype=torch.uint8)
    for t, (off, nbytes) in zip(tensors, pieces):
        if nbytes:
            buf[off:off + nbytes].copy_(_bytes(t))
    return buf, pieces


def _unpacked(buf, offset, nbytes, like):
    """The tensor of `like`'s dtype and shape over bytes [offset, offset+nbytes) of buf."""
    if nbytes == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    return buf[offset:offset + nbytes].view(like.dtype).view(like.shape)


_LOCAL = {"sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "prod": torch.Tensor.mul_,
          "band": torch.Tensor.bitwise_and_, "bor": torch.Tensor.bitwise_or_,
          "bxor": torch.Tensor.bitwise_xor_}


def _reduced_locally(tensors, op):
    """The elementwise reduction of the tensors of one rank's list (gloo reduces a list of
    several tensors locally, then across the ranks): a new contiguous tensor."""
    acc = tensors[0].detach().clone(memory_format=torch.contiguous_format)
    for t in tensors[1:]:
        t = t.detach()
        if op == "min":
            torch.minimum(acc, t, out=acc)
        elif op == "max":
            torch.maximum(acc, t, out=acc)
        elif acc.dtype == torch.bool and op in ("sum", "avg"):
            acc.logical_or_(t)
        elif acc.dtype == torch.bool and op == "prod":
            acc.logical_and_(t)
        else:
            _LOCAL[op](acc, t)
    return acc
