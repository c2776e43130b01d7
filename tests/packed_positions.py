"""Packed rows' ``position_ids`` for the document-attention tests: positions restart at 0 per document."""

import torch


def packed_positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """``(B, S)`` positions of rows holding documents of the given lengths (every row the same total)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def random_packed_positions(batch: int, length: int, generator: torch.Generator, longest: int = 60) -> torch.Tensor:
    """``(batch, length)`` positions of rows packed with documents of random lengths in ``[1, longest)``."""
    rows = []
    for _ in range(batch):
        lengths: list[int] = []
        while sum(lengths) < length:
            lengths.append(min(int(torch.randint(1, longest, (1,), generator=generator)), length - sum(lengths)))
        rows.append(lengths)
    return packed_positions(rows)
