"""The decode loop of :class:`~inductor_ext.runtime.generation.runtime.GenerationPackage`: one step per new
token, each a call of the package's decode graph, the token choice and the updates of the next step's
inputs, all on the device; on a GPU the step is captured once as a CUDA graph and replayed per token.

A step reads and writes only tensors at fixed addresses (:class:`DecodeState`): the last token of each
row, its position, the cache slot, the slot mask, the KV cache, the tokens generated so far, whether each
row is unfinished, and the step's index. So the same Python function runs a step eagerly (on the CPU, and
the first step of a new configuration on a GPU, which warms up lazy initialisation) and is captured by
:class:`torch.cuda.CUDAGraph` (every later step replays it: one launch instead of the decode graph's
hundreds, and no Python per kernel).

Stopping: a row is finished once it emits an end token (later tokens are the pad token); generation stops
when every row is finished, as transformers' ``generate`` does. Knowing that needs the device's answer, so
on a GPU each step copies its "any row unfinished" flag to pinned host memory behind an event, and the host
reads the flag of the step :data:`STOP_CHECK_LAG` steps back before it launches the next: the GPU always
has steps queued, and at most that many steps run past the end (they write only pad tokens and cache
slots after the returned sequence, which the output leaves out). Without end tokens nothing is read back
before the end. A streamer gets each token as it is made, which reads back every step.
"""

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

STOP_CHECK_LAG = 2
"""How many steps behind the last launched one the host reads the "any row unfinished" flag (GPU)."""

MAX_CAPTURED_GRAPHS = 8
"""Captured decode graphs kept per package (least recently used dropped first); one per batch size and
token-choice setting (sampling, temperature, top-k, pad and end tokens)."""


@dataclasses.dataclass(frozen=True)
class TokenChoice:
    """How a step picks its token from the logits, and what a finished row gets. Greedy: argmax.
    Sampling: temperature, then top-k, then ``torch.multinomial`` of the softmax, in transformers' order
    (with the same seed and logits, transformers' tokens)."""

    do_sample: bool
    temperature: float
    top_k: int | None
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __call__(self, logits: Tensor) -> Tensor:
        if not self.do_sample:
            return logits.argmax(dim=-1)
        logits = logits / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1)


