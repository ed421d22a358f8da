"""The model side: finding a causal LM's parts, adapting it, loading it, recording its residuals.

``layouts`` (where the decoder layers, final norm, embedding and head sit), ``model`` (the
:class:`HFLensModel` adapter and the :class:`LensModel` protocol), ``loading`` (the embedded default,
Hub ids, folders, GGUF files), ``recorder`` (forward hooks on decoder-layer outputs).
Imports nothing from the other subpackages.
"""
