"""Conformance over every causal-LM architecture transformers ships (issue #21).

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model is built (the
config's size fields shrunk: 4 layers, width 64, a 300-token vocabulary) and four properties are
checked:

1. the adapter finds the layout (``HFLensModel`` builds);
2. ``unembed(last layer output)`` is the model's own logits (logit scales, soft-caps and
   multi-stream readouts applied);
3. ``jacobian_for_prompt`` equals the docs/method.md §2 definition computed here independently (full-sequence
   autograd, no cache, a perturbation leaf at every source layer) within 1e-4 relative Frobenius;
4. a reading (``read_prompt``) runs through the fitted lens.

An architecture transformers itself cannot build or run is skipped with the reason; one that jlens
declares unsupported (no residual stream) must raise the adapter's one-sentence ``ValueError``.

The default run is the full sweep (about a minute on 2 cores); ``JLENS_CONFORMANCE=sample`` (or
``pytest --conformance=sample``) checks a fixed sample (:data:`SAMPLE`) only. Every architecture outside the
sample, and the few slow ones in it (:data:`SLOW`), is marked ``slow``: the fast loop (``-m "not slow"``)
checks the rest of the sample. A markdown table::

    python tests/test_conformance.py [--full] > conformance.md
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from dataclasses import dataclass

import pytest
import torch

if __name__ == "__main__":  # run as a script: this checkout's jlens_core and the tests' conftest
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    os.path.dirname(os.path.abspath(__file__))]

from conftest import LONG_TEXT, TINY_VOCAB, make_tokenizer
from helpers import rel_frob

from jlens_core import HFLensModel, JacobianLens, read_prompt
from jlens_core.fitting.estimator import jacobian_for_prompt
from jlens_core.models.model import UnsupportedModelError
from jlens_core.models.recorder import ActivationRecorder, add_to_streams, residual_of

SEQ, SKIP = 12, 3
REL_TOL = 1e-4
N_LAYERS, WIDTH, FFN, HEADS, HEAD_DIM = 4, 64, 128, 4, 16

# The default run: every kind of problem of issue #21 plus the common families.
SAMPLE = (
    "llama", "qwen2", "gpt2", "gpt_neox", "opt", "phi", "gemma2", "cohere", "minicpm3", "granite",
    "bloom", "falcon", "mpt", "dbrx", "xglm", "openai-gpt", "ctrl", "lfm2", "mamba", "rwkv",
    "recurrent_gemma", "qwen3_next", "deepseek_v32", "bamba", "gemma3n_text", "bert", "falcon_h1",
    "deepseek_v4", "hy_v4", "kimi_linear", "qwen3_5", "xlnet", "prophetnet", "xlm", "mllama", "mistral",
    "gemma4_text", "inkling_text", "dory", "roberta",
)
# Sampled architectures over 5 s each on 2 cores (Mamba-style scans on CPU): marked slow, so the fast loop
# (-m "not slow") checks the rest of the sample and the whole suite checks them too.
SLOW = ("bamba", "falcon_h1", "kimi_linear")


@dataclass
class Result:
    arch: str
    outcome: str  # "passed" | "unsupported" | "skipped" | "failed"
    reason: str = ""
    seconds: float = 0.0


RESULTS: list[Result] = []


def all_architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def full_sweep() -> bool:
    return os.environ.get("JLENS_CONFORMANCE", "full").lower() != "sample"


# -- building a tiny model ---------------------------------------------------------------------
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers")
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "word_embed_proj_dim", "dim")
FFN_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim",
            "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "d_inner",
            "expert_intermediate_size", "dense_intermediate_size", "ffn_config_hidden")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
             "encoder_attention_heads")
KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "num_selected_experts", "moe_top_k")
SMALL = {  # other size fields: value (only where the config has the field and it is larger)
    "head_dim": HEAD_DIM, "q_lora_rank": 32, "kv_lora_rank": 32, "rotary_dim": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "index_n_heads": 2, "index_topk": 4, "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_d_conv": 4,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "n_groups": 1, "time_step_rank": 8,
    "attention_hidden_size": 64, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": TINY_VOCAB,
    "laurel_rank": 8, "num_kv_shared_layers": 1, "lru_width": 64, "block_width": 64, "n_group": 1, "topk_group": 1,
    "sliding_window": 8, "attention_window_size": 8, "n_shared_experts": 1, "num_shared_experts": 1,
    "max_position_embeddings": 512, "n_positions": 512, "first_k_dense_replace": 1, "mamba_expand": 2,
    "o_lora_rank": 32, "o_groups": 2, "num_nextn_predict_layers": 0, "conv_L_cache": 3, "chunk_size": 8,
    "memory_size": 8, "hc_sinkhorn_iters": 4, "layer_group_size": 2, "index_num_heads": 2,
    "hidden_size_global": WIDTH, "encoder_hash_byte_group_vocab": 1000, "linear_num_heads": 4, "linear_head_dim": 16,
    "adapter_in_dim": WIDTH, "adapter_input_size": WIDTH, "adapter_out_dim": WIDTH,
}
# Per-architecture fields that keep a shrunk config consistent.
EXTRA = {
    "mamba2": {"num_heads": 8},
    # defaults that transformers leaves None (the model cannot be built from the bare default)
    "deepseek_v2": {"num_experts_per_tok": 2},
    "hunyuan_v1_dense": {"head_dim": HEAD_DIM},
    "hunyuan_v1_moe": {"head_dim": HEAD_DIM},
    "ministral": {"head_dim": HEAD_DIM},
    "nemotron": {"num_key_value_heads": 2},
    "lfm2_moe": {"layer_types": ["conv", "conv", "full_attention", "conv"]},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "qwen4_exp": {"text_config": {"indexer_budget": 4, "indexer_compress_ratio": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16}},
    "qwen4_exp_text": {"indexer_budget": 4, "indexer_compress_ratio": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16},
    "reformer": {"axial_pos_embds_dim": [32, 32]},
    # two hybrid layers (the shared attention block is tied across them), attending over [h, embeddings]
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"], "attention_hidden_size": 2 * WIDTH},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},  # the modeling code needs both
}


def _overrides(config, *, text: bool) -> dict:
    """The size fields of ``config`` to shrink, as keyword arguments (sub-configs as full dicts)."""
    out: dict = {}

    def get(key):
        if isinstance(getattr(type(config), key, None), property):
            return None  # derived from other fields
        try:
            value = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a per-layer field that refuses a global read (Gemma 4)
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def lower(key, value):
        if key == "head_dim" and get("qk_rope_head_dim") is not None:
            return  # multi-head latent attention: head_dim is tied to the rope dims
        if get(key) is not None and get(key) > value:
            out[key] = value

    n_before = next((get(k) for k in LAYER_KEYS if get(k) is not None), None)
    heads_before = next((get(k) for k in HEAD_KEYS if get(k) is not None), None)
    for key in LAYER_KEYS:
        lower(key, N_LAYERS)
    for key in WIDTH_KEYS:
        lower(key, WIDTH)
    for key in FFN_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [FFN] * (N_LAYERS if len(value) == n_before else len(value))
        else:
            lower(key, FFN)
    for key in HEAD_KEYS:
        lower(key, HEADS)
    for key in KV_KEYS:
        value = get(key)
        if value is not None and value > 1:
            out[key] = HEADS if heads_before is not None and value >= heads_before else 2
    for key in EXPERT_KEYS:
        lower(key, 4)
    for key in TOPK_KEYS:
        lower(key, 2)
    for key, value in SMALL.items():
        lower(key, value)
    if text:
        for key in ("vocab_size", "n_vocab"):
            if get(key) is not None:
                out[key] = TINY_VOCAB
        for key, value in (("bos_token_id", 0), ("eos_token_id", 1), ("pad_token_id", 2),
                           ("decoder_start_token_id", 0), ("sep_token_id", 1), ("cls_token_id", 0)):
            current = getattr(config, key, None)
            if isinstance(current, int) and current >= TINY_VOCAB or isinstance(current, list):
                out[key] = value
        if hasattr(config, "is_decoder"):
            out["is_decoder"] = True
    if n_before and n_before > N_LAYERS:  # per-layer lists: keep the first N_LAYERS entries
        for key, value in list(vars(config).items()):
            if isinstance(value, (list, tuple)) and len(value) == n_before and key not in out:
                out[key] = type(value)(value[:N_LAYERS])
    for key, value in list(vars(config).items()):  # per-layer dicts keyed by layer index
        if isinstance(value, dict) and value and all(isinstance(k, int) for k in value):
            out[key] = {k: v for k, v in value.items() if k < N_LAYERS}
    try:  # heterogeneous configs (Gemma 4, dots3): per-layer overrides keyed by layer index
        per_layer = config.to_dict().get("per_layer_config")
    except Exception:  # noqa: BLE001
        per_layer = None
    if isinstance(per_layer, dict):
        out["per_layer_config"] = {k: v for k, v in per_layer.items() if int(k) < N_LAYERS}
    if isinstance(getattr(config, "mlp_only_layers", None), list):
        out["mlp_only_layers"] = [i for i in config.mlp_only_layers if i < N_LAYERS]
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and value is not config:
            out[key] = {**value.to_dict(), **_overrides(value, text=text)}
    return out


def tiny_config(arch: str):
    """The default config of ``arch`` with its size fields shrunk (4 layers, width 64, vocab 300)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(arch)
    overrides = _overrides(default, text=True)
    for key, value in EXTRA.get(arch, {}).items():
        overrides[key] = {**overrides[key], **value} if isinstance(overrides.get(key), dict) else value
    config = AutoConfig.for_model(arch, **overrides)
    config._attn_implementation = "eager"
    return config


