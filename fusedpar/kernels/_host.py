"""Integer helpers for the launchers' host code.

triton.cdiv and triton.next_power_of_2 are Triton constexpr functions: called from host code
they go through Triton's constexpr unwrapping, which costs host time on every call, and an eager
decode step makes a dozen such calls per layer. These are the plain-int versions,
plus the argument checks the launchers run per launch (power-of-two tilings, output overlap),
kept to a few integer operations each. Also the facts every launcher shares: the dtypes the
kernels take, whether Triton runs interpreted, and the device's SM count.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.jit import JITFunction

# Every Triton kernel of fusedpar takes these activation/weight dtypes (tl.dot on bf16 needs a GPU).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Persistent grids under the interpreter: a few "SMs", so every program loop runs more than once.
INTERPRETER_NUM_SMS = 4


@triton.jit
def _probe():
    pass


# Triton decides interpreter vs compiler when @triton.jit runs (TRITON_INTERPRET=1 at first import).
INTERPRETED: bool = not isinstance(_probe, JITFunction)


@functools.cache
def device_num_sms(device_index: int) -> int:
    """Number of SMs of CUDA device `device_index` (cached: a device query costs microseconds)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): tl.arange needs power-of-two lengths."""
    return 1 << max(0, n - 1).bit_length()


def is_pow2(n: int) -> bool:
    """Whether n is a power of two (>= 1): tl.arange lengths and Triton block sizes must be."""
    return n > 0 and not n & (n - 1)


def require_pow2(owner: str, **fields: int) -> None:
    """Raise ValueError naming the first of `fields` (name=value) that is not a power of two."""
    for name, value in fields.items():
        if not is_pow2(value):
            raise ValueError(f"{owner}: {name}={value} must be a power of two (Triton block sizes are)")


def max_offset(t) -> int:
    """Element offset of t's last element from its first (strides are >= 0 in torch): the largest
    offset a kernel forms from t's base pointer, which the launchers keep below 2**31 (int32 offsets)."""
    last = 0
    for size, stride in zip(t.shape, t.stride(), strict=True):
        last += (size - 1) * stride
    return last


def overlaps(a, b) -> bool:
    """Whether tensors a and b may share memory: their byte ranges [first element, last element]
    intersect. Conservative (two interleaved views, e.g. a tensor's even and odd columns, count as
    overlapping) and by address, so it also sees aliases through different storage objects; a and b
    must be on one device (pointers of two devices are not comparable). Empty tensors overlap nothing.
    A handful of integer operations (launchers call it per launch): no tensor ops."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + (max_offset(b) + 1) * b.itemsize and b0 < a0 + (max_offset(a) + 1) * a.itemsize


def overlaps_other_view(out, t) -> bool:
    """Whether out shares memory with t without being the same view of it (same first element, and
    the same strides wherever a dim has more than one element): the in-place case a kernel that reads
    each element before storing it can allow. out and t have one shape."""
    if out is t or not overlaps(out, t):
        return False
    if out.data_ptr() != t.data_ptr():
        return True
    return any(a != b for n, a, b in zip(out.shape, out.stride(), t.stride(), strict=True) if n > 1)


def has_internal_overlap(t) -> bool:
    """Whether t has a dimension of size > 1 and stride 0 (an expand()ed view), whose elements share memory.

    The cheap sufficient check, not torch's full one: an as_strided view can overlap itself with
    nonzero strides and passes. Enough for outputs, which come from torch.empty, views of it, or an
    expand() by mistake."""
    strides = t.stride()
    if 0 not in strides:  # the common case, one C-level scan
        return False
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, strides, strict=True))


def check_out_overlap(op: str, out, **operands) -> None:
    """Raise ValueError when out shares memory with itself (an expand()ed view: several tiles would
    store one element) or with one of `operands` (name=tensor): the GEMM kernels store finished tiles
    of out while other programs still read the operands, so they cannot run in place."""
    if has_internal_overlap(out):
        raise ValueError(f"{op}: out {tuple(out.shape)} with strides {out.stride()} has elements sharing memory "
                         "(an expand()ed view); pass a tensor with distinct elements")
    for name, t in operands.items():
        if overlaps(out, t):
            raise ValueError(f"{op}: out overlaps {name} in memory; the GEMM cannot run in place on an operand, "
                             "pass a separate out")


def require_same_on_ranks(what: str, name: str, tensors) -> None:
    """Raise ValueError unless every rank's tensor (tensors[r]) has rank 0's shape and dtype: the
    collective kernels' precondition, which an emulated driver sees whole (the real launchers cannot
    check it, a mismatch there reads or waits for data no peer sends)."""
    first = tensors[0]
    for r in range(1, len(tensors)):
        t = tensors[r]
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"{what}: every rank must pass {name} of one shape and dtype (a collective), rank 0 has "
                f"{tuple(first.shape)} {first.dtype}, rank {r} has {tuple(t.shape)} {t.dtype}"
            )
