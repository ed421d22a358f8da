"""Reading prompts through lenses: ``tokens`` (how token ids are shown and words are spelled),
``readings`` (:func:`read_prompt`: every layer x position), ``evaluation`` (per-layer KL / CE over a
corpus, pass@k), ``directions`` (singular directions of ``J_l`` decoded into tokens). Imports
:mod:`jlens_core.models`, :mod:`jlens_core.lenses` and the leaves; never :mod:`jlens_core.fitting`.
"""