def build(arch: str):
    """A tiny random ``*ForCausalLM`` of ``arch`` in fp32, eval mode; ``pytest.skip`` when transformers cannot."""
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(arch)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:
        raise _Skip(f"transformers cannot build its tiny config: {type(exc).__name__}: {_first_line(exc)}") from exc
    model.eval()
    if hasattr(model, "set_default_language"):  # X-MOD: a language adapter must be chosen
        model.set_default_language(next(iter(getattr(config, "languages", None) or ["en_XX"])))
    ids = prompt()
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception as exc:
        raise _Skip(f"transformers cannot run its tiny config: {type(exc).__name__}: {_first_line(exc)}") from exc
    return model


class _Skip(Exception):
    pass


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return text[:200]


def prompt() -> torch.Tensor:
    return make_tokenizer()(LONG_TEXT, return_tensors="pt")["input_ids"][:, :SEQ]


# -- the definition, independently ---------------------------------------------------------------
def definition(model: HFLensModel, ids: torch.Tensor, sources: list[int], target: int) -> dict[int, torch.Tensor]:
    """docs/method.md §2 on the full sequence, no cache: a zero perturbation leaf added at every source layer.

    Row ``i`` of ``J_l`` = mean over ``p in V`` of d(sum_{p' in V} h_T[p'] . e_i) / d delta_l[p].
    """
    seq = ids.shape[1]
    valid = torch.arange(SKIP, seq - 1)
    deltas: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    handles = []

    def hook(i):
        def fn(module, args, output):
            if i in sources:
                stream = output[0] if isinstance(output, (tuple, list)) else output
                d = torch.zeros(residual_of(model.layers[i], stream).shape, dtype=stream.dtype, requires_grad=True)
                deltas[i] = d
                new = add_to_streams(model.layers[i], stream, d)
                if isinstance(output, tuple):
                    return (new,) + tuple(output[1:])
                if isinstance(output, list):
                    return [new] + list(output[1:])
                return new
            if i == target:
                outs[i] = residual_of(model.layers[i], output[0] if isinstance(output, (tuple, list)) else output)
            return None
        return fn

    for i in sources + [target]:
        handles.append(model.layers[i].register_forward_hook(hook(i)))
    try:
        with torch.enable_grad():
            model.hf_model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    h_t = outs[target][0, valid]  # [n_valid, d]
    d = h_t.shape[-1]
    cot = torch.zeros(d, *h_t.shape, dtype=h_t.dtype)
    cot[torch.arange(d), :, torch.arange(d)] = 1
    grads = torch.autograd.grad(h_t, [deltas[i] for i in sources], grad_outputs=cot, is_grads_batched=True)
    return {i: g[:, 0, valid].sum(1).float() / len(valid) for i, g in zip(sources, grads)}


