"""Generating a continuation to read: the model writes, jlens keeps every step's next-token distribution.

:func:`generate` runs the model's own forward with a key/value cache, one new token per step:
greedy at ``temperature=0`` (the same tokens as ``hf_model.generate(do_sample=False)``), else
sampling from ``softmax(logits / temperature)`` with a seeded generator (reproducible). Residual
edits (:mod:`jlens_core.reading.edit_hooks`) can be applied while it writes. The result,
a :class:`Generation`, goes straight into :func:`~jlens_core.reading.reader.read_prompt`, which
reads prompt and continuation in one pass and marks each position ``prompt`` or ``generated``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Int

from ..models.model import LensModel
from ..seeds import generator
from .edit_hooks import EditRunner

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 256  # what the app offers; the library accepts 1..MAX_NEW_TOKENS_LIMIT
MAX_NEW_TOKENS_LIMIT = 4096


@dataclass(eq=False)
class Generation:
    """A prompt and the continuation the model wrote for it.

    Attributes:
        prompt: the prompt as given (before any chat template).
        prompt_text: the text that was tokenized (``prompt`` inside the chat template when ``chat``).
        prompt_ids: ``int64[n_prompt]`` the prompt's token ids (with the tokenizer's special tokens).
        generated_ids: ``int64[n_generated]`` the new tokens, in order (an end-of-sequence token that
            stopped it included, as ``hf_model.generate`` does).
        top_ids / top_probs: ``[n_generated, top_k]``: for each step, the model's most probable next
            tokens and their probabilities (at temperature 1, whatever the sampling temperature).
        stop_reason: ``"max_new_tokens"``, ``"eos"`` or ``"stopped"`` (the progress callback asked).
        temperature, seed, chat: the settings it was generated with.
        model_name: the model's name.
        edits: ``repr`` of the residual edits applied while generating (empty: the clean model).
    """

    prompt: str
    prompt_text: str
    prompt_ids: np.ndarray
    generated_ids: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    stop_reason: str
    temperature: float
    seed: int | None
    chat: bool
    model_name: str
    edits: list[str] = field(default_factory=list)
    continuation: str = ""

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_generated(self) -> int:
        return len(self.generated_ids)

    @property
    def ids(self) -> np.ndarray:
        """``int64[n_prompt + n_generated]``: prompt then continuation."""
        return np.concatenate([self.prompt_ids, self.generated_ids]).astype(np.int64)

    def figure(self, model: Any, *, k: int = 5) -> Any:
        """At each generated step, the probability the model gave the token it wrote and its top-1, the
        step's top-k in the hover, as a Plotly figure (:func:`~jlens_core.figures.generation.generation_figure`).

        Args:
            model: the model that wrote it (names the tokens: anything with ``decode(ids)``).
            k: tokens in each step's hover.
        """
        from ..figures.generation import generation_figure

        return generation_figure(self, model.decode, k=k)

    def __repr__(self) -> str:
        return (f"Generation({self.n_prompt} prompt + {self.n_generated} generated tokens, "
                f"stop={self.stop_reason!r}, continuation={self.continuation[:60]!r})")


@dataclass
class GenerationProgress:
    """What the progress callback gets after each generated token.

    Attributes:
        step: tokens generated so far (1-based); total: ``max_new_tokens``.
        token_id: the token just generated; generation: the partial :class:`Generation` so far.
    """

    step: int
    total: int
    token_id: int
    generation: Generation


def eos_ids(model: LensModel) -> set[int]:
    """End-of-sequence ids: the model's generation config, else the tokenizer's."""
    ids: set[int] = set()
    config = getattr(model.hf_model, "generation_config", None)  # not every transformers model has one
    for source in (getattr(config, "eos_token_id", None), getattr(model.tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update(int(x) for x in (source if isinstance(source, (list, tuple)) else [source]))
        if ids:
            break
    return ids


def check_generate_args(prompt: Any, max_new_tokens: int, temperature: float, top_k: int) -> None:
    """Raise one-sentence ``ValueError`` for bad generation settings."""
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("The prompt is empty: give some text for the model to continue.")
    if not isinstance(max_new_tokens, (int, np.integer)) or not 1 <= int(max_new_tokens) <= MAX_NEW_TOKENS_LIMIT:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is out of range: give a whole number from 1 to "
                         f"{MAX_NEW_TOKENS_LIMIT} (the app offers up to {MAX_NEW_TOKENS}).")
    if not isinstance(temperature, (int, float)) or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0 = greedy).")
    if int(top_k) < 1:
        raise ValueError(f"top_k={top_k} must be at least 1.")


class _Stepper:
    """The model's forward for generation: with its key/value cache where it has one."""

    def __init__(self, model: LensModel) -> None:
        self.hf = model.hf_model
        params = inspect.signature(self.hf.forward).parameters
        self.keep_kwarg = "logits_to_keep" if "logits_to_keep" in params else (
            "num_logits_to_keep" if "num_logits_to_keep" in params else None)
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.cache = None

    def __call__(self, new_ids: torch.Tensor) -> torch.Tensor:
        """Run ``new_ids [1, n]`` after what was run before; the logits of the last position ``[vocab]``."""
        kwargs: dict[str, Any] = {"use_cache": True}
        if self.keep_kwarg:
            kwargs[self.keep_kwarg] = 1
        if self.cache is not None:
            kwargs[self.cache_kwarg] = self.cache
        out = self.hf(input_ids=new_ids, **kwargs)
        self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if self.cache is None:
            raise RuntimeError(f"{type(self.hf).__name__} returned no key/value cache.")
        return out.logits[0, -1]


