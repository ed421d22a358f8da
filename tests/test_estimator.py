"""The per-prompt estimator (docs/method.md §2) against the definition, a closed-form toy, and the recorder.

The reference here is written independently of ``jlens_core``: the full per-position Jacobian of the
target layer's residual with respect to layer ``l``'s residual, by ``torch.autograd.functional.jacobian``
through the plain Hugging Face model on the whole sequence (no cache, no truncation of the last token,
no early stop), then the docs/method.md §2 reduction.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from conftest import FAMILIES, LONG_TEXT, make_hf_model, make_tiny
from helpers import rel_frob, tiny
from torch import nn

from jlens_core import (
    ActivationRecorder,
    HFLensModel,
    ModelLayout,
    jacobian_for_prompt,
    resolve_layers,
    valid_position_mask,
)
from jlens_core.fitting.fused import (
    FusedMismatchError,
    backward_layer,
    fused_jacobians,
    fused_unsupported_reason,
    layer_major_bytes,
    mlp_jacobians,
    prepare_layers,
    use_layer_major,
)

SEQ = 14  # tokens per test prompt
SKIP = 3  # a non-trivial skip_first
DIM_BATCH = 5  # does not divide d_model = 32
REL_TOL = 1e-5


# -- the definition, independently ----------------------------------------------------------------
def _residual(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _with_residual(output, new):
    if isinstance(output, tuple):
        return (new, *output[1:])
    if isinstance(output, list):
        return [new, *output[1:]]
    return new


def full_jacobian(hf_model, layers, ids: torch.Tensor, source: int, target: int) -> torch.Tensor:
    """``J[p', i, p, j] = d h_target[p', i] / d h_source[p, j]`` on the full sequence: ``[S, d, S, d]``."""
    seen = {}
    handle = layers[source].register_forward_hook(lambda m, a, o: seen.__setitem__("h", _residual(o).detach()))
    try:
        with torch.no_grad():
            hf_model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    x0 = seen["h"][0].clone()

    def f(x):
        out = {}
        h1 = layers[source].register_forward_hook(lambda m, a, o: _with_residual(o, x.unsqueeze(0)))
        h2 = layers[target].register_forward_hook(lambda m, a, o: out.__setitem__("t", _residual(o)))
        try:
            hf_model(input_ids=ids, use_cache=False)
        finally:
            h1.remove()
            h2.remove()
        return out["t"][0]

    with torch.enable_grad():
        return torch.autograd.functional.jacobian(f, x0, vectorize=True)


def reduce_definition(full: torch.Tensor, seq_len: int, skip_first: int) -> torch.Tensor:
    """docs/method.md §2: row ``i`` = mean over sources ``p in V`` of ``sum_{p' in V} J[p', i, p, :]``."""
    valid = list(range(skip_first, seq_len - 1))
    d = full.shape[1]
    out = torch.zeros(d, d, dtype=torch.float64)
    for p in valid:
        for p_t in valid:
            out += full[p_t, :, p, :].double()
    return out / len(valid)


@functools.cache
def prompt_ids(family: str) -> torch.Tensor:
    ids = tiny(family).encode(LONG_TEXT, max_length=SEQ)
    assert ids.shape == (1, SEQ)
    return ids


@functools.cache
def reference(family: str, source: int, target: int, skip_first: int = SKIP) -> torch.Tensor:
    model = tiny(family)
    ids = prompt_ids(family)
    full = full_jacobian(model.hf_model, model.layers, ids, source, target)
    return reduce_definition(full, ids.shape[1], skip_first)


# -- against the definition -----------------------------------------------------------------------
FUSED_FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gemma2", "gpt2", "gpt_neox", "phi")


@pytest.mark.parametrize("method", ["batched", "replicated", "auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_definition_at_every_source_layer(family, method):
    model = tiny(family)
    result = jacobian_for_prompt(model, prompt_ids(family), skip_first=SKIP, dim_batch=DIM_BATCH,
                                 max_seq_len=64, method=method)
    assert sorted(result.jacobians) == list(range(model.n_layers - 1))
    assert result.seq_len == SEQ
    assert result.n_valid == SEQ - 1 - SKIP
    for layer, mat in result.jacobians.items():
        assert mat.dtype == torch.float32 and mat.device.type == "cpu"
        assert mat.shape == (model.d_model, model.d_model)
        ref = reference(family, layer, model.n_layers - 1)
        assert rel_frob(mat, ref) <= REL_TOL, (family, method, layer, rel_frob(mat, ref))


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_fused_matches_definition_at_every_source_layer(family):
    model = tiny(family)
    result = jacobian_for_prompt(model, prompt_ids(family), skip_first=SKIP, dim_batch=DIM_BATCH,
                                 max_seq_len=64, method="fused")
    assert result.seq_len == SEQ and result.n_valid == SEQ - 1 - SKIP
    for layer, mat in result.jacobians.items():
        assert mat.dtype == torch.float32 and mat.device.type == "cpu"
        assert rel_frob(mat, reference(family, layer, model.n_layers - 1)) <= REL_TOL, (family, layer)


@pytest.mark.parametrize(("method", "family"), [(m, f) for m in ("batched", "replicated")
                                                for f in ("llama", "gpt2", "gpt_neox")]
                         + [("fused", "llama"), ("fused", "qwen2")])
def test_matches_definition_nondefault_target_and_source_subset(family, method):
    model = tiny(family)  # 4 layers
    # unsorted, duplicated, negative: resolves to [0, 1]; target -2 -> 2
    result = jacobian_for_prompt(model, prompt_ids(family), source_layers=[1, -4, 1], target_layer=-2,
                                 skip_first=SKIP, dim_batch=DIM_BATCH, method=method)
    assert sorted(result.jacobians) == [0, 1]
    for layer in (0, 1):
        ref = reference(family, layer, 2)
        assert rel_frob(result.jacobians[layer], ref) <= REL_TOL
        # and it really is another matrix than the one to the last layer
        assert rel_frob(ref, reference(family, layer, 3)) > 1e-2


@pytest.mark.parametrize("method", ["batched", "fused"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_matches_definition_with_skip_first_zero(family, method):
    model = tiny(family)
    result = jacobian_for_prompt(model, prompt_ids(family), skip_first=0, dim_batch=DIM_BATCH, method=method)
    assert result.n_valid == SEQ - 1
    for layer, mat in result.jacobians.items():
        assert rel_frob(mat, reference(family, layer, model.n_layers - 1, 0)) <= REL_TOL


def test_dim_batch_changes_memory_not_result():
    model = tiny("llama")
    ids = prompt_ids("llama")
    results = [jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=k, method=method).jacobians
               for k, method in [(1, "batched"), (7, "batched"), (32, "batched"), (100, "batched"),
                                 ("auto", "batched"), (3, "replicated"), (1, "fused"), (7, "fused"),
                                 (100, "fused"), ("auto", "auto")]]
    for other in results[1:]:
        for layer in results[0]:
            assert rel_frob(other[layer], results[0][layer]) <= 1e-6


def test_text_prompt_is_tokenized_and_truncated_to_max_seq_len():
    model = tiny("llama")
    from_text = jacobian_for_prompt(model, LONG_TEXT, max_seq_len=SEQ, skip_first=SKIP, dim_batch=16)
    from_ids = jacobian_for_prompt(model, prompt_ids("llama")[0].tolist(), skip_first=SKIP, dim_batch=16)
    assert from_text.seq_len == SEQ and from_text.n_valid == SEQ - 1 - SKIP
    for layer in from_ids.jacobians:
        assert torch.allclose(from_text.jacobians[layer], from_ids.jacobians[layer], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["batched", "fused"])
def test_low_precision_model_accumulates_in_fp32(method):
    model = HFLensModel(make_hf_model("llama").to(torch.bfloat16), tiny("llama").tokenizer, name="bf16")
    result = jacobian_for_prompt(model, prompt_ids("llama"), skip_first=SKIP, dim_batch=DIM_BATCH, method=method)
    for layer, mat in result.jacobians.items():
        assert mat.dtype == torch.float32
        # bf16 has ~3 significant digits; the estimate is still the same matrix
        assert rel_frob(mat, reference("llama", layer, 3)) < 5e-2


# -- the fused path: which models, and what happens when a model is not what it looks like -----------
@pytest.mark.parametrize(("family", "reason"), [
    ("qwen3", r"model_type 'qwen3' is not one of"),
    ("olmo", r"model_type 'olmo' is not one of"),
    ("opt", r"model_type 'opt' is not one of"),
])
def test_fused_refuses_other_families(family, reason):
    assert fused_unsupported_reason(tiny(family)) is not None
    with pytest.raises(ValueError, match="The fused backward does not support 'tiny-" + family + "': " + reason):
        jacobian_for_prompt(tiny(family), prompt_ids(family), skip_first=SKIP, method="fused")
    assert fused_unsupported_reason(tiny("llama")) is None


@pytest.mark.parametrize(("family", "change", "reason"), [
    ("gpt2", {}, r"the MLP activation ReLU of layer 0 is not one of"),
    ("phi", {"qk_layernorm": True}, r"q/k layer norms \(qk_layernorm\)"),
    ("llama", {"pretraining_tp": 2}, r"pretraining_tp > 1"),
])
def test_fused_refuses_what_a_covered_family_switches_on(family, change, reason):
    model = make_tiny(family)
    for key, value in change.items():
        setattr(model.config, key, value)
    if family == "gpt2":  # an activation whose derivative the fused path does not know
        model.layers[0].mlp.act = nn.ReLU()
    with pytest.raises(ValueError, match="The fused backward does not support 'tiny-" + family + "': " + reason):
        jacobian_for_prompt(model, prompt_ids(family), skip_first=SKIP, method="fused")


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_fused_attends_within_a_sliding_window_shorter_than_the_prompt(family):
    # mistral: one window for every layer (config); gemma2: its sliding layers (window 8) and full ones
    model = make_tiny(family)
    if family == "mistral":
        model.config.sliding_window = 6
    ids = prompt_ids(family)
    got = jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=DIM_BATCH, method="fused").jacobians
    want = jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=DIM_BATCH, method="batched").jacobians
    for layer in want:
        assert rel_frob(got[layer], want[layer]) <= REL_TOL, layer
    model.config.sliding_window = 64  # a window wider than the prompt: another Jacobian, so the window mattered
    for layer in model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 64
    without = jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=DIM_BATCH, method="batched").jacobians
    assert max(rel_frob(without[layer], want[layer]) for layer in want) > 1e-3


def test_fused_checks_its_forward_against_the_model_and_auto_falls_back(caplog):
    # A llama whose layer 2 MLP output is doubled: same module names, other computation. The fused
    # re-run of layer 2 then differs from the model's; "fused" says so, "auto" warns and uses autograd.
    model = make_tiny("llama")
    mlp = model.layers[2].mlp
    plain_forward = mlp.forward
    mlp.forward = lambda x: 2 * plain_forward(x)
    ids = prompt_ids("llama")
    with pytest.raises(FusedMismatchError, match=r"re-run of layer 2 differs from the model's output by"):
        jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=DIM_BATCH, method="fused")
    with caplog.at_level("WARNING", logger="jlens_core.fitting.estimator"):
        auto = jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=DIM_BATCH, method="auto")
    assert "Falling back to autograd" in caplog.text
    batched = jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=DIM_BATCH, method="batched")
    unmodified = reference("llama", 0, 3)
    for layer in auto.jacobians:
        assert rel_frob(auto.jacobians[layer], batched.jacobians[layer]) <= 1e-6
    assert rel_frob(auto.jacobians[0], unmodified) > 1e-2  # the modification mattered
    # decided once: the next call goes straight to autograd, without a second warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="jlens_core.fitting.estimator"):
        jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=DIM_BATCH, method="auto")
    assert "Falling back" not in caplog.text


def test_fused_backward_of_one_layer_is_the_transposed_jacobian():
    # backward_layer on random cotangents against torch.func.vjp through the model's own layer 3.
    model = tiny("llama")
    ids = prompt_ids("llama")
    prep = prepare_layers(model, ids, 2, 3, SKIP)
    with torch.no_grad(), ActivationRecorder(model.layers, [2, 3]) as rec:
        model.run_with_cache(ids[:, : SEQ - 1])
    h2 = rec.activations[2]  # [1, S, d]
    prefix = h2[:, :SKIP]

    def layer3_on_valid(x):  # x: [n, d] -> layer 3's output at the valid positions
        with ActivationRecorder(model.layers, [3], stop_after=3) as inner:
            hook = model.layers[2].register_forward_hook(
                lambda m, a, o: (torch.cat([prefix, x[None]], dim=1),) + tuple(o[1:]) if isinstance(o, tuple)
                else torch.cat([prefix, x[None]], dim=1))
            try:
                model.run_with_cache(ids[:, : SEQ - 1])
            finally:
                hook.remove()
        return inner.activations[3][0, SKIP:]

    torch.manual_seed(0)
    cot = torch.randn(3, SEQ - 1 - SKIP, model.d_model)
    with torch.enable_grad():
        _, vjp = torch.func.vjp(layer3_on_valid, h2[0, SKIP:].clone())
        expected = torch.stack([vjp(c)[0] for c in cot])
    got = backward_layer(prep, 3, cot)
    assert rel_frob(got, expected) <= 1e-5


@pytest.mark.parametrize("layer_major", [True, False])
@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_both_fused_orders_match_definition(family, layer_major):
    # jacobian_for_prompt takes the layer-major order wherever it fits; both are checked here.
    model = tiny(family)
    target = model.n_layers - 1
    sources = [0, 2]  # the unwanted layer 1 is still backpropagated through
    got = fused_jacobians(model, prompt_ids(family), sources, target, SKIP, DIM_BATCH, layer_major=layer_major)
    assert sorted(got) == sources
    for layer in sources:
        assert got[layer].dtype == torch.float32
        assert rel_frob(got[layer], reference(family, layer, target)) <= REL_TOL, (family, layer_major, layer)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_mlp_jacobians_are_the_mlp_halfs_backward(family):
    # g + g @ M[p] against torch.func.vjp through the model's own MLP norm(s) and MLP.
    from jlens_core.fitting.fused_layouts import layer_weights, layout_for
    from jlens_core.models.layouts import get_path

    model = tiny(family)
    ids = prompt_ids(family)
    prep = prepare_layers(model, ids, 2, 3, SKIP)
    layer, layout, c = model.layers[3], layout_for(model), prep.layers[3]
    pre, post = get_path(layer, layout.mlp_norm), get_path(layer, layout.mlp_post_norm)
    mlp = get_path(layer, layout.mlp_out.rsplit(".", 1)[0])
    seen = {}
    hook = pre.register_forward_hook(lambda m, a, o: seen.__setitem__("y", a[0][0, SKIP:].detach()))
    try:
        with torch.no_grad():
            model.hf_model(input_ids=ids[:, : SEQ - 1], use_cache=False)
    finally:
        hook.remove()
    y = seen["y"]  # the MLP half's input at the valid positions: [n, d]

    def mlp_half(x):  # [n, d] -> [n, d]
        out = mlp(pre(x))
        return x + (post(out) if post is not None else out)

    torch.manual_seed(1)
    cot = torch.randn(4, y.shape[0], model.d_model)
    with torch.enable_grad():
        _, vjp = torch.func.vjp(mlp_half, y.clone())
        expected = torch.stack([vjp(g)[0] for g in cot])  # [4, n, d]
    with layer_weights(layout, layer, offloaded=False) as w:
        m = mlp_jacobians(c, w, block=3)  # a block that does not divide n
    got = cot + torch.einsum("knd,nde->kne", cot, m)
    assert rel_frob(got, expected) <= 1e-5


def test_layer_major_is_taken_only_where_its_memory_fits():
    model = tiny("llama")
    n, d, ff = 10, model.d_model, model.config.intermediate_size
    assert layer_major_bytes(d, ff, n, torch.float32) == 4 * (3 * n * d * d + 4 * d * 2 * ff)
    assert layer_major_bytes(d, ff, n, torch.bfloat16) == layer_major_bytes(d, ff, n, torch.float32) // 2
    assert use_layer_major(model, n)  # a few hundred kB
    assert not use_layer_major(model, n, fraction=0.0)


# -- a toy with a closed-form Jacobian --------------------------------------------------------------
class ToyBlock(nn.Module):
    """``h + W h`` (positions independent); with ``mix``, also ``+ A sum_{q <= p} h[q]`` (causal)."""

    def __init__(self, d: int, mix: bool) -> None:
        super().__init__()
        self.W = nn.Linear(d, d, bias=False)
        self.A = nn.Linear(d, d, bias=False) if mix else None

    def forward(self, h, prefix_sum=None):
        out = h + self.W(h)
        if self.A is not None:
            csum = h.cumsum(dim=1)
            if prefix_sum is not None:
                csum = csum + prefix_sum
            out = out + self.A(csum)
        return out


class ToyBase(nn.Module):
    """Embedding -> blocks -> final norm. The "cache" holds each block's input sum over the prefix."""

    def __init__(self, vocab: int, d: int, n_layers: int, mix_last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(ToyBlock(d, mix_last and k == n_layers - 1) for k in range(n_layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, input_ids, use_cache=False, past_key_values=None):
        h = self.embed(input_ids)
        sums = []
        for k, layer in enumerate(self.layers):
            prev = past_key_values[k] if past_key_values is not None else None
            sums.append(h.sum(dim=1, keepdim=True) + (prev if prev is not None else 0))
            h = layer(h, prev)
        return SimpleNamespace(last_hidden_state=self.norm(h), past_key_values=sums if use_cache else None)


class ToyLM(nn.Module):
    def __init__(self, vocab=50, d=12, n_layers=4, mix_last=False, seed=0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = ToyBase(vocab, d, n_layers, mix_last)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for block in self.model.layers:
                block.W.weight.normal_(0, 0.3 / d**0.5)
                if block.A is not None:
                    block.A.weight.normal_(0, 0.3 / d**0.5)

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids).last_hidden_state))