# -- one architecture ----------------------------------------------------------------------------
def check(arch: str) -> Result:
    """Run the four checks on ``arch``; raises ``AssertionError`` on a failed property."""
    start = time.time()
    try:
        hf = build(arch)
    except _Skip as exc:
        return Result(arch, "skipped", str(exc), time.time() - start)
    try:
        model = HFLensModel(hf, make_tokenizer(), name=f"tiny-{arch}")
    except UnsupportedModelError as exc:
        assert str(exc).count(". ") == 0 and str(exc).endswith("."), f"not one sentence: {exc}"
        return Result(arch, "unsupported", str(exc), time.time() - start)
    ids = prompt()
    # 2. unembed(last layer output) is the model's logits
    top = model.n_layers - 1
    with torch.no_grad(), ActivationRecorder(model.layers, [top]) as rec:
        logits = hf(input_ids=ids, use_cache=False).logits
    with torch.no_grad():
        mine = model.unembed(rec.activations[top])
    assert mine.shape == logits.shape, (arch, mine.shape, logits.shape)
    err = float((mine - logits).abs().max() / logits.abs().max().clamp_min(1e-12))
    assert err <= 1e-4, f"{arch}: unembed(last layer output) differs from the logits by {err:.2e} (relative)"
    # 3. the estimator equals the definition
    sources = list(range(top))
    got = jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=32, max_seq_len=SEQ)
    ref = definition(model, ids, sources, top)
    worst = max(rel_frob(got.jacobians[i], ref[i]) for i in sources)
    assert worst <= REL_TOL, f"{arch}: jacobian_for_prompt differs from the definition by {worst:.2e}"
    # 4. a reading runs
    lens = JacobianLens(got.jacobians, n_prompts=1, d_model=model.d_model, model_name=model.name)
    reading = read_prompt(model, lens, ids, top_k=3)
    assert len(reading.frame) == model.n_layers * SEQ
    return Result(arch, "passed", "", time.time() - start)