class DecodeState:
    """The tensors a decode step reads and writes, allocated once per batch size; ``slots`` and ``cache``
    are views of the package's slot mask and KV cache, the rest the loop's own."""

    def __init__(self, batch: int, max_seq_len: int, slots: Tensor, cache: list[Tensor]) -> None:
        device = slots.device
        self.batch, self.slots, self.cache = batch, slots, cache
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        """Each row's last token: the next step's input."""
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        """The RoPE position of :attr:`token`."""
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        """The cache slot of :attr:`token`."""
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        """Tokens generated so far (the index of the next one in :attr:`generated`)."""
        self.generated = torch.zeros(batch, max_seq_len, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.any_unfinished = torch.ones(1, dtype=torch.bool, device=device)

    def start(self, positions: Tensor, length: int) -> None:
        """Before the first token: the prompt's last position and slot, nothing generated, every row on."""
        self.position.copy_(positions[:, -1:])
        self.cache_position.fill_(length - 1)
        self.count.zero_()
        self.unfinished.fill_(True)
        self.any_unfinished.fill_(True)

    def record(self, token: Tensor, choice: "TokenChoice", eos: Tensor | None) -> None:
        """Append ``token`` (one per row; a finished row's becomes the pad token) and make it the next
        step's input, at the next position and slot."""
        if choice.pad_token_id is not None:
            token = torch.where(self.unfinished, token, choice.pad_token_id)
        self.generated.index_copy_(1, self.count, token[:, None])
        if eos is not None:
            self.unfinished &= ~torch.isin(token, eos)
            torch.any(self.unfinished, dim=0, keepdim=True, out=self.any_unfinished)
        self.token.copy_(token[:, None])
        self.position += 1
        self.cache_position += 1
        self.count += 1


class DecodeLoop:
    """Generates tokens for one package: the first from the prefill's logits, then decode steps, each run
    eagerly or (``cuda_graphs``) by replaying a CUDA graph captured per (batch size, token choice) after
    that pair's first, eager, step. ``decode_for(b)``: the package's decode graph for batch ``b``."""

    def __init__(self, decode_for: Callable[[int], Any], cuda_graphs: bool) -> None:
        self.decode_for, self.cuda_graphs = decode_for, cuda_graphs
        self._graphs: collections.OrderedDict[tuple[int, TokenChoice], torch.cuda.CUDAGraph] = collections.OrderedDict()
        self._eos: dict[tuple[int, ...], Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        """One memory pool for every captured graph: they replay one at a time, each copying what it
        keeps into :class:`DecodeState` tensors, so their intermediates may share memory."""
        self._stop_flags = _StopFlags() if cuda_graphs else None

    def generate(
        self,
        state: DecodeState,
        choice: TokenChoice,
        logits: Tensor,
        max_new_tokens: int,
        on_token: Callable[[int], None] | None = None,
    ) -> int:
        """Fills ``state.generated`` from the prefill's ``logits`` (after :meth:`DecodeState.start`) and
        returns how many tokens the sequences get: ``max_new_tokens``, or fewer where every row finished
        (the token that finished the last row included). ``on_token(n)`` (a streamer's hook) is called as
        each token is made, ``n`` the tokens generated so far; it reads the device every step."""
        eos = self._eos_tensor(choice.eos_token_ids, logits.device)
        state.record(choice(logits), choice, eos)
        graph = self._graphs.get((state.batch, choice)) if self.cuda_graphs else None
        flags = self._stop_flags if on_token is None else None
        watch = _StopWatch(eos is not None, flags)
        for made in range(1, max_new_tokens + 1):
            if made > 1:  # decode the last token, choose the next
                if graph is not None:
                    graph.replay()
                else:  # on the CPU, or a first (warm-up) step before the capture
                    self._step(state, choice, eos)
                    if self.cuda_graphs:
                        graph = self._capture(state, choice, eos)
            if on_token is not None:
                on_token(made)
            finished = watch.after(made, state.any_unfinished)
            if finished is not None:
                return finished
        return watch.finish(max_new_tokens)

    def _step(self, state: DecodeState, choice: TokenChoice, eos: Tensor | None) -> None:
        state.slots.index_fill_(1, state.cache_position, 1)  # the token's own slot becomes visible
        decode = self.decode_for(state.batch)
        logits = decode(state.token, state.position, state.cache_position, state.slots, state.cache)
        state.record(choice(logits), choice, eos)

    def _capture(self, state: DecodeState, choice: TokenChoice, eos: Tensor | None) -> torch.cuda.CUDAGraph:
        """A CUDA graph of one decode step of ``state`` (recorded, not run), kept for later calls."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(state, choice, eos)
        self._graphs[(state.batch, choice)] = graph
        if len(self._graphs) > MAX_CAPTURED_GRAPHS:
            self._graphs.popitem(last=False)
        return graph

    def _eos_tensor(self, eos_token_ids: tuple[int, ...], device: torch.device) -> Tensor | None:
        """The end tokens on the device, one tensor per set (a captured graph reads it at its address)."""
        if not eos_token_ids:
            return None
        if eos_token_ids not in self._eos:
            self._eos[eos_token_ids] = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
        return self._eos[eos_token_ids]


class _StopFlags:
    """A ring of :data:`STOP_CHECK_LAG` + 1 pinned host flags, each with its event, allocated once per loop:
    token ``n``'s flag goes to slot ``n % (STOP_CHECK_LAG + 1)``, which the host read (and synchronised on)
    before it launched token ``n``."""

    def __init__(self) -> None:
        self.slots = [(torch.empty(1, dtype=torch.bool, pin_memory=True), torch.cuda.Event())
                      for _ in range(STOP_CHECK_LAG + 1)]  # fmt: skip

    def record(self, made: int, any_unfinished: Tensor) -> None:
        flag, event = self.slots[made % len(self.slots)]
        flag.copy_(any_unfinished, non_blocking=True)
        event.record()

    def read(self, made: int) -> bool:
        flag, event = self.slots[made % len(self.slots)]
        event.synchronize()
        return bool(flag)


class _StopWatch:
    """When every row has finished: read from the device after each token (no ``flags``), or
    :data:`STOP_CHECK_LAG` tokens behind through the pinned ``flags``, so that the host never waits for
    the step it just launched. ``watching`` off (no end tokens): nothing is read."""

    def __init__(self, watching: bool, flags: _StopFlags | None) -> None:
        self.watching, self.flags = watching, flags
        self._pending: collections.deque[int] = collections.deque()
        """The tokens whose flags the host has not read yet."""

    def after(self, made: int, any_unfinished: Tensor) -> int | None:
        """Called after token ``made`` was launched; returns the sequences' length once it is known."""
        if not self.watching:
            return None
        if self.flags is None:
            return None if bool(any_unfinished) else made
        self.flags.record(made, any_unfinished)
        self._pending.append(made)
        return self._check() if len(self._pending) > STOP_CHECK_LAG else None

    def finish(self, made: int) -> int:
        """The sequences' length after the last token: the first pending flag that says all finished."""
        while self._pending:
            finished = self._check()
            if finished is not None:
                return finished
        return made

    def _check(self) -> int | None:
        made = self._pending.popleft()
        assert self.flags is not None, "only the asynchronous watch keeps pending flags"
        return None if self.flags.read(made) else made
