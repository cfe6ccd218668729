"""Tensor manifests: lay named tensors out in a byte buffer, and view them back out of it."""

from __future__ import annotations

import math

import torch

from disagg.transport.data.allocator import align_up
from disagg.transport.wire.messages import TensorSpec

TENSOR_ALIGN_BYTES = 64

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in _DTYPES.items()}


class ManifestError(ValueError):
    """A manifest that does not describe a valid layout of its slot."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ManifestError(f"unsupported dtype {dtype}") from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a manifest (or a rank group's header) names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestError(f"unsupported dtype {name!r}") from None


def plan(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Offsets for each tensor in one slot, and the slot's total size."""
    specs, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, dtype_name(t.dtype), list(t.shape), offset, nbytes))
        offset = align_up(offset + nbytes, TENSOR_ALIGN_BYTES)
    return specs, offset


def pack(tensors: dict[str, torch.Tensor], slot: torch.Tensor, specs: list[TensorSpec]) -> None:
    """Copy tensors into `slot` (a uint8 tensor) at the planned offsets."""
    for spec in specs:
        src = tensors[spec.name].contiguous().reshape(-1)
        if spec.nbytes:
            slot[spec.offset : spec.offset + spec.nbytes].copy_(src.view(torch.uint8), non_blocking=True)


def unpack(slot: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views of the tensors a manifest describes inside `slot` (no copy); validates bounds."""
    out = {}
    for spec in specs:
        dtype = _DTYPES.get(spec.dtype)
        if dtype is None:
            raise ManifestError(f"tensor {spec.name!r}: unsupported dtype {spec.dtype!r}")
        itemsize = _ITEMSIZE[spec.dtype]
        if math.prod(spec.shape) * itemsize != spec.nbytes:
            raise ManifestError(f"tensor {spec.name!r}: shape {spec.shape} does not match {spec.nbytes} bytes")
        if spec.offset % itemsize or spec.offset + spec.nbytes > slot.numel():
            raise ManifestError(
                f"tensor {spec.name!r}: bytes [{spec.offset}, {spec.offset + spec.nbytes}) "
                f"lie outside the {slot.numel()}-byte slot"
            )
        raw = slot[spec.offset : spec.offset + spec.nbytes]
        out[spec.name] = raw.view(dtype).reshape(spec.shape)
    return out
