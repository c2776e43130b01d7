"""Embedding backward: the dense weight gradient from token rows sorted by id, one program per id's run.

    dW[v] = sum_{i : ids[i] = v} dy[i]   (an fp32 sum, rounded once; 0 for v = padding_idx and absent ids)

The caller zero-fills ``dW`` (one write at copy bandwidth) and sorts the ids: ``SORTED_IDS`` ascending,
``ORDER`` the token rows in that order, ``RUN_ENDS[p]`` the end of the run of equal ids that position
``p`` is in (a binary search of each sorted id). Program ``(p, j)`` owns sorted position ``p`` and
columns block ``j``: if ``p`` starts a run (the first position, or an id other than its predecessor's)
of an id other than ``padding_idx``, it sums the run's gradient rows :data:`BLOCK_T` at a time in fp32
and writes the id's row once; every other program exits after two scalar loads. So the kernel reads
``dy`` once and writes only the rows of ids that occur (``N`` tokens: at most ``N H`` elements), with
no atomics; a long run (a padding token repeated over half the batch) is split over the column blocks
and read as wide tiles. For a given launch config the sums' order, and so their bits, are the same on
every run; re-running the kernel rewrites the same rows with the same values (autotuning is safe).
"""

import triton
import triton.language as tl


@triton.jit
def embedding_bwd_kernel(
    DY, SORTED_IDS, ORDER, RUN_ENDS, DW, H, stride_dy, padding_idx,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    start = tl.program_id(0)
    token_id = tl.load(SORTED_IDS + start)
    previous = tl.load(SORTED_IDS + tl.maximum(start - 1, 0))
    if ((start == 0) | (token_id != previous)) & (token_id != padding_idx):
        end = tl.load(RUN_ENDS + start)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for chunk in range(start, end, BLOCK_T):
            positions = chunk + tl.arange(0, BLOCK_T)
            valid = positions < end
            tokens = tl.load(ORDER + positions, mask=valid, other=0)
            tile = tl.load(DY + tokens[:, None] * stride_dy + cols[None, :],
                           mask=valid[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
            acc += tl.sum(tile.to(tl.float32), axis=0)
        tl.store(DW + token_id * H + cols, acc.to(DW.dtype.element_ty), mask=col_mask)


EMBEDDING_BWD_CONFIGS = [
    triton.Config({"BLOCK_H": block_h, "BLOCK_T": block_t}, num_warps=warps)
    for block_h, block_t, warps in ((128, 32, 4), (256, 16, 4), (256, 32, 8), (512, 16, 8), (1024, 8, 8))
]

embedding_bwd_tuned_kernel = triton.autotune(configs=EMBEDDING_BWD_CONFIGS, key=["H"])(embedding_bwd_kernel)
