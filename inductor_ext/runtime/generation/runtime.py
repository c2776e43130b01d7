"""``load_generation``: run a package from :func:`~inductor_ext.runtime.generation.export_generation` as
transformers' ``generate`` does, greedy or sampled, with the KV cache owned here.

The loop, per call of :meth:`GenerationPackage.generate`: one prefill call with the prompt (its
``position_ids`` count only the real tokens of a left-padded row, as ``generate`` computes them), then
one decode step per new token (:mod:`inductor_ext.runtime.generation.decode_loop`: the package's static
decode graph for the batch size if it has one, the token choice and the next step's inputs, replayed as
one CUDA graph on a GPU). A row that emits an end-of-sequence token is finished; its later tokens are the
pad token; the loop stops when every row is finished or after ``max_new_tokens``. Sampling applies
temperature, then top-k, then draws from the softmax with ``torch.multinomial``, in transformers' order:
with the same ``torch.manual_seed`` and the same logits, the same tokens.
"""

import math
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inductor_ext.runtime.export import Package, load_models
from inductor_ext.runtime.generation.cache_layout import layer_caches
from inductor_ext.runtime.generation.decode_loop import DecodeLoop, DecodeState, TokenChoice
from inductor_ext.runtime.generation.metadata import decode, decode_graph_name