TOY_LAYOUT = ModelLayout("toy", base="model", layers="model.layers", final_norm="model.norm",
                         embed="model.embed", head="lm_head")


def make_toy(**kwargs) -> HFLensModel:
    return HFLensModel(ToyLM(**kwargs), None, layout=TOY_LAYOUT, name="toy")


def product_of_blocks(model: HFLensModel, source: int, target: int) -> torch.Tensor:
    """``(I + W_target) ... (I + W_{source+1})`` in fp64."""
    d = model.d_model
    out = torch.eye(d, dtype=torch.float64)
    for k in range(source + 1, target + 1):
        out = (torch.eye(d, dtype=torch.float64) + model.layers[k].W.weight.double()) @ out
    return out


@pytest.mark.parametrize("method", ["batched", "replicated"])
@pytest.mark.parametrize("skip_first", [0, 4])
def test_toy_residual_linear_blocks_give_the_product(method, skip_first):
    model = make_toy()
    assert model.n_layers == 4 and model.d_model == 12
    ids = torch.arange(3, 23).unsqueeze(0)  # 20 tokens
    result = jacobian_for_prompt(model, ids, skip_first=skip_first, dim_batch=5, method=method)
    assert result.n_valid == 20 - 1 - skip_first
    for layer in range(3):
        expected = product_of_blocks(model, layer, 3)
        assert rel_frob(result.jacobians[layer], expected) <= 1e-6
        assert rel_frob(result.jacobians[layer], expected.T) > 1e-2  # rows are target dimensions
    # an intermediate target
    result = jacobian_for_prompt(model, ids, source_layers=[0], target_layer=2, skip_first=skip_first,
                                 dim_batch=5, method=method)
    assert rel_frob(result.jacobians[0], product_of_blocks(model, 0, 2)) <= 1e-6


