"""The model adapter: one interface over any Hugging Face decoder-only causal LM (docs/method.md §5)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import nn

from .layouts import ModelLayout, find_layout, get_path
from .placement import execution_device, materialised
from .recorder import StreamReadout, set_stream_readout

log = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """A model family jlens cannot read (no residual stream); the message is one sentence naming why."""


# model_type -> why there is no residual stream a lens could read (one sentence each).
_LOOPED = "its layers run several times per token (looped depth), so a layer has no single output to read"
UNSUPPORTED: dict[str, str] = {
    "dory": _LOOPED,
    "hrm_text": _LOOPED,
    "inkling2_loop_text": _LOOPED,
    "inkling2_text": ("its output reads an attention-weighted mix of earlier block outputs (block attention "
                      "residuals), so no single residual stream carries the prediction"),
    "blt": ("it is a byte latent transformer whose stacks run over byte patches and an offset byte "
            "sequence, so no stack's positions line up with the tokens read"),
    "reformer": ("its reversible layers run inside one custom autograd function over two half-streams, so a "
                 "layer's output is neither hookable nor differentiable on its own"),
}

# Logit scales applied after the head, by config field: (field, "mul" | "div"); per-family overrides.
_LOGIT_SCALES: tuple[tuple[str, str], ...] = (("logit_scale", "mul"), ("logits_scaling", "div"),
                                              ("lm_head_multiplier", "mul"), ("output_multiplier", "mul"),
                                              ("logits_mup_width_multiplier", "div"))
_LOGIT_SCALE_OVERRIDES: dict[str, dict[str, str]] = {"hyperclovax": {"logits_scaling": "mul"}}


# Final-logit soft-cap fields: Gemma 2/3/3n, RecurrentGemma, xLSTM.
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


def weight_of(module: nn.Module) -> torch.Tensor:
    """``module.weight``, typed as the tensor it is (``nn.Module.__getattr__`` is typed ``Tensor | Module``)."""
    return cast(torch.Tensor, module.weight)


def logit_scale_of(config: Any) -> float:
    """The constant the model multiplies its head's output by (1.0 for most families).

    Cohere multiplies by ``logit_scale``; Granite and MiniCPM3 divide by ``logits_scaling``
    (HyperCLOVA X multiplies); Falcon-H1 multiplies by ``lm_head_multiplier``; Inkling divides by
    ``logits_mup_width_multiplier``.
    """
    model_type = getattr(config, "model_type", None)
    scale = 1.0
    for field, op in _LOGIT_SCALES:
        value = getattr(config, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            op = _LOGIT_SCALE_OVERRIDES.get(str(model_type), {}).get(field, op)
            scale = scale * value if op == "mul" else scale / value
    return float(scale)


def _stream_readout(base: nn.Module, config: Any) -> StreamReadout | None:
    """The stream collapse of a multi-stream decoder stack, ``None`` for a single-stream one."""
    hc_head = getattr(base, "hc_head", None)
    if hc_head is not None and getattr(config, "hc_mult", 1) > 1:
        # hyper-connections (DeepSeek-V4, HY-V4): block outputs are [batch, seq, streams, d]
        return StreamReadout(collapse=hc_head, stream_dim=2, description="hyper-connection streams (hc_head)")
    mixer = getattr(base, "hyper_connection_mixer", None)
    count = getattr(config, "hc_count", 1)
    if mixer is not None and isinstance(count, int) and count > 1:
        # Qwen4-exp: the streams side by side on the last axis, [batch, seq, streams * d]
        return StreamReadout(collapse=mixer, stream_dim=None, description="hyper-connection streams (mixer)",
                             lift=lambda x, delta: x + delta.repeat(*([1] * (delta.dim() - 1)), count))
    prompt_length = getattr(config, "prompt_length", 0)
    if getattr(config, "model_type", None) == "cpmant" and prompt_length > 0:
        # CPM-Ant prepends ``prompt_length`` learned prompt positions: the residual is the tokens' part
        def tokens_part(x: torch.Tensor) -> torch.Tensor:
            return x[:, prompt_length:]

        def lift_tokens(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, :prompt_length], x[:, prompt_length:] + delta], dim=1)

        return StreamReadout(collapse=tokens_part, stream_dim=None, lift=lift_tokens,
                             description="the positions after the learned prompt")
    if getattr(config, "model_type", None) == "xlnet":
        # time-major blocks: [seq, batch, d]
        return StreamReadout(collapse=lambda x: x.transpose(0, 1), stream_dim=None, description="time-major",
                             lift=lambda x, delta: x + delta.transpose(0, 1))
    ngram = getattr(config, "ngram", 0)
    if getattr(config, "model_type", None) == "prophetnet" and ngram > 0:
        # [batch, (1 + ngram) * seq, d]: the main stream, then the n-gram predicting streams; the
        # causal-LM logits read the first predicting stream, so that stream is the residual
        def first_predicting(x: torch.Tensor) -> torch.Tensor:
            n = x.shape[1] // (1 + ngram)
            return x[:, n: 2 * n]

        def lift(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
            n = x.shape[1] // (1 + ngram)
            return torch.cat([x[:, :n], x[:, n: 2 * n] + delta, x[:, 2 * n:]], dim=1)

        return StreamReadout(collapse=first_predicting, stream_dim=None, lift=lift,
                             description="the first n-gram predicting stream")
    unembed = getattr(base, "altup_unembed_projections", None)
    if unembed is not None:
        # Gemma3n AltUp: block outputs are [streams, batch, seq, d]; the model's own final collapse
        def collapse(hs: torch.Tensor) -> torch.Tensor:
            target = torch.mean(hs[0] ** 2, dim=-1, keepdim=True) ** 0.5
            parts = [hs[0]]
            for i in range(1, hs.shape[0]):
                cur = unembed[i - 1](hs[i]).to(hs.dtype)
                magnitude = torch.sqrt(torch.mean(cur ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
                parts.append(cur * target / magnitude)
            return torch.stack(parts).mean(dim=0)

        return StreamReadout(collapse=collapse, stream_dim=0, description="AltUp streams")
    return None


@runtime_checkable
class LensModel(Protocol):
    """What the estimator, the lenses, the readings and the edits need of a model.

    :class:`HFLensModel` implements it; every public function that takes a model is typed against it.
    Attributes are read-only here (a plain attribute implements each); see :class:`HFLensModel` for
    what each holds.
    """

    @property
    def n_layers(self) -> int: ...

    @property
    def d_model(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer (no common base class to name)

    @property
    def config(self) -> Any: ...  # the text config (a transformers PretrainedConfig)

    @property
    def hf_model(self) -> nn.Module: ...

    @property
    def layout(self) -> ModelLayout: ...

    @property
    def base(self) -> nn.Module: ...

    @property
    def embed(self) -> nn.Module: ...

    @property
    def final_norm(self) -> nn.Module | None: ...

    @property
    def pre_head(self) -> list[nn.Module]: ...

    @property
    def head(self) -> nn.Module: ...

    @property
    def stream_readout(self) -> StreamReadout | None: ...

    @property
    def layers(self) -> list[nn.Module]: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def encode(self, text: str, max_length: int | None = None) -> Int[torch.Tensor, "1 seq"]: ...

    def decode(self, token_ids: int | Sequence[int] | Int[torch.Tensor, "*shape"]) -> str: ...

    def chat(self, user: str, *, system: str | None = None, assistant_prefill: str | None = None) -> str: ...

    def forward(self, input_ids: Int[torch.Tensor, "batch seq"]) -> Float[torch.Tensor, "batch seq d_model"]: ...

    def run_with_cache(self, input_ids: Int[torch.Tensor, "batch seq"], cache: Any = None,
                       use_cache: bool = False) -> Any: ...

    def unembed(self, h: Float[torch.Tensor, "*batch d_model"], *,
                out: Float[torch.Tensor, "*batch vocab"] | None = None) -> Float[torch.Tensor, "*batch vocab"]: ...

    def fingerprint(self) -> dict: ...


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
        UnsupportedModelError: a family with no residual stream a lens can read (a ``ValueError``
            whose message is one sentence naming the reason).
        ValueError: the layout cannot be found (the message lists what was looked for).
    """

    def __init__(self, hf_model: nn.Module, tokenizer: Any, *, layout: ModelLayout | None = None,
                 name: str | None = None) -> None:
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        config: Any = getattr(hf_model, "config", None)  # a transformers config, or none on a bare module
        model_type = getattr(config, "model_type", None)
        if layout is None and model_type in UNSUPPORTED:
            raise UnsupportedModelError(f"{type(hf_model).__name__} cannot be read by a lens: "
                                        f"{UNSUPPORTED[model_type]}.")
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
        self.readout: nn.Module | None = get_path(hf_model, self.layout.readout)
        try:
            text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        except ValueError:  # several text configs (an encoder-decoder): the decoder's
            text_config = getattr(config, "decoder", config)
        self.config = text_config
        cross = getattr(text_config, "cross_attention_layers", None)
        if layout is None and isinstance(cross, (list, tuple)) and cross:
            # Mllama: the cross-attention layers are skipped on text alone; they carry no text residual
            self._layers = [block for i, block in enumerate(self._layers) if i not in set(cross)]
        self.softcap: float | None = next((value for value in (
            getattr(text_config, key, None) for key in _SOFTCAPS) if isinstance(value, (int, float)) and value),
            None)
        self.logit_scale: float = logit_scale_of(text_config)
        unpadded = getattr(text_config, "unpadded_vocab_size", None)
        self.unpadded_vocab: int = int(unpadded) if isinstance(unpadded, int) and unpadded > 0 else 1 << 62
        self.stream_readout: StreamReadout | None = _stream_readout(self.base, text_config)
        set_stream_readout(self._layers, self.stream_readout)
        self.n_layers = len(self._layers)
        self.d_model = int(self._infer_d_model())
        self.vocab_size = int(min(weight_of(self.head).shape[0], self.unpadded_vocab))
        self.name = name or getattr(config, "_name_or_path", None) or type(hf_model).__name__
        params = inspect.signature(self.base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _infer_d_model(self) -> int:
        for attr in ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"):
            value = getattr(self.config, attr, None)
            if isinstance(value, int):
                return value
        return int(weight_of(self.head).shape[1])

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
        """Where the input ids go: the embedding's execution device (its accelerate hook's, under a
        ``device_map``; outputs come back on the last layer's or the head's device)."""
        return execution_device(self.embed)

    @property
    def dtype(self) -> torch.dtype:
        return weight_of(self.embed).dtype

    # -- text ----------------------------------------------------------------------------------
    def encode(self, text: str, max_length: int | None = None) -> Int[torch.Tensor, "1 seq"]:
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

    def decode(self, token_ids: int | Sequence[int] | Int[torch.Tensor, "*shape"]) -> str:
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
    def forward(self, input_ids: Int[torch.Tensor, "batch seq"],
                **kwargs: Any) -> Float[torch.Tensor, "batch seq d_model"]:
        """Run the decoder stack (embedding, layers, final norm), without the output head.

        Args:
            input_ids: ``[batch, seq]``.
            **kwargs: passed to the base model (``attention_mask``, a cache, ``position_ids``).

        Returns:
            ``[batch, seq, d_model]``: the final-normed hidden state the head reads.
        """
        kwargs.setdefault("use_cache", False)  # a lens never needs the cache of a plain forward
        out = self.base(input_ids=input_ids, **kwargs)
        return out[0] if isinstance(out, tuple) else out.last_hidden_state

    def run_with_cache(self, input_ids: Int[torch.Tensor, "batch seq"], cache: Any = None,
                       use_cache: bool = False) -> Any:
        """Run the base model on ``input_ids`` continuing from ``cache``; returns the new cache.

        Positions continue from the cache's length. Used by the estimator to run a prefix once
        without gradients and the rest of the prompt on top of it.
        """
        kwargs = {"use_cache": use_cache or cache is not None}
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        out = self.base(input_ids=input_ids, **kwargs)
        return getattr(out, "cache", None) if hasattr(out, "cache") else getattr(out, "past_key_values", None)

    def unembed(self, h: Float[torch.Tensor, "*batch d_model"], *,
                out: Float[torch.Tensor, "*batch vocab"] | None = None) -> Float[torch.Tensor, "*batch vocab"]:
        """Final norm, then the output head; then the model's logit scale and soft-cap, if any.

        The readout is the model's own: a pre-head or readout module (OPT's ``project_out``, BERT's
        prediction head), the constant logit scale of :func:`logit_scale_of` (Cohere, Granite,
        MiniCPM3, Falcon-H1), then the soft-cap (Gemma 2/3, RecurrentGemma, xLSTM). For a
        multi-stream model ``h`` is the collapsed residual (:mod:`jlens_core.models.recorder`).

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
        padded = self.unpadded_vocab < weight_of(self.head).shape[0]  # a head padded past the vocabulary (Inkling)
        if self.readout is not None:
            logits = self.readout(x)
            logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        else:
            for module in self.pre_head:
                x = module(x)
            weight = weight_of(self.head)
            if (out is not None and not padded and isinstance(self.head, nn.Linear) and self.head.bias is None
                    and x.device == weight.device == out.device):  # not offloaded, not on another device
                logits = torch.matmul(x, weight.t(), out=out)  # straight into the caller's array
            else:
                logits = self.head(x)
        if padded:
            logits = logits[..., : self.unpadded_vocab]
        if out is not None and logits is not out:
            logits = out.copy_(logits)
        return self.scale_and_cap(logits, inplace=out is not None or not logits.requires_grad)

    def scale_and_cap(self, logits: Float[torch.Tensor, "*batch vocab"], *,
                      inplace: bool = False) -> Float[torch.Tensor, "*batch vocab"]:
        """The model's logit scale, then its soft-cap, applied to head outputs (what :meth:`unembed` does
        after the head): ``cap * tanh(scale * logits / cap)``, or ``scale * logits`` without a cap.

        Args:
            logits: ``[..., vocab]`` head outputs.
            inplace: overwrite ``logits`` (no autograd through it then); else out of place, differentiable.
        """
        if self.logit_scale != 1.0:
            logits = logits.mul_(self.logit_scale) if inplace else logits * self.logit_scale
        if self.softcap:
            logits = (logits.div_(self.softcap).tanh_().mul_(self.softcap) if inplace
                      else torch.tanh(logits / self.softcap) * self.softcap)
        return logits

    def fingerprint(self) -> dict:
        """A dtype- and device-stable identity of the unembedding, to tell lens files apart.

        Holds the head's shape and the L2 norms of its first 8 rows (compared with a tolerance); an
        offloaded head is materialised for the read (:func:`~jlens_core.models.placement.materialised`).
        """
        with materialised(self.head):
            w = weight_of(self.head)
            rows = w[: min(8, w.shape[0])].detach().float().cpu()
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


if TYPE_CHECKING:  # mypy checks here that the adapter implements the protocol every signature takes
    _implements_lens_model: type[LensModel] = HFLensModel


# Cache layers holding plain attention keys/values: a prefix run once and continued is exact.
_PLAIN_CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer")


def kv_cache_problem(cache: Any) -> str | None:
    """Why ``cache`` (a transformers cache from ``run_with_cache(..., use_cache=True)``) is not plain attention
    keys/values (``None`` when it is): a prefix run once and continued is then not exact, and the relevance
    rules do not cover the state it holds."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return f"its cache is a {type(cache).__name__}, not a layered key/value cache"
    other = sorted({type(layer).__name__ for layer in layers} - set(_PLAIN_CACHE_LAYERS))
    if other:
        return f"its cache holds {', '.join(other)} (recurrent, convolutional or indexer state)"
    return None
