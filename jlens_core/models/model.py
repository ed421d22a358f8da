"""The model adapter: one interface over any Hugging Face decoder-only causal LM (SPEC §5)."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .layouts import ModelLayout, find_layout, get_path

log = logging.getLogger(__name__)


@runtime_checkable
class LensModel(Protocol):
    """What the estimator, the lenses and the analysis need of a model."""

    n_layers: int
    d_model: int
    name: str

    @property
    def layers(self) -> list[nn.Module]: ...

    def encode(self, text: str, max_length: int | None = None) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def unembed(self, h: torch.Tensor) -> torch.Tensor: ...

    def decode(self, token_ids) -> str: ...


class HFLensModel:
    """Adapter over a Hugging Face ``*ForCausalLM`` model and its tokenizer.

    The wrapped model is put in eval mode and all its parameters are frozen
    (``requires_grad_(False)``): the lens differentiates with respect to activations only.

    Attributes:
        hf_model: the wrapped Hugging Face model.
        tokenizer: its tokenizer.
        n_layers: number of decoder layers ``L``.
        d_model: residual width ``d``.
        vocab_size: rows of the output head.
        layout: where the parts were found (see :mod:`jlens_core.models.layouts`).
        name: model identity (``config._name_or_path`` unless given).

    Raises:
        ValueError: the layout cannot be found (the message lists what was looked for).
    """

    def __init__(self, hf_model: nn.Module, tokenizer: Any, *, layout: ModelLayout | None = None,
                 name: str | None = None) -> None:
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.layout = layout if layout is not None else find_layout(hf_model)
        hf_model.eval()
        hf_model.requires_grad_(False)

        self.base: nn.Module = get_path(hf_model, self.layout.base)
        self._layers = list(get_path(hf_model, self.layout.layers) or [])
        self.final_norm: nn.Module | None = get_path(hf_model, self.layout.final_norm)
        self.embed: nn.Module = get_path(hf_model, self.layout.embed)
        self.head: nn.Module = get_path(hf_model, self.layout.head)
        missing = [f"{part}={path!r}" for part, path, found in (
            ("base", self.layout.base, self.base), ("layers", self.layout.layers, self._layers),
            ("embed", self.layout.embed, self.embed), ("head", self.layout.head, self.head))
            if found is None or (part == "layers" and not found)]
        if missing:
            raise ValueError(f"Layout {self.layout.name!r} does not match {type(hf_model).__name__}: "
                             f"nothing found at {', '.join(missing)}.")
        self.pre_head: list[nn.Module] = [m for m in (get_path(hf_model, p) for p in self.layout.pre_head)
                                          if m is not None]
        config = getattr(hf_model, "config", None)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.config = text_config
        self.softcap: float | None = getattr(text_config, "final_logit_softcapping", None) or None
        self.n_layers = len(self._layers)
        self.d_model = int(self._infer_d_model())
        self.vocab_size = int(self.head.weight.shape[0])
        self.name = name or getattr(config, "_name_or_path", None) or type(hf_model).__name__
        params = inspect.signature(self.base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _infer_d_model(self) -> int:
        for attr in ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"):
            value = getattr(self.config, attr, None)
            if isinstance(value, int):
                return value
        return int(self.head.weight.shape[1])

    def __repr__(self) -> str:
        return (f"HFLensModel({self.name!r}, layout={self.layout.name!r}, n_layers={self.n_layers}, "
                f"d_model={self.d_model}, vocab={self.vocab_size})")

    # -- parts ---------------------------------------------------------------------------------
    @property
    def layers(self) -> list[nn.Module]:
        """The decoder-layer modules, in order."""
        return self._layers

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    # -- text ----------------------------------------------------------------------------------
    def encode(self, text: str, max_length: int | None = None) -> torch.Tensor:
        """Tokenize ``text`` (with the tokenizer's special tokens, e.g. BOS), truncated.

        Returns:
            LongTensor ``[1, seq]`` on the model's device.

        Raises:
            ValueError: ``text`` is empty or tokenizes to nothing.
        """
        if not isinstance(text, str) or not text:
            raise ValueError("The prompt is empty: give some text to encode.")
        ids = self.tokenizer(text, return_tensors="pt", truncation=max_length is not None,
                             max_length=max_length)["input_ids"]
        if ids.numel() == 0:
            raise ValueError(f"The prompt {text[:40]!r} tokenizes to no tokens.")
        return ids.to(self.device)

    def decode(self, token_ids) -> str:
        """Token ids (int, list or tensor) back to text."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() == 2 and token_ids.shape[0] == 1:  # what encode returns
                token_ids = token_ids[0]
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.tokenizer.decode(token_ids)

    def chat(self, user: str, *, system: str | None = None, assistant_prefill: str | None = None) -> str:
        """The prompt text an instruct model reads: ``user`` wrapped in the tokenizer's chat template.

        ``assistant_prefill`` is appended after the assistant turn's header, so the reading starts
        inside the model's answer.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"The tokenizer of {self.name!r} has no chat template; use the plain prompt.")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + (assistant_prefill or "")

    # -- compute -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Run the decoder stack (embedding, layers, final norm), without the output head.

        Args:
            input_ids: ``[batch, seq]``.
            **kwargs: passed to the base model (``attention_mask``, a cache, ``position_ids``).

        Returns:
            ``[batch, seq, d_model]``: the final-normed hidden state the head reads.
        """
        out = self.base(input_ids=input_ids, **kwargs)
        return out[0] if isinstance(out, tuple) else out.last_hidden_state

    def run_with_cache(self, input_ids: torch.Tensor, cache=None, use_cache: bool = False):
        """Run the base model on ``input_ids`` continuing from ``cache``; returns the new cache.

        Positions continue from the cache's length. Used by the estimator to run a prefix once
        without gradients and the rest of the prompt on top of it.
        """
        kwargs = {"use_cache": use_cache or cache is not None}
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        out = self.base(input_ids=input_ids, **kwargs)
        return getattr(out, "cache", None) if hasattr(out, "cache") else getattr(out, "past_key_values", None)

    def unembed(self, h: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm, then the output head (and soft-capping where the config has it).

        Args:
            h: ``[..., d_model]`` pre-final-norm residuals, any dtype.
            out: an optional ``[..., vocab]`` array of the model's dtype to write the logits into (a
                caller unembedding many chunks reuses one, sparing a fresh array's page faults).

        Returns:
            ``[..., vocab]`` logits in the model's dtype (``out`` when given).
        """
        x = h.to(self.dtype)
        if self.final_norm is not None:
            x = self.final_norm(x)
        for module in self.pre_head:
            x = module(x)
        if out is not None and isinstance(self.head, nn.Linear) and self.head.bias is None:
            logits = torch.matmul(x, self.head.weight.t(), out=out)
        elif out is not None:
            logits = out.copy_(self.head(x))
        else:
            logits = self.head(x)
        if self.softcap:
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def fingerprint(self) -> dict:
        """A dtype- and device-stable identity of the unembedding, to tell lens files apart.

        Holds the head's shape and the L2 norms of its first 8 rows (compared with a tolerance).
        """
        w = self.head.weight
        rows = w[: min(8, w.shape[0])].detach().float()
        return {"vocab_size": int(w.shape[0]), "d_model": self.d_model,
                "row_norms": [round(float(x), 5) for x in rows.norm(dim=-1)]}


def same_fingerprint(a: dict | None, b: dict | None, rtol: float = 2e-2) -> bool:
    """Whether two :meth:`HFLensModel.fingerprint` dicts describe the same unembedding."""
    if not a or not b:
        return True  # unknown identity (e.g. a reference-library file): cannot tell, do not refuse
    if a.get("vocab_size") != b.get("vocab_size") or a.get("d_model") != b.get("d_model"):
        return False
    na, nb = a.get("row_norms", []), b.get("row_norms", [])
    if len(na) != len(nb):
        return False
    return all(abs(x - y) <= rtol * max(abs(x), abs(y), 1e-6) for x, y in zip(na, nb))
