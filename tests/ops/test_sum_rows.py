"""The dW/dB reduction of the norm backwards (:func:`inductor_ext.ops._reduce.sum_partial_rows`): every
autotune config of its CUDA kernel sums the fp32 partial rows as float64 does (run here by Triton's
interpreter with each config's blocks), at widths that do and do not divide the blocks."""

import pytest
import torch
import triton

from inductor_ext.kernels.reduce import SUM_ROWS_CONFIGS, sum_rows_kernel
from inductor_ext.library.launch import DirectLaunch, interpreter_enabled
from inductor_ext.ops._reduce import sum_partial_rows

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="runs the kernel in Triton's interpreter")


@pytest.mark.parametrize("config", SUM_ROWS_CONFIGS, ids=lambda c: "r{BLOCK_R}_n{BLOCK_N}".format(**c.kwargs))
@pytest.mark.parametrize("rows,cols", [(37, 200), (64, 128)])
def test_every_config_sums_the_partial_rows(config, rows, cols):
    partial = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))
    out = torch.empty(cols)
    block_r, block_n = config.kwargs["BLOCK_R"], config.kwargs["BLOCK_N"]
    DirectLaunch()(sum_rows_kernel, lambda meta: (triton.cdiv(cols, block_n),), partial, out, rows, cols,
                   BLOCK_R=block_r, BLOCK_N=block_n)  # fmt: skip
    expected = partial.double().sum(0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)


def test_sum_partial_rows_in_the_parameters_dtype_and_shape():
    partial = torch.randn(9, 4100, generator=torch.Generator().manual_seed(0))  # wider than one interpreter block
    out = sum_partial_rows(DirectLaunch(), partial, torch.empty(4100, dtype=torch.float16))
    assert out.dtype == torch.float16 and out.shape == (4100,)
    torch.testing.assert_close(out, partial.double().sum(0).half())  # rounded once
