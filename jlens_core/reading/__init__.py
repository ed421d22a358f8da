"""Reading prompts through lenses (docs/method.md §6).

* ``tokens``: how token ids are shown and words are spelled;
* ``reader`` (:func:`read_prompt`, :func:`read_prompts`: every layer x position), built from
  ``inputs`` (lenses, layers, positions, residuals), ``logit_stats`` (entropy / KL / CE / rank
  kernels), ``row_arrays`` (the arrays a reading fills, chunk by chunk), ``openmp_workers`` (the
  per-thread pool) and ``prompt_reading`` (:class:`PromptReading`, the result);
* ``reading_file`` (save and load readings) over ``file_format`` (the JSON format), ``json_arrays``;
* ``summaries``: most common tokens, two readings compared;
* ``generation``, ``edit_hooks``: continuations, and the edits a reading can run under;
* ``singular_directions``: singular directions of ``J_l`` decoded into tokens.

Set-level evaluation (per-layer KL / CE over a corpus, pass@k, lenses compared) is
:mod:`jlens_core.evaluation`. Imports :mod:`jlens_core.models`, :mod:`jlens_core.lenses` and the leaves; never :mod:`jlens_core.fitting`.
"""
