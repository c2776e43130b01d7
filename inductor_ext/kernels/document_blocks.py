"""Document ids and FlexAttention block tables of packed rows (device code only).

``_document_ids_kernel``, one program per row: a new document starts at every token whose position
does not follow its predecessor's by exactly one (transformers' ``find_packed_sequence_indices``)::

    doc[b, 0] = 0
    doc[b, s] = doc[b, s - 1] + (positions[b, s] - positions[b, s - 1] != 1)

a running sum over chunks of ``CHUNK`` tokens, carried from chunk to chunk.

``_document_block_tables_kernel``, one program per (row ``b``, block ``i``) of ``BLOCK_SIZE`` tokens.
With ``first[j]``/``last[j]`` the documents of block ``j``'s first and last token (documents only grow
along a row), query block ``q`` and key block ``k`` hold a pair of one document with ``k <= q`` iff
``last[k] >= first[q]``; the pair is *full* (every pair allowed: no mask needed) iff ``k < q``, both
blocks lie inside the row and one document covers both, and *partial* otherwise. Program ``(b, i)``
writes row ``i`` of the key tables (query block ``i``: its partial and its full key blocks, ascending,
then zeros, and their counts) and row ``i`` of the query tables (key block ``i``: the query blocks that
read it), the layout of FlexAttention's ``BlockMask``. Each list is compacted by a running count: the
``r``-th set block (from 1) goes to slot ``r - 1``; the slots from the count on are zeros.
"""

import triton
import triton.language as tl


@triton.jit
def _document_ids_kernel(
    positions_ptr, doc_ptr, length, stride_positions_row, stride_positions_token, stride_doc, CHUNK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    positions_row = positions_ptr + row * stride_positions_row
    carry = tl.zeros((), dtype=tl.int32)
    for start in range(0, length, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        valid = offsets < length
        position = tl.load(positions_row + offsets * stride_positions_token, mask=valid, other=0)
        before = valid & (offsets > 0)
        previous = tl.load(positions_row + (offsets - 1) * stride_positions_token, mask=before, other=0)
        starts = (before & (position - previous != 1)).to(tl.int32)
        tl.store(doc_ptr + row * stride_doc + offsets, carry + tl.cumsum(starts, 0), mask=valid)
        carry += tl.sum(starts, 0)


@triton.jit
def _compact(flags, blocks, in_range, count_ptr, indices_ptr):
    """``indices_ptr[0:count]`` = the set entries' block indices, ascending; zeros after; ``*count_ptr = count``."""
    ones = flags.to(tl.int32)
    count = tl.sum(ones, 0)
    tl.store(count_ptr, count)
    tl.store(indices_ptr + tl.cumsum(ones, 0) - 1, blocks, mask=flags)
    tl.store(indices_ptr + blocks, tl.zeros_like(blocks), mask=in_range & (blocks >= count))


@triton.jit
def _document_block_tables_kernel(
    doc_ptr,
    length,
    num_blocks,
    stride_doc,
    kv_num_ptr,
    kv_indices_ptr,
    full_kv_num_ptr,
    full_kv_indices_ptr,
    q_num_ptr,
    q_indices_ptr,
    full_q_num_ptr,
    full_q_indices_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    doc_row = doc_ptr + row * stride_doc
    blocks = tl.arange(0, BLOCKS_POW2)
    in_range = blocks < num_blocks
    first = tl.load(doc_row + blocks * BLOCK_SIZE, mask=in_range, other=0)
    last = tl.load(doc_row + tl.minimum(blocks * BLOCK_SIZE + BLOCK_SIZE - 1, length - 1), mask=in_range, other=0)
    whole = blocks * BLOCK_SIZE + BLOCK_SIZE <= length
    first_i = tl.load(doc_row + i * BLOCK_SIZE)
    last_i = tl.load(doc_row + tl.minimum(i * BLOCK_SIZE + BLOCK_SIZE - 1, length - 1))
    whole_i = i * BLOCK_SIZE + BLOCK_SIZE <= length
    # one document over blocks i and j, both inside the row (symmetric in i and j)
    shared = whole_i & whole & (first_i == last_i) & (first == last) & (first == first_i)
    # query block i against key blocks j
    full_row = in_range & (blocks < i) & shared
    partial_row = in_range & (blocks <= i) & (last >= first_i) & ~full_row
    # key block i against query blocks j
    full_column = in_range & (blocks > i) & shared
    partial_column = in_range & (blocks >= i) & (last_i >= first) & ~full_column
    table = row * num_blocks + i
    _compact(partial_row, blocks, in_range, kv_num_ptr + table, kv_indices_ptr + table * num_blocks)
    _compact(full_row, blocks, in_range, full_kv_num_ptr + table, full_kv_indices_ptr + table * num_blocks)
    _compact(partial_column, blocks, in_range, q_num_ptr + table, q_indices_ptr + table * num_blocks)
    _compact(full_column, blocks, in_range, full_q_num_ptr + table, full_q_indices_ptr + table * num_blocks)
