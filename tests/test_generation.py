"""generate(), reading a generation, most common tokens, and the residual-edit hook point."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from conftest import make_tiny

from jlens_core import LogitLens
from jlens_core.reading.edit_hooks import PositionRule, ResidualEdit
from jlens_core.reading.generation import Generation, generate
from jlens_core.reading.inputs import record_residuals
from jlens_core.reading.reader import read_prompt
from jlens_core.reading.summaries import most_common_tokens

PROMPT = "The capital of France is"


def hf_greedy(model, n: int, eos=None) -> list[int]:
    ids = model.encode(PROMPT)
    out = model.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                  eos_token_id=eos, pad_token_id=2)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_greedy_equals_hf_generate(family):
    model = make_tiny(family)
    gen = generate(model, PROMPT, max_new_tokens=10, stop_at_eos=False)
    assert gen.generated_ids.tolist() == hf_greedy(model, 10)
    assert gen.stop_reason == "max_new_tokens" and gen.n_generated == 10
    assert gen.prompt_ids.tolist() == model.encode(PROMPT)[0].tolist()
    assert gen.continuation == model.decode(gen.generated_ids.tolist())


def test_greedy_stops_at_eos_like_hf(llama):
    free = generate(llama, PROMPT, max_new_tokens=8, stop_at_eos=False).generated_ids.tolist()
    eos = free[3]
    if eos in free[:3]:
        pytest.skip("the tiny model repeats its 4th token earlier")
    llama.hf_model.generation_config.eos_token_id = eos
    try:
        gen = generate(llama, PROMPT, max_new_tokens=8)
    finally:
        llama.hf_model.generation_config.eos_token_id = 1
    assert gen.stop_reason == "eos"
    assert gen.generated_ids.tolist() == free[:4] == hf_greedy(llama, 8, eos=eos)


def test_top_probs_are_the_models_next_token_distribution(llama):
    gen = generate(llama, PROMPT, max_new_tokens=3, stop_at_eos=False, top_k=5)
    with torch.no_grad():
        logits = llama.hf_model(torch.as_tensor(gen.ids[None, :-1])).logits[0].float()  # [seq-1, vocab]
    probs = logits[gen.n_prompt - 1:].softmax(-1)  # the three steps' distributions
    values, indices = probs.topk(5)
    assert gen.top_ids.tolist() == indices.tolist()
    np.testing.assert_allclose(gen.top_probs, values.numpy(), rtol=1e-4, atol=1e-6)


def test_seeded_sampling_is_reproducible(llama):
    a = generate(llama, PROMPT, max_new_tokens=12, temperature=1.0, seed=7, stop_at_eos=False)
    b = generate(llama, PROMPT, max_new_tokens=12, temperature=1.0, seed=7, stop_at_eos=False)
    c = generate(llama, PROMPT, max_new_tokens=12, temperature=1.0, seed=8, stop_at_eos=False)
    assert a.generated_ids.tolist() == b.generated_ids.tolist()
    assert a.generated_ids.tolist() != c.generated_ids.tolist()
    assert a.temperature == 1.0 and a.seed == 7


def test_progress_can_stop_and_keeps_what_was_generated(llama):
    seen = []

    def progress(p):
        seen.append((p.step, p.total, p.generation.n_generated))
        return p.step == 3

    gen = generate(llama, PROMPT, max_new_tokens=10, stop_at_eos=False, progress=progress)
    assert seen == [(1, 10, 1), (2, 10, 2), (3, 10, 3)]
    assert gen.stop_reason == "stopped" and gen.n_generated == 3


def test_chat_wraps_the_prompt(llama):
    gen = generate(llama, "hi", max_new_tokens=2, chat=True, stop_at_eos=False)
    assert gen.prompt_text == llama.chat("hi") and gen.prompt == "hi" and gen.chat


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_new_tokens": 0}, "max_new_tokens=0 is out of range"),
    ({"max_new_tokens": 5000}, "max_new_tokens=5000 is out of range"),
    ({"temperature": -0.5}, "temperature=-0.5 must be a number >= 0"),
])
def test_bad_settings_are_one_sentence(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(llama, PROMPT, **kwargs)


def test_empty_prompt_and_missing_chat_template(llama):
    with pytest.raises(ValueError, match="The prompt is empty"):
        generate(llama, "   ")
    template = llama.tokenizer.chat_template
    llama.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="has no chat template"):
            generate(llama, PROMPT, chat=True)
    finally:
        llama.tokenizer.chat_template = template


# -- reading a generation --------------------------------------------------------------------------
def test_reading_a_generation_marks_positions(llama):
    gen = generate(llama, PROMPT, max_new_tokens=6, stop_at_eos=False)
    reading = read_prompt(llama, LogitLens.for_model(llama), gen)
    n_prompt = gen.n_prompt
    assert reading.n_prompt == n_prompt and reading.n_generated == 6
    assert reading.input_ids.tolist() == gen.ids.tolist()
    assert reading.segments == ["prompt"] * n_prompt + ["generated"] * 6
    frame = reading.frame
    per_position = frame.groupby("position")["segment"].first()
    assert (per_position[per_position.index >= n_prompt] == "generated").all()
    assert (per_position[per_position.index < n_prompt] == "prompt").all()
    # the model's own next token over the prompt's last position and the continuation is what it wrote
    last = reading.layers.index(reading.output_layer)
    assert reading.top_ids[last, n_prompt - 1:-1, 0].tolist() == gen.generated_ids.tolist()
    # the same ids read as a plain prompt: same numbers, everything marked prompt
    plain = read_prompt(llama, LogitLens.for_model(llama), gen.ids)
    np.testing.assert_array_equal(plain.kl_bits, reading.kl_bits)
    assert set(plain.segments) == {"prompt"}
    by_ids = read_prompt(llama, LogitLens.for_model(llama), gen.ids, n_prompt=n_prompt)
    assert by_ids.segments == reading.segments


def test_most_common_tokens_against_a_hand_count(llama):
    reading = read_prompt(llama, LogitLens.for_model(llama), PROMPT + " Paris and Rome", top_k=5)
    band = (1, 2)
    hand = Counter()
    per_layer = {}
    for _, row in reading.frame.iterrows():
        if band[0] <= row["layer"] <= band[1]:
            tid = row["top_ids"][0]
            hand[tid] += 1
            per_layer.setdefault(tid, Counter())[row["layer"]] += 1
    table = most_common_tokens(reading, layers=band, top_n=1000)
    assert dict(zip(table["token_id"], table["count"])) == dict(hand)
    assert table["count"].is_monotonic_decreasing
    for _, row in table.iterrows():
        assert row["per_layer"] == dict(per_layer[row["token_id"]])
        assert row["n_layers"] == len(per_layer[row["token_id"]])
    assert table["count"].sum() == 2 * len(reading.positions)
    # default band: every layer below the output row
    default = most_common_tokens(reading, top_n=1000)
    assert default["count"].sum() == (llama.n_layers - 1) * len(reading.positions)


def test_most_common_word_like_counts_first_word_like_token(llama):
    from jlens_core.reading.tokens import is_word_like

    reading = read_prompt(llama, LogitLens.for_model(llama), PROMPT, top_k=8)
    hand = Counter()
    for _, row in reading.frame.iterrows():
        if row["layer"] == reading.output_layer:
            continue
        words = [t for t, s in zip(row["top_ids"], row["top_tokens"]) if is_word_like(s)]
        if words:
            hand[words[0]] += 1
    table = most_common_tokens(reading, word_like=True, top_n=1000)
    assert dict(zip(table["token_id"], table["count"])) == dict(hand)
    assert all(is_word_like(s) for s in table["token"])


def test_empty_band_is_an_error(llama):
    reading = read_prompt(llama, LogitLens.for_model(llama), PROMPT, layers=[0, 3])
    with pytest.raises(ValueError, match=r"The layer band \(1, 2\) holds none"):
        most_common_tokens(reading, layers=(1, 2))


# -- the edit hook point ---------------------------------------------------------------------------
@dataclass
class AddVector:
    """A test edit: ``h + vector`` at one layer (a stand-in for the interventions' edits)."""

    layer: int
    vector: torch.Tensor
    rule: PositionRule = field(default_factory=PositionRule)
    needs_clean: bool = False

    @property
    def layers(self):
        return [self.layer]

    def selects(self, positions, n_prompt):
        return self.rule.selects(positions, n_prompt)

    def apply(self, layer, h, clean):
        return h + self.vector


def naive_edited_greedy(model, edit, n: int) -> list[int]:
    """Greedy without a cache: the whole sequence each step, the edit hooked by hand at its positions."""
    ids = model.encode(PROMPT)[0].tolist()
    n_prompt = len(ids)

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        mask = edit.selects(torch.arange(h.shape[1]), n_prompt)
        h = h.clone()
        h[:, mask] = h[:, mask] + edit.vector
        return (h,) + tuple(output[1:]) if isinstance(output, tuple) else h

    handle = model.layers[edit.layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            for _ in range(n):
                logits = model.hf_model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
    finally:
        handle.remove()
    return ids[n_prompt:]


@pytest.mark.parametrize("on_generated", [False, True])
def test_edits_while_generating_equal_a_naive_edited_run(llama, on_generated):
    torch.manual_seed(1)
    edit = AddVector(1, 3.0 * torch.randn(llama.d_model), PositionRule(on_generated=on_generated))
    assert isinstance(edit, ResidualEdit)
    gen = generate(llama, PROMPT, max_new_tokens=8, stop_at_eos=False, edits=[edit])
    assert gen.generated_ids.tolist() == naive_edited_greedy(llama, edit, 8)
    assert gen.generated_ids.tolist() != generate(llama, PROMPT, max_new_tokens=8, stop_at_eos=False).generated_ids.tolist()
    assert gen.edits == [repr(edit)]


def test_zero_edit_is_bit_identical_and_layers_below_are_untouched(llama):
    ids = llama.encode(PROMPT)
    zero = AddVector(2, torch.zeros(llama.d_model))
    assert generate(llama, PROMPT, max_new_tokens=6, edits=[zero]).generated_ids.tolist() == \
        generate(llama, PROMPT, max_new_tokens=6).generated_ids.tolist()
    clean = record_residuals(llama, ids, range(llama.n_layers))
    edited = record_residuals(llama, ids, range(llama.n_layers), edits=[AddVector(2, torch.ones(llama.d_model))])
    for layer in (0, 1):
        assert torch.equal(clean[layer], edited[layer])
    # position 0 (the attention sink) is not edited by default; the others are
    assert torch.equal(edited[2][0], clean[2][0])
    torch.testing.assert_close(edited[2][1:], clean[2][1:] + 1)


def test_an_edit_of_a_missing_layer_is_refused(llama):
    with pytest.raises(ValueError, match="edits layer 9, but the model has layers 0..3"):
        generate(llama, PROMPT, max_new_tokens=2, edits=[AddVector(9, torch.zeros(llama.d_model))])
    with pytest.raises(TypeError, match="is not a residual edit"):
        generate(llama, PROMPT, max_new_tokens=2, edits=["steer"])


def test_generation_dataclass_ids(llama):
    gen = generate(llama, PROMPT, max_new_tokens=2, stop_at_eos=False)
    assert isinstance(gen, Generation)
    assert gen.ids.tolist() == gen.prompt_ids.tolist() + gen.generated_ids.tolist()
    assert "2 generated tokens" in repr(gen)
