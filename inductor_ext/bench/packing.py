"""Seeded SFT-like documents for ``python -m inductor_ext.bench train --packed``: packed into rows
(padding-free training) and, from the same documents, the right-padded baseline.

Document lengths follow a lognormal distribution of median :data:`DOC_LENGTH_MEDIAN` tokens and
log-standard-deviation :data:`DOC_LENGTH_SIGMA`, rounded and clamped to
``[DOC_LENGTH_MIN, seq]``. :func:`packed_batches` fills rows of exactly ``seq`` tokens greedily, in
order: a document that does not fit the row's remaining space is cut to fit and its rest is
dropped, so no document spans two rows. Each packed batch is what transformers'
``DataCollatorWithFlattening(return_position_ids=True)`` builds: ``position_ids`` restart at 0 at
each document and the first label of each document is -100. :func:`padded_batches` regroups one
packed batch's documents, consecutively, into right-padded batches with an ``attention_mask``.
"""

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

DOC_LENGTH_MEDIAN = 300
"""Median document length in tokens (the lognormal's ``exp(mu)``), typical of SFT conversations."""
DOC_LENGTH_SIGMA = 0.75
"""Standard deviation of the log of the document length: 95% of documents lie within 0.22x-4.5x the median."""
DOC_LENGTH_MIN = 16
"""Shortest document drawn (the longest is the row length ``seq``); cut documents can be shorter."""
IGNORE_INDEX = -100
"""The label that the loss skips (transformers' and the collator's default)."""
PAD_TOKEN_ID = 0
"""Token id of the padding positions (masked out and ignored by the loss: any id would do)."""
PAD_TO_MULTIPLE_OF = 8
"""Padded batches' width is a multiple of this (the collators' ``pad_to_multiple_of``): under
``torch.compile(dynamic=True)`` Inductor guards on the width's alignment to 8, so unaligned widths
would compile a second graph."""


@dataclass(frozen=True)
class Batch:
    """One training batch: packed (``position_ids``, no mask) or padded (``attention_mask``, no positions)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    @property
    def real_tokens(self) -> int:
        """The tokens of documents in the batch (padding excluded)."""
        if self.attention_mask is None:
            return self.input_ids.numel()
        return int(self.attention_mask.sum())

    def to(self, device: str | torch.device) -> "Batch":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(self.input_ids.to(device), self.labels.to(device), move(self.position_ids),
                     move(self.attention_mask))  # fmt: skip

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The batch's tensors by the keyword a transformers causal LM takes."""
        kwargs = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        if self.attention_mask is not None:
            kwargs["attention_mask"] = self.attention_mask
        return kwargs


def document_lengths(seq: int, *, seed: int) -> Iterator[int]:
    """The endless seeded stream of document lengths (see the module's docstring)."""
    rng = random.Random(seed)
    mu = math.log(DOC_LENGTH_MEDIAN)
    while True:
        yield min(max(round(rng.lognormvariate(mu, DOC_LENGTH_SIGMA)), DOC_LENGTH_MIN), seq)


def packed_batches(count: int, batch: int, seq: int, vocab: int, *, seed: int = 1) -> list[Batch]:
    """``count`` packed batches of ``batch`` rows of ``seq`` tokens each (random token ids below ``vocab``)."""
    lengths = document_lengths(seq, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(count):
        input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        position_ids = torch.empty(batch, seq, dtype=torch.long)
        for row in range(batch):
            start = 0
            while start < seq:
                piece = min(next(lengths), seq - start)  # cut to fit; the rest is dropped
                position_ids[row, start : start + piece] = torch.arange(piece)
                start += piece
        labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
        result.append(Batch(input_ids, labels, position_ids=position_ids))
    return result


def documents(packed: Batch) -> list[torch.Tensor]:
    """The token ids of each document of a packed batch, in order (rows split where positions restart)."""
    assert packed.position_ids is not None, "not a packed batch"
    docs = []
    for ids, positions in zip(packed.input_ids, packed.position_ids):
        starts = (positions == 0).nonzero().flatten().tolist()
        docs += [ids[a:b] for a, b in zip(starts, [*starts[1:], ids.numel()])]
    return docs


def padded_batches(packed: Batch, padded_batch: int) -> list[Batch]:
    """The documents of ``packed``, ``padded_batch`` at a time in order, right-padded to the longest of
    each group rounded up to :data:`PAD_TO_MULTIPLE_OF`; labels -100 on the padding and on each document's first token. A last group of one
    document joins the group before it (unless ``padded_batch`` is 1): a batch of one would make ``torch.compile(dynamic=True)``
    specialise the size and recompile."""
    docs = documents(packed)
    groups = [docs[i : i + padded_batch] for i in range(0, len(docs), padded_batch)]
    if padded_batch > 1 and len(groups) > 1 and len(groups[-1]) == 1:
        last = groups.pop()
        groups[-1] += last
    result = []
    for group in groups:
        width = -(-max(doc.numel() for doc in group) // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF
        input_ids = torch.full((len(group), width), PAD_TOKEN_ID, dtype=packed.input_ids.dtype)
        attention_mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, doc in enumerate(group):
            input_ids[row, : doc.numel()] = doc
            attention_mask[row, : doc.numel()] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        labels[:, 0] = IGNORE_INDEX
        result.append(Batch(input_ids, labels, attention_mask=attention_mask))
    return result
