"""The tensor file format (``inductor_ext.runtime.tensor_file``; read in C++ by ``csrc/tensor_file.h``): every
dtype it lists round-trips exactly, and bad bytes and unsupported dtypes are refused by name."""

import pytest
import torch

from inductor_ext.runtime.tensor_file import DTYPES, decode_tensors, encode_tensors, read_tensors, write_tensors


def test_every_dtype_and_shape_round_trips(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(3, 5, generator=generator) * 100).to(dtype) for dtype in DTYPES]
    tensors += [torch.empty(0, 4), torch.tensor(7, dtype=torch.int64), torch.arange(6).view(2, 3).t()]
    write_tensors(tmp_path / "t.bin", tensors)
    for got in (read_tensors(tmp_path / "t.bin"), decode_tensors(encode_tensors(tensors), "memory")):
        assert len(got) == len(tensors)
        for a, b in zip(got, tensors, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="tensor 0 has dtype torch.complex64"):
        encode_tensors([torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(ValueError, match="weights.bin is not a tensor file"):
        decode_tensors(b"NOPE\x00\x00\x00\x00", "weights.bin")
    data = encode_tensors([torch.ones(4)])
    with pytest.raises(ValueError, match="weights.bin is truncated in tensor 0"):
        decode_tensors(data[:-1], "weights.bin")
    with pytest.raises(ValueError, match="tensor 0 has an unknown dtype code 99"):
        decode_tensors(data[:8] + (99).to_bytes(4, "little") + data[12:], "weights.bin")