def _params() -> list:
    """The architectures to check; those outside :data:`SAMPLE`, and those in :data:`SLOW`, are marked
    ``slow`` (the fast loop checks the rest of the sample, the whole suite every architecture)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = all_architectures() if full_sweep() else [a for a in SAMPLE if a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    return [a if a in SAMPLE and a not in SLOW else pytest.param(a, marks=pytest.mark.slow) for a in archs]


@pytest.mark.parametrize("arch", _params())
def test_conformance(arch):
    try:
        result = check(arch)
    except AssertionError as exc:
        RESULTS.append(Result(arch, "failed", _first_line(exc)))
        raise
    except Exception as exc:
        RESULTS.append(Result(arch, "failed", f"{type(exc).__name__}: {_first_line(exc)}"))
        raise
    RESULTS.append(result)
    if result.outcome == "skipped":
        pytest.skip(f"{arch}: {result.reason}")


@pytest.mark.parametrize("arch, parts", [
    ("bloom", ("transformer", "transformer.h", "transformer.ln_f", "lm_head", None)),
    ("lfm2", ("model", "model.layers", "model.embedding_norm", "lm_head", None)),  # the norm after the layers
    ("bert", ("bert", "bert.encoder.layer", None, "cls.predictions.decoder", "cls")),  # post-norm, MLM head
    ("mbart", ("model.decoder", "model.decoder.layers", "model.decoder.layer_norm", "lm_head", None)),
])
def test_structural_layout_finds_the_parts(arch, parts):
    from jlens_core.models.layouts import find_layout

    layout = find_layout(build(arch))
    assert layout.name == "structural"
    assert (layout.base, layout.layers, layout.final_norm, layout.head, layout.readout) == parts


@pytest.mark.parametrize("arch, dtype, shortcut", [
    ("llama", torch.float32, True), ("llama", torch.bfloat16, True), ("gemma2", torch.float32, True),
    ("qwen3_next", torch.float32, False),  # linear-attention state in the cache
    ("mamba", torch.float32, False),  # state-space cache
    ("deepseek_v32", torch.float32, False),  # a sparse indexer that is not causal at this length
])
def test_prefix_cache_shortcut_is_kept_only_where_exact(arch, dtype, shortcut):
    model = HFLensModel(build(arch).to(dtype), make_tokenizer(), name=arch)
    got = jacobian_for_prompt(model, prompt(), skip_first=SKIP, method="batched", dim_batch=64)
    assert model._jlens_prefix_cache is shortcut
    if dtype == torch.float32:
        ref = definition(model, prompt(), list(range(model.n_layers - 1)), model.n_layers - 1)
        assert max(rel_frob(got.jacobians[i], ref[i]) for i in ref) <= REL_TOL


def test_unsupported_family_is_one_clear_sentence():
    hf = build("dory")
    with pytest.raises(ValueError, match=r"^DoryForCausalLM cannot be read by a lens: its layers run several "
                                         r"times per token \(looped depth\), so a layer has no single output "
                                         r"to read\.$"):
        HFLensModel(hf, make_tokenizer())


def test_sample_covers_every_kind_of_issue_21():
    archs = set(all_architectures())
    assert set(SAMPLE) <= archs, sorted(set(SAMPLE) - archs)
    assert len(SAMPLE) >= 25


def table(results: list[Result]) -> str:
    """A markdown table of ``results`` and the counts per outcome."""
    counts = {k: sum(r.outcome == k for r in results) for k in ("passed", "unsupported", "skipped", "failed")}
    lines = [", ".join(f"{v} {k}" for k, v in counts.items()) + f" (of {len(results)})", "",
             "| architecture | result | reason | seconds |", "|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.outcome != "passed", r.outcome, r.arch)):
        lines.append(f"| {r.arch} | {r.outcome} | {r.reason.replace('|', '/')} | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str], check_one=None, outcome_words: dict[str, str] | None = None) -> int:
    """Print the markdown table of ``check_one`` (default :func:`check`) over the sample, or ``--full``."""
    import logging

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    check_one = check_one or check
    archs = all_architectures() if "--full" in argv else list(SAMPLE)
    only = [a for a in argv if not a.startswith("--")]
    if only:
        archs = [a for a in archs if a in only or any(re.fullmatch(o, a) for o in only)]
    results = []
    for arch in archs:
        try:
            results.append(check_one(arch))
        except Exception as exc:  # noqa: BLE001
            results.append(Result(arch, "failed", f"{type(exc).__name__}: {_first_line(exc)}"))
        print(f"{results[-1].arch}: {results[-1].outcome} {results[-1].reason}", file=sys.stderr, flush=True)
    text = table(results)
    for word, shown in (outcome_words or {}).items():
        text = text.replace(word, shown)
    print(text)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