def generate(model: LensModel, prompt: str | Iterable[int] | Int[torch.Tensor, "*shape"], *,
             max_new_tokens: int = 32,
             temperature: float = 0.0, seed: int | None = None, chat: bool = False, stop_at_eos: bool = True,
             top_k: int = 10, edits: Iterable[Any] | None = None,
             progress: Callable[[GenerationProgress], bool | None] | None = None) -> Generation:
    """Let the model continue ``prompt`` and keep each step's next-token distribution.

    Args:
        model: an :class:`~jlens_core.HFLensModel` (its ``hf_model`` runs, with a key/value cache).
        prompt: text (tokenized with the model's special tokens) or token ids ``[seq]`` / ``[1, seq]``.
        max_new_tokens: tokens to generate, 1..4096 (generation may stop earlier at end-of-sequence).
        temperature: 0 for greedy decoding (the same tokens as ``hf_model.generate(do_sample=False)``),
            else sampling from ``softmax(logits / temperature)``.
        seed: the sampling generator's seed (same seed, same continuation); ignored when greedy.
        chat: wrap the prompt text in the model's chat template (``model.chat``) first.
        stop_at_eos: stop after the model writes an end-of-sequence token.
        top_k: next tokens kept per step in ``top_ids`` / ``top_probs``.
        edits: residual edits applied while generating (:mod:`jlens_core.reading.edit_hooks`).
        progress: called after each token with a :class:`GenerationProgress`; returning ``True``
            stops generation there (``stop_reason="stopped"``), keeping what was generated.

    Returns:
        A :class:`Generation`.

    Raises:
        ValueError: an empty prompt, ``max_new_tokens`` out of range, ``temperature < 0``,
            ``chat=True`` on a tokenizer without a chat template.
    """
    check_generate_args(prompt, max_new_tokens, temperature, top_k)
    if isinstance(prompt, str):
        text = model.chat(prompt) if chat else prompt
        ids = model.encode(text)  # [1, seq]
    else:
        if chat:
            raise ValueError("chat=True needs the prompt as text (the template wraps text), not token ids.")
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1).to(model.device)
        if ids.shape[1] == 0:
            raise ValueError("The prompt has no tokens: give some text for the model to continue.")
        text = model.decode(ids[0].tolist())
    n_prompt = int(ids.shape[1])
    stops = eos_ids(model) if stop_at_eos else set()
    gen = generator(int(seed) if seed is not None else torch.initial_seed())
    runner = EditRunner(model, edits, n_prompt)
    edited, clean = _Stepper(model), (_Stepper(model) if runner.needs_clean else None)
    k = min(int(top_k), int(model.vocab_size))

    generated: list[int] = []
    top_ids: list[np.ndarray] = []
    top_probs: list[np.ndarray] = []
    result = Generation(prompt=prompt if isinstance(prompt, str) else text, prompt_text=text,
                        prompt_ids=ids[0].cpu().numpy().astype(np.int64), generated_ids=np.zeros(0, np.int64),
                        top_ids=np.zeros((0, k), np.int64), top_probs=np.zeros((0, k), np.float32),
                        stop_reason="max_new_tokens", temperature=float(temperature),
                        seed=None if seed is None else int(seed), chat=bool(chat),
                        model_name=str(model.name), edits=[repr(e) for e in runner.edits])
    new_ids = ids
    with torch.no_grad():
        for step in range(int(max_new_tokens)):
            start = n_prompt + len(generated) - int(new_ids.shape[1])
            positions = torch.arange(start, start + int(new_ids.shape[1]))  # [n] absolute
            logits = runner.run(functools.partial(edited, new_ids), positions,
                                clean_forward=functools.partial(clean, new_ids) if clean is not None else None)
            logits = logits.float()  # [vocab]
            values, indices = logits.softmax(-1).topk(k)
            if temperature == 0:
                token = int(logits.argmax())
            else:
                sample_p = (logits / float(temperature)).softmax(-1).cpu()
                token = int(torch.multinomial(sample_p, 1, generator=gen))
            generated.append(token)
            top_ids.append(indices.cpu().numpy().astype(np.int64))
            top_probs.append(values.cpu().numpy().astype(np.float32))
            _update(result, model, generated, top_ids, top_probs)
            asked_to_stop = bool(progress(GenerationProgress(step + 1, int(max_new_tokens), token, result))) \
                if progress is not None else False
            if token in stops:
                result.stop_reason = "eos"
                break
            if asked_to_stop:
                if step + 1 < int(max_new_tokens):
                    result.stop_reason = "stopped"
                break
            new_ids = torch.tensor([[token]], dtype=torch.long, device=ids.device)
    log.info("generated %d tokens (%s)", result.n_generated, result.stop_reason)
    return result


def _update(result: Generation, model: LensModel, generated: list[int], top_ids: list, top_probs: list) -> None:
    result.generated_ids = np.asarray(generated, dtype=np.int64)
    result.top_ids = np.stack(top_ids)
    result.top_probs = np.stack(top_probs)
    result.continuation = model.decode(generated)


__all__ = ["MAX_NEW_TOKENS", "Generation", "GenerationProgress", "check_generate_args", "eos_ids", "generate"]
