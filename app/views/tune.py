"""Tune: train a tuned lens for the loaded model (the third lens) and watch its loss fall."""

from __future__ import annotations

import hashlib
import json

import streamlit as st

import common
from jlens_core.corpus import BUILTIN_CORPUS, load_corpus
from jlens_core.figures.fitting import tune_figure
from jlens_core.fitting.tuning import train_tuned_lens

ss = st.session_state
ctx = common.require_model()
model = ctx.model
for key, value in (("tune_n", 200), ("tune_steps", 150), ("tune_tokens", 128), ("tune_lr", 1e-3),
                   ("tune_heldout", 8)):
    ss.setdefault(key, value)

st.title("Train a tuned lens")
st.caption("The tuned lens (Belrose et al., 2023) learns, per layer, an affine translator read as "
           "`unembed(h + A h + b)`, minimising KL(final ‖ lens) over corpus tokens with the model frozen. It starts "
           "as the logit lens. Training runs here, in the server; Stop keeps the checkpoint and Train goes on from it.")
c1, c2, c3 = st.columns(3)
c1.number_input("Training texts (fit split of the built-in corpus)", 1, 2000, key="tune_n")
c1.number_input("Held-out texts (eval split)", 0, 100, key="tune_heldout")
c2.number_input("Steps", 1, 5000, key="tune_steps")
c2.number_input("Tokens per step", 8, 4096, key="tune_tokens")
c3.number_input("Learning rate (Adam)", 1e-5, 1.0, key="tune_lr", format="%.0e")
settings = {"n": int(ss.tune_n), "steps": int(ss.tune_steps), "tokens": int(ss.tune_tokens), "lr": float(ss.tune_lr),
            "heldout": int(ss.tune_heldout)}
digest = hashlib.sha256(json.dumps({**settings, "steps": None}, sort_keys=True).encode()).hexdigest()[:8]
out = common.tuned_runs_dir() / f"{common.tuned_run_name(model)}-{digest}.safetensors"
ckpt, history_file = out.with_suffix(".ckpt"), out.with_suffix(".history.json")
c3.caption(f"Writes `{out.name}` in `{out.parent}`; a rerun with the same settings resumes.")


def _history() -> list[dict]:
    try:
        return json.loads(history_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []


def _stop() -> None:
    ss.tune_stop = True


b1, b2, _ = st.columns([1, 1, 4])
train = b1.button("Train" if not ckpt.is_file() else "Train (resume)", type="primary", key="tune_go",
                  icon=":material/play_arrow:")
b2.button("Stop", key="tune_stop_btn", on_click=_stop, icon=":material/stop:")
bar_slot, chart_slot = st.empty(), st.empty()
if train:
    ss.tune_stop = False
    with common.guard("Could not train the tuned lens"):
        texts = load_corpus(BUILTIN_CORPUS, n=settings["n"], min_chars=600, split="fit")
        heldout = load_corpus(BUILTIN_CORPUS, n=settings["heldout"], min_chars=600, split="eval") \
            if settings["heldout"] else []
        history = _history()
        bar = bar_slot.progress(0.0, text="Starting…")

        def progress(p) -> None:
            record = {"step": p.step, "train_kl_bits": p.train_kl_bits}
            if p.heldout_kl_bits:
                record["heldout_kl_bits"] = sum(p.heldout_kl_bits.values()) / len(p.heldout_kl_bits)
            history[:] = [h for h in history if h["step"] < p.step] + [record]
            history_file.write_text(json.dumps(history))
            bar.progress(p.step / p.steps, text=f"Step {p.step}/{p.steps} · KL {p.train_kl_bits:.3f} bits · "
                                                f"{p.seconds:.1f} s/step")
            chart_slot.plotly_chart(tune_figure(history), key=f"tune_chart_{p.step}",
                                    config={"displaylogo": False})

        lens = train_tuned_lens(model, texts, steps=settings["steps"], tokens_per_step=settings["tokens"],
                                lr=settings["lr"], heldout_texts=heldout, heldout_every=max(1, settings["steps"] // 6),
                                checkpoint_path=ckpt, checkpoint_every=5, progress=progress)
        lens = lens.replace(settings={**lens.settings, "corpus": BUILTIN_CORPUS, "split": "fit", "n_texts": len(texts)})
        lens.save(out)
        bar_slot.empty()
        st.success(f"Trained: {out.name}. Pick it in the sidebar (Tuned lens), or use it now.")
history = _history()
if history and not train:
    chart_slot.plotly_chart(tune_figure(history), key="tune_chart", config={"displaylogo": False})
    done = history[-1]["step"]
    if done < settings["steps"] and not out.is_file():
        st.info(f"Stopped at step {done} of {settings['steps']}: Train goes on from the checkpoint.")
if out.is_file():
    def _use() -> None:
        ss.tuned_choice = f"run:{out.stem}"

    st.button("Use this tuned lens", key="tune_use", on_click=_use, icon=":material/check:")
    if ctx.tuned is not None and ctx.tuned_key.startswith(f"tuned|{out}|"):
        st.caption(f"In use: {ctx.tuned.describe()}")