class GenerationPackage:
    """A loaded generation package; :meth:`generate` is its entry point. ``device``: where it runs, of
    the device type it was exported for (a CUDA package on ``cuda:N``); default, that type's default.

    The package owns one KV cache, so it generates for one call at a time: calls from several threads
    wait for each other. Its graphs are loaded single-threaded (AOTInductor's per-call synchronisation
    off), which CUDA graph capture needs."""

    def __init__(self, path: str | Path, device: torch.device | str | None = None) -> None:
        models = load_models(path, device, single_threaded=True)
        found = decode(models["model"].get_metadata()) if "model" in models else {}
        if not found:
            raise ValueError(f"load_generation: {path} is not a generation package (export_generation writes one)")
        self.device = torch.device(found["device"] if device is None else device)
        self.step = models["model"]
        sizes = [int(n) for n in found.get("decode_batch_sizes", "").split(",") if n]
        self.decode_steps = {n: models[decode_graph_name(n)] for n in sizes}
        """The static decode graphs by batch size (other batches decode with :attr:`step`)."""
        self.max_batch_size = int(found["max_batch_size"])
        self.max_seq_len = int(found["max_seq_len"])
        self.vocab_size = int(found["vocab_size"])
        self.pad_token_id = int(found["pad_token_id"]) if found["pad_token_id"] else None
        self.eos_token_ids = tuple(int(e) for e in found["eos_token_ids"].split(",") if e)
        """The model's end-of-sequence tokens (``generate``'s ``eos_token_id`` replaces them)."""
        shape = [int(n) for n in found["kv_cache_shape"].split(",")]
        self.kv_cache = torch.zeros(shape, dtype=getattr(torch, found["dtype"]), device=self.device)
        self._slots = torch.zeros(self.max_batch_size, self.max_seq_len, dtype=torch.long, device=self.device)
        self._cache_positions = torch.arange(self.max_seq_len, device=self.device)  # sliced per call: no copies
        self._states: dict[int, DecodeState] = {}
        self._loop = DecodeLoop(self._decode_graph, cuda_graphs=self.device.type == "cuda")
        self._lock = threading.Lock()

    def _decode_graph(self, batch: int) -> Package:
        return self.decode_steps.get(batch, self.step)

    def _state(self, batch: int) -> DecodeState:
        """The decode loop's tensors for ``batch`` rows, at the same addresses on every call (graphs read them)."""
        if batch not in self._states:
            cache = layer_caches(self.kv_cache, batch)
            self._states[batch] = DecodeState(batch, self.max_seq_len, self._slots[:batch], cache)
        return self._states[batch]

    def _check(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        max_new_tokens: int,
        pad_token_id: int | None,
        eos_token_id: int | list[int] | None,
    ) -> None:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("generate: input_ids must be an int64 tensor of shape (batch, prompt length)")
        for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask)):
            if isinstance(tensor, Tensor) and tensor.device.type not in ("cpu", self.device.type):
                raise ValueError(
                    f"generate: {name} must be on the CPU or on the package's device type "
                    f"{self.device.type!r}, got a tensor on {tensor.device}"
                )
        batch, length = input_ids.shape
        if not 1 <= batch <= self.max_batch_size:
            raise ValueError(
                f"generate: batch {batch} is outside the package's 1..{self.max_batch_size} (max_batch_size)"
            )
        if length < 1:
            raise ValueError(f"generate: the prompt is empty (input_ids of shape {tuple(input_ids.shape)})")
        if not _is_int(max_new_tokens):
            raise TypeError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens}")
        if pad_token_id is not None:
            if not _is_int(pad_token_id):
                raise TypeError(f"generate: pad_token_id must be an int, got {pad_token_id!r}")
            if not 0 <= pad_token_id < self.vocab_size:  # a finished row's next input
                raise ValueError(f"generate: pad_token_id must lie in [0, {self.vocab_size}), got {pad_token_id}")
        if eos_token_id is not None and not (
            _is_int(eos_token_id) or (isinstance(eos_token_id, (list, tuple)) and all(map(_is_int, eos_token_id)))
        ):
            raise TypeError(f"generate: eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
        if length + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"generate: prompt length {length} + max_new_tokens {max_new_tokens} exceeds the package's "
                f"max_seq_len {self.max_seq_len}"
            )
        checks = [((input_ids >= 0) & (input_ids < self.vocab_size)).all()]
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
                got = (
                    tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
                )
                raise ValueError(
                    f"generate: attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {got}"
                )
            mask = attention_mask.to(input_ids.device)
            checks += [((mask == 0) | (mask == 1)).all(), (mask != 0).any(dim=1).all()]
        # one host sync for every check of the values
        in_vocabulary, *mask_checks = torch.stack(checks).tolist()
        if not in_vocabulary:
            raise ValueError(f"generate: input_ids must lie in [0, {self.vocab_size}) (the model's vocabulary)")
        if mask_checks and not mask_checks[0]:
            raise ValueError(
                "generate: attention_mask must hold only 0 (padding) and 1 (a real token), got other values"
            )
        if mask_checks and not mask_checks[1]:
            raise ValueError("generate: every row of attention_mask needs a real token (a 1)")

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = 50,
        pad_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        streamer: Any = None,
    ) -> Tensor:
        """The prompt and its continuation, ``(batch, prompt + generated)``, as ``generate`` returns them.

        The sampling defaults are transformers' ``GenerationConfig`` defaults (temperature 1, top-k 50);
        ``top_k=None`` samples from the whole vocabulary. ``attention_mask`` is ``generate``'s: 1 for a real
        token, 0 for (left) padding, in any dtype. ``pad_token_id`` (written after a row's end)
        defaults to the model's, else its first end-of-sequence token, as ``generate`` chooses it;
        ``eos_token_id`` replaces the model's end-of-sequence tokens. ``streamer`` (e.g. transformers'
        ``TextStreamer``) gets what ``generate`` gives it: ``put`` of the prompt, then of each new token
        (on the CPU: a host sync per token), and ``end``."""
        self._check(input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id)
        _check_choice(do_sample, temperature, top_k, streamer)
        eos = self.eos_token_ids if eos_token_id is None else eos_token_id
        choice = TokenChoice(
            do_sample=do_sample,
            temperature=float(temperature),
            top_k=top_k,
            pad_token_id=self.pad_token_id if pad_token_id is None else pad_token_id,
            eos_token_ids=tuple([eos] if isinstance(eos, int) else eos),
        )
        with self._lock:
            return self._generate(input_ids, max_new_tokens, attention_mask, choice, streamer)

    def _generate(
        self, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None, choice: TokenChoice, streamer: Any
    ) -> Tensor:
        batch, length = input_ids.shape
        input_ids = input_ids.to(self.device).contiguous()  # e.g. a slice ids[:, :n]: the package reads it dense
        if streamer is not None:
            streamer.put(input_ids.cpu())
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device, torch.long)
        state = self._state(batch)
        state.slots.zero_()
        state.slots[:, :length] = mask
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits = self.step(input_ids, positions, self._cache_positions[:length], state.slots, state.cache)
        state.start(positions, length)

        def on_token(made: int) -> None:
            streamer.put(state.generated[:, made - 1].cpu())

        made = self._loop.generate(state, choice, logits, max_new_tokens, None if streamer is None else on_token)
        if streamer is not None:
            streamer.end()
        return torch.cat([input_ids, state.generated[:, :made]], dim=1)


def _check_choice(do_sample: Any, temperature: Any, top_k: Any, streamer: Any) -> None:
    """``generate``'s token-choice arguments, checked as transformers' ``GenerationConfig`` checks them."""
    if not isinstance(do_sample, bool):
        raise TypeError(f"generate: do_sample must be True or False, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise TypeError(f"generate: temperature must be a finite number, got {temperature!r}")
    if top_k is not None and not _is_int(top_k):
        raise TypeError(f"generate: top_k must be an int >= 1 or None, got {top_k!r}")
    if do_sample and (temperature <= 0 or (top_k is not None and top_k < 1)):
        raise ValueError(f"generate: temperature must be > 0 and top_k >= 1, got {temperature}, {top_k}")
    if streamer is not None and not (
        callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
    ):
        raise TypeError(
            f"generate: streamer must have put(tokens) and end() methods (as transformers' TextStreamer), "
            f"got {type(streamer).__name__}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_generation(path: str | Path, device: torch.device | str | None = None) -> GenerationPackage:
    """Load a package written by :func:`~inductor_ext.runtime.generation.export_generation`, to run on ``device``
    (:class:`GenerationPackage`)."""
    return GenerationPackage(path, device)
