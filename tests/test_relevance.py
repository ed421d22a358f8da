"""Relevance rules in the estimator (issue #31 §1, docs/method.md §9.1).

The reference is independent of ``jlens_core.fitting.relevance``: the Hugging Face classes' forward
functions are monkeypatched here, family by family, to the rules written out by hand (norm
denominators detached, ``z * (f(z)/z).detach()`` for activations, ``0.5 p + 0.5 p.detach()`` for gated
products, routers detached), and the docs/method.md §2 definition is computed by plain autograd on
the full sequence (tests/test_conformance.py's ``definition``).
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import LONG_TEXT
from helpers import rel_frob, tiny
from test_conformance import SEQ, SKIP, build, definition, prompt

from jlens_core import HFLensModel, JacobianLens, fit
from jlens_core.fitting.estimator import jacobian_for_prompt
from jlens_core.fitting.relevance import relevance_rules
from jlens_core.lenses.header import LensFileError

TOL = 1e-5


# -- the rules, written out per family -------------------------------------------------------------
def _ratio(f, z):
    """f(z)/z with f'(0) = 0.5 at 0 (SiLU and both GELUs), detached."""
    with torch.no_grad():
        return torch.where(z == 0, torch.full_like(z, 0.5), f(z) / z)


def _act(f, z):
    return f(z).detach() + z * _ratio(f, z) - (z * _ratio(f, z)).detach()


def _half(p):
    return 0.5 * p + 0.5 * p.detach()


def _rms(x, weight, eps, one_plus=False):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).detach() + eps)
    return (out * ((1 + weight.float()) if one_plus else weight.float())).to(x.dtype)


def _gelu_tanh(z):
    return F.gelu(z, approximate="tanh")


@contextlib.contextmanager
def patched(arch: str, hf):
    """``hf``'s residual-path norms, MLPs and MoE blocks rewritten to the rules (class-level patches)."""
    import transformers.models as tm

    undo = []

    def patch(cls, name, fn):
        undo.append((cls, name, getattr(cls, name)))
        setattr(cls, name, fn)

    layers = hf.model.layers if hasattr(hf, "model") else hf.transformer.h
    residual_norms = {id(m) for layer in layers for n, m in layer.named_children() if "norm" in n or n.startswith("ln_")}

    def rms_forward(one_plus):
        original = {}

        def forward(self, x):
            if id(self) not in residual_norms:  # q/k norms: ordinary
                return original["f"](self, x)
            return _rms(x, self.weight, getattr(self, "variance_epsilon", getattr(self, "eps", None)), one_plus)
        return original, forward

    def gated_mlp(f):
        def forward(self, x):
            return self.down_proj(_half(_act(f, self.gate_proj(x)) * self.up_proj(x)))
        return forward

    if arch in ("llama", "qwen3", "gemma2", "mixtral", "qwen2_moe"):
        mod = {"llama": tm.llama.modeling_llama, "qwen3": tm.qwen3.modeling_qwen3, "gemma2": tm.gemma2.modeling_gemma2,
               "mixtral": tm.mixtral.modeling_mixtral, "qwen2_moe": tm.qwen2_moe.modeling_qwen2_moe}[arch]
        prefix = {"llama": "Llama", "qwen3": "Qwen3", "gemma2": "Gemma2", "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe"}[arch]
        norm_cls = getattr(mod, f"{prefix}RMSNorm")
        original, forward = rms_forward(one_plus=arch == "gemma2")
        original["f"] = norm_cls.forward
        patch(norm_cls, "forward", forward)
        if arch != "mixtral":
            patch(getattr(mod, f"{prefix}MLP"), "forward", gated_mlp(_gelu_tanh if arch == "gemma2" else F.silu))
    if arch in ("mixtral", "qwen2_moe"):
        block = getattr(mod, f"{prefix}SparseMoeBlock")

        def moe_forward(self, hidden):
            b, s, d = hidden.shape
            x = hidden.reshape(-1, d)
            logits = F.linear(x, self.gate.weight).detach()  # router weights are constants
            probs = torch.softmax(logits.float(), dim=-1)
            top, index = torch.topk(probs, self.gate.top_k, dim=-1)
            if arch == "mixtral" or self.gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            experts = self.experts
            for e in range(experts.num_experts):
                pos, k = torch.where(index == e)
                if len(pos) == 0:
                    continue
                gate, up = F.linear(x[pos], experts.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(_half(_act(F.silu, gate) * up), experts.down_proj[e])
                out = out.index_add(0, pos, y * top[pos, k, None].to(y.dtype))
            if arch == "qwen2_moe":
                shared = self.shared_expert(x)
                out = out + torch.sigmoid(self.shared_expert_gate(x)).detach() * shared
            return out.reshape(b, s, d)
        patch(block, "forward", moe_forward)
    if arch == "gpt2":
        g = tm.gpt2.modeling_gpt2

        def ln_forward(self, x):
            if id(self) not in residual_norms:
                return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
            centred = x - x.mean(-1, keepdim=True)
            return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True).detach() + self.eps) * self.weight + self.bias

        def gpt2_mlp(self, hidden):
            return self.dropout(self.c_proj(_act(lambda z: F.gelu(z, approximate="tanh"), self.c_fc(hidden))))
        patch(torch.nn.LayerNorm, "forward", ln_forward)
        patch(g.GPT2MLP, "forward", gpt2_mlp)
    try:
        yield
    finally:
        for cls, name, fn in reversed(undo):
            setattr(cls, name, fn)