@pytest.mark.parametrize("method", ["batched", "replicated"])
def test_toy_causal_mixing_gives_sum_over_targets_mean_over_sources(method):
    # Top block: h_T[p'] = (I + W) h[p'] + A sum_{q <= p'} h[q]. Summing d h_T[p'] / d h[p] over the
    # targets p' in V, p' >= p gives (I + W) + A * #{p' in V: p' >= p}; the mean of that count over
    # p in V is (n_valid + 1) / 2. Counting the last position or the prefix would change it.
    model = make_toy(mix_last=True, seed=1)
    ids = torch.arange(5, 22).unsqueeze(0)  # 17 tokens
    skip_first = 5
    n_valid = 17 - 1 - skip_first
    result = jacobian_for_prompt(model, ids, skip_first=skip_first, dim_batch=5, method=method)
    top = model.layers[3]
    eye = torch.eye(model.d_model, dtype=torch.float64)
    mixed = eye + top.W.weight.double() + top.A.weight.double() * (n_valid + 1) / 2
    for layer in range(3):
        expected = mixed @ product_of_blocks(model, layer, 2)
        assert rel_frob(result.jacobians[layer], expected) <= 1e-6


def test_toy_fitted_lens_reproduces_the_output_exactly():
    # The toy is linear and bias-free, so h_T = J_l h_l at every position: the Jacobian lens at any
    # layer decodes to the model's own logits, and fit() averages identical per-prompt matrices.
    from jlens_core import fit

    model = make_toy(seed=2)
    prompts = [torch.arange(3, 15).tolist(), torch.arange(20, 40).tolist()]
    lens = fit(model, prompts, skip_first=2, dim_batch=5)
    ids = torch.arange(7, 30).unsqueeze(0)
    with torch.no_grad(), ActivationRecorder(model.layers, range(4)) as rec:
        logits = model.hf_model(ids).logits
    for layer in range(3):
        assert rel_frob(lens.jacobians[layer], product_of_blocks(model, layer, 3)) <= 1e-6
        with torch.no_grad():
            read = model.unembed(lens.transport(rec.activations[layer], layer))
            naive = model.unembed(rec.activations[layer])
        torch.testing.assert_close(read, logits, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(naive, logits, rtol=1e-2, atol=1e-2)  # the logit lens is not exact


def test_toy_cache_path_is_consistent():
    # The toy is an honest causal model: running a prefix as a cache then the rest gives the full run.
    model = make_toy(mix_last=True, seed=1)
    ids = torch.arange(5, 22).unsqueeze(0)
    with torch.no_grad():
        full = model.forward(ids)
        cache = model.run_with_cache(ids[:, :5], use_cache=True)
        rest = model.base(input_ids=ids[:, 5:], past_key_values=cache).last_hidden_state
    torch.testing.assert_close(rest, full[:, 5:])


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"source_layers": [0, 4]}, r"source layer 4 is out of range"),
    ({"source_layers": [-5]}, r"source layer -5 is out of range"),
    ({"source_layers": []}, r"source_layers is empty"),
    ({"source_layers": [1, 3]}, r"source layer 3 .*not below the target layer 3"),
    ({"source_layers": [2], "target_layer": 1}, r"source layer 2 .*not below the target layer 1"),
    ({"source_layers": [-1], "target_layer": -1}, r"source layer -1 \(= 3\) is not below"),
    ({"target_layer": 4}, r"target_layer=4 is out of range"),
    ({"target_layer": -5}, r"target_layer=-5 is out of range"),
    ({"target_layer": 0}, r"target_layer=0 leaves no layer below it"),
    ({"dim_batch": 0}, r"dim_batch=0"),
    ({"method": "naive"}, r"method='naive'"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jacobian_for_prompt(tiny("llama"), prompt_ids("llama"), skip_first=SKIP, **kwargs)


def test_resolve_layers_normalises():
    assert resolve_layers(4) == ([0, 1, 2], 3)
    assert resolve_layers(4, [-2, 1, 1, 0], -1) == ([0, 1, 2], 3)
    assert resolve_layers(4, None, -2) == ([0, 1], 2)
    assert resolve_layers(4, (-4,), 1) == ([0], 1)


def test_too_short_prompt_is_rejected():
    model = tiny("llama")
    short = prompt_ids("llama")[:, : SKIP + 1]  # no valid position
    with pytest.raises(ValueError, match=r"has 4 tokens: with skip_first=3 it has no valid position"):
        jacobian_for_prompt(model, short, skip_first=SKIP)
    with pytest.raises(ValueError, match="no valid position"):
        jacobian_for_prompt(model, "Hi", skip_first=SKIP)
    # the shortest prompt that has one valid position works
    result = jacobian_for_prompt(model, prompt_ids("llama")[:, : SKIP + 2], skip_first=SKIP, dim_batch=32)
    assert result.n_valid == 1


def test_valid_position_mask():
    assert valid_position_mask(10, 3).tolist() == [False] * 3 + [True] * 6 + [False]
    assert valid_position_mask(2, 0).tolist() == [True, False]
    with pytest.raises(ValueError, match="no valid position"):
        valid_position_mask(5, 4)
    with pytest.raises(ValueError, match="skip_first=-1"):
        valid_position_mask(5, -1)


# -- ActivationRecorder --------------------------------------------------------------------------------
def test_recorder_records_decoder_layer_outputs():
    model = tiny("llama")
    ids = prompt_ids("llama")
    with torch.no_grad(), ActivationRecorder(model.layers, [0, 2, 3]) as rec:
        out = model.hf_model(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert sorted(rec.activations) == [0, 2, 3]
    # hidden_states[l + 1] is the output of layer l, except the last, which HF has already normed
    torch.testing.assert_close(rec.activations[0], out.hidden_states[1])
    torch.testing.assert_close(rec.activations[2], out.hidden_states[3])
    assert not torch.allclose(rec.activations[3], out.hidden_states[4])
    torch.testing.assert_close(model.final_norm(rec.activations[3]), out.hidden_states[4])


def test_recorder_start_graph_at_makes_a_leaf():
    model = tiny("llama")
    ids = prompt_ids("llama")
    embeds = model.embed(ids).detach()

    def run(start):
        x = embeds.clone().requires_grad_(True)
        with torch.enable_grad(), ActivationRecorder(model.layers, [0, 1, 3], start_graph_at=start) as rec:
            model.hf_model(inputs_embeds=x, use_cache=False)
        rec.activations[3].sum().backward()
        return x, rec.activations

    x, acts = run(None)  # control: the gradient reaches the input
    assert x.grad is not None and x.grad.abs().sum() > 0
    x, acts = run(1)
    assert acts[1].is_leaf and acts[1].requires_grad
    assert acts[1].grad is not None and acts[1].grad.abs().sum() > 0
    assert acts[1].grad_fn is None
    assert x.grad is None  # backward never ran below layer 1


def test_recorder_stop_after_ends_the_forward():
    model = tiny("llama")
    ran = []
    handle = model.layers[3].register_forward_hook(lambda *a: ran.append(3))
    try:
        with torch.no_grad(), ActivationRecorder(model.layers, [1], stop_after=2) as rec:
            model.hf_model(input_ids=prompt_ids("llama"), use_cache=False)
            pytest.fail("the forward should have been stopped")
    finally:
        handle.remove()
    assert ran == [] and 1 in rec.activations


def _n_hooks(model) -> int:
    return sum(len(layer._forward_hooks) for layer in model.layers)


def test_recorder_removes_hooks_on_exit_and_on_error():
    model = tiny("llama")
    before = _n_hooks(model)
    with torch.no_grad(), ActivationRecorder(model.layers, [0, 1, 2], start_graph_at=0, stop_after=3):
        assert _n_hooks(model) == before + 4
        model.hf_model(input_ids=prompt_ids("llama"), use_cache=False)
    assert _n_hooks(model) == before
    with pytest.raises(RuntimeError, match="boom"), ActivationRecorder(model.layers, [0, 3]):
        assert _n_hooks(model) == before + 2
        raise RuntimeError("boom")
    assert _n_hooks(model) == before
    # a failing forward (bad input) also leaves no hook behind
    with pytest.raises(Exception), torch.no_grad(), ActivationRecorder(model.layers, [0]):  # noqa: B017
        model.hf_model(input_ids=torch.tensor([[10**6]]), use_cache=False)
    assert _n_hooks(model) == before


def test_recorder_bad_indices():
    layers = tiny("llama").layers
    with pytest.raises(ValueError, match="Layer index 4 is out of range"):
        ActivationRecorder(layers, [0, 4])
    with pytest.raises(ValueError, match="start_graph_at=2 must be one of the recorded layers"):
        ActivationRecorder(layers, [0, 1], start_graph_at=2)
