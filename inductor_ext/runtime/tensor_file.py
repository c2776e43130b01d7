"""The tensor file format the C++ runner (``inductor_ext/csrc/aoti_runner.cpp``) reads and writes, and
the format of a generation package's weights record (:mod:`inductor_ext.runtime.shared_weights`).

Little-endian: ``b"FOTF"``, uint32 count, then per tensor: uint32 dtype code, uint32
ndim, int64 sizes[ndim] and the contiguous data (CPU). Small and dependency-free on
both sides, unlike a pickle.
"""

import struct
from collections.abc import Sequence
from pathlib import Path

import torch

MAGIC = b"FOTF"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8,
          torch.float64)  # fmt: skip
"""Position = the dtype code (must match kDtypes in inductor_ext/csrc/aoti_runner.cpp)."""


def encode_tensors(tensors: Sequence[torch.Tensor]) -> bytes:
    """``tensors`` in the tensor file format."""
    return encoded_buffer(tensors).numpy().tobytes()


def encoded_buffer(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` in the tensor file format, as one CPU ``uint8`` tensor: each tensor is copied once, from
    its device straight into its place (a package's weights are written from it without another copy)."""
    headers = [MAGIC + struct.pack("<I", len(tensors))]
    for i, t in enumerate(tensors):
        if t.dtype not in DTYPES:
            raise TypeError(f"tensor file: tensor {i} has dtype {t.dtype}; supported: {[str(d) for d in DTYPES]}")
        headers.append(struct.pack(f"<II{t.dim()}q", DTYPES.index(t.dtype), t.dim(), *t.shape))
    sizes = [t.numel() * t.element_size() for t in tensors]
    buffer = torch.empty(sum(map(len, headers)) + sum(sizes), dtype=torch.uint8)
    offset = 0
    for header, tensor, size in zip(headers, [None, *tensors], [0, *sizes]):
        buffer[offset : offset + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        offset += len(header)
        if tensor is not None and size:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + size].copy_(data)
            offset += size
    return buffer


def decode_tensors(data: bytes, source: str, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The tensors of a tensor file's bytes (``source`` names it in errors), each moved to ``device`` as
    soon as it is read (host memory beyond ``data``: one tensor at a time)."""
    if data[:4] != MAGIC:
        raise ValueError(f"read_tensors: {source} is not a tensor file (no {MAGIC!r} header)")
    view = memoryview(data)
    (count,), offset = struct.unpack_from("<I", data, 4), 8
    tensors = []
    for index in range(count):
        code, ndim = struct.unpack_from("<II", data, offset)
        if code >= len(DTYPES):
            raise ValueError(f"read_tensors: {source}: tensor {index} has an unknown dtype code {code}")
        offset += 8
        shape = struct.unpack_from(f"<{ndim}q", data, offset)
        offset += 8 * ndim
        dtype = DTYPES[code]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(data):
            raise ValueError(f"read_tensors: {source} is truncated in tensor {index}")
        raw = torch.frombuffer(bytearray(view[offset : offset + nbytes]), dtype=torch.uint8) if nbytes else None
        tensor = raw.view(dtype).view(shape) if raw is not None else torch.empty(shape, dtype=dtype)
        tensors.append(tensor.to(device))
        offset += nbytes
    return tensors


def write_tensors(path: str | Path, tensors: Sequence[torch.Tensor]) -> None:
    Path(path).write_bytes(encode_tensors(tensors))


def read_tensors(path: str | Path) -> list[torch.Tensor]:
    return decode_tensors(Path(path).read_bytes(), str(path))