FAMILIES = ("llama", "qwen3", "gemma2", "gpt2", "mixtral", "qwen2_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    arch = request.param
    hf = build(arch)
    from conftest import make_tokenizer

    return arch, hf, HFLensModel(hf, make_tokenizer(), name=f"tiny-{arch}")


def test_relevance_equals_the_rules_written_by_hand(family):
    arch, hf, model = family
    ids = prompt()
    top = model.n_layers - 1
    sources = list(range(top))
    with patched(arch, hf):
        ref = definition(model, ids, sources, top)
    got = jacobian_for_prompt(model, ids, skip_first=SKIP, max_seq_len=SEQ, dim_batch=32, rules="relevance")
    plain = jacobian_for_prompt(model, ids, skip_first=SKIP, max_seq_len=SEQ, dim_batch=32)
    worst = max(rel_frob(got.jacobians[i], ref[i]) for i in sources)
    assert worst < TOL, f"{arch}: relevance differs from the hand-written rules by {worst:.2e}"
    # the rules change the result (else the comparison above proves nothing)
    assert max(rel_frob(plain.jacobians[i], ref[i]) for i in sources) > 1e-3


def test_forward_values_are_unchanged(family):
    _arch, hf, model = family
    ids = prompt()
    with torch.no_grad():
        before = hf(input_ids=ids, use_cache=False).logits
    with relevance_rules(model), torch.enable_grad():
        during = hf(input_ids=ids, use_cache=False).logits
    assert torch.equal(before, during.detach())
    after_grad = jacobian_for_prompt(model, ids, skip_first=SKIP, max_seq_len=SEQ, dim_batch=32)
    with torch.no_grad():
        assert torch.equal(before, hf(input_ids=ids, use_cache=False).logits)  # patches removed
    assert after_grad.n_valid == SEQ - 1 - SKIP


@pytest.mark.parametrize("fam", ["llama", "qwen2", "gemma", "gemma2", "gpt2", "gpt_neox", "phi"])
@pytest.mark.parametrize("layer_major", [True, False])
def test_fused_relevance_equals_autograd_relevance(fam, layer_major):
    from jlens_core.fitting.estimator import prompt_ids
    from jlens_core.fitting.fused import fused_jacobians

    model = tiny(fam)
    kw = {"skip_first": 3, "max_seq_len": 24, "dim_batch": 8}
    ref = jacobian_for_prompt(model, LONG_TEXT, method="batched", rules="relevance", **kw)
    ids = prompt_ids(model, LONG_TEXT, 24)
    sources = list(range(model.n_layers - 1))
    got = fused_jacobians(model, ids, sources, model.n_layers - 1, 3, 8, layer_major=layer_major, rules="relevance")
    assert max(rel_frob(got[i], ref.jacobians[i]) for i in sources) < TOL
    auto = jacobian_for_prompt(model, LONG_TEXT, rules="relevance", **kw)  # "auto" takes the fused path
    assert max(rel_frob(auto.jacobians[i], ref.jacobians[i]) for i in sources) < TOL


def test_unknown_rules_is_one_sentence():
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"^rules='lrp' is not one of \('jacobian', 'relevance'\): ") as err:
        jacobian_for_prompt(model, LONG_TEXT, rules="lrp")
    assert str(err.value).endswith(".") and str(err.value).count(". ") == 0
    with pytest.raises(ValueError, match=r"^rules='lrp' is not one of"):
        fit(model, [LONG_TEXT], rules="lrp")


def test_a_family_the_rules_do_not_cover_is_refused_in_one_sentence():
    hf = build("mamba")
    from conftest import make_tokenizer

    model = HFLensModel(hf, make_tokenizer(), name="tiny-mamba")
    with pytest.raises(ValueError) as err:
        jacobian_for_prompt(model, prompt(), skip_first=SKIP, rules="relevance")
    text = str(err.value)
    assert text.startswith("The relevance rules (docs/method.md §9.1) do not cover 'tiny-mamba': its cache ")
    assert text.endswith("fit it with rules='jacobian'.") and text.count(". ") == 0
    with pytest.raises(ValueError, match="do not cover 'tiny-mamba'"):  # before any prompt, not "all skipped"
        fit(model, [LONG_TEXT], skip_first=SKIP, rules="relevance")


def test_r_lens_file_merge_and_resume(tmp_path):
    model = tiny("llama")
    prompts = [LONG_TEXT, LONG_TEXT[40:], LONG_TEXT[80:]]
    kw = {"skip_first": 3, "max_seq_len": 20, "dim_batch": 16}
    r_lens = fit(model, prompts, rules="relevance", **kw)
    j_lens = fit(model, prompts, **kw)
    assert r_lens.kind == "relevance" and j_lens.kind == "jacobian"
    # the fit is the mean of the per-prompt relevance Jacobians
    per_prompt = [jacobian_for_prompt(model, p, rules="relevance", **kw).jacobians for p in prompts]
    for layer in r_lens.source_layers:
        mean = sum(j[layer].double() for j in per_prompt) / len(prompts)
        assert rel_frob(r_lens.jacobians[layer], mean.float()) < TOL
    path = r_lens.save(tmp_path / "r.safetensors")
    loaded = JacobianLens.load(path)
    assert loaded.rules == "relevance" and loaded.kind == "relevance"
    with pytest.raises(ValueError, match=r"^Cannot merge a relevance lens with a jacobian lens: [^:]*only\.$"):
        JacobianLens.merge([loaded, j_lens])
    assert JacobianLens.merge([loaded, r_lens]).rules == "relevance"
    # checkpoints record the rules: resuming with others is refused
    ckpt = tmp_path / "fit.ckpt"
    fit(model, prompts[:2], rules="relevance", checkpoint_path=ckpt, **kw)
    with pytest.raises(ValueError, match=r"was made with rules='relevance', this fit asks for rules='jacobian'"):
        fit(model, prompts, checkpoint_path=ckpt, **kw)
    resumed = fit(model, prompts, rules="relevance", checkpoint_path=ckpt, **kw)
    assert max(rel_frob(resumed.jacobians[i], r_lens.jacobians[i]) for i in r_lens.source_layers) < TOL


def _rewrite_rules(path, value):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    info = json.loads(meta["jlens"])
    if value is None:
        info.pop("rules")
    else:
        info["rules"] = value
    save_file(tensors, str(path), metadata={**meta, "jlens": json.dumps(info)})


def test_lens_file_rules_field(tmp_path):
    model = tiny("llama")
    lens = JacobianLens({0: torch.eye(model.d_model)}, 1, model.d_model, target_layer=1)
    path = lens.save(tmp_path / "old.safetensors")
    _rewrite_rules(path, None)  # a file from before the R-lens
    assert JacobianLens.load(path).rules == "jacobian"
    _rewrite_rules(path, "lrp")
    with pytest.raises(LensFileError, match=r"records rules='lrp', which this jlens does not know [^.]*\.$"):
        JacobianLens.load(path)


def test_identity_rule_at_zero_and_half_rule_gradients():
    """The activation surrogate's gradient is f(z)/z (f'(0) at 0) and a gated product's factors get half."""
    from jlens_core.fitting.relevance import _activation_forward

    act = torch.nn.SiLU()
    act.forward = _activation_forward(act, 0.5)  # type: ignore[method-assign]
    z = torch.tensor([-2.0, 0.0, 1e-3, 3.0], requires_grad=True)
    u = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    out = act(z)
    assert torch.equal(out.detach(), F.silu(z.detach()))
    (gz,) = torch.autograd.grad(out.sum(), z, retain_graph=True)
    assert torch.allclose(gz, torch.sigmoid(z.detach()), atol=1e-7) and gz[1] == 0.5
    gz, gu = torch.autograd.grad((act(z) * u).sum(), [z, u])
    assert torch.allclose(gz, 0.5 * u.detach() * torch.sigmoid(z.detach()), atol=1e-7)
    assert torch.allclose(gu, 0.5 * F.silu(z.detach()), atol=1e-7)
    assert math.isclose(float(gz[1]), 0.5 * 2.0 * 0.5)
