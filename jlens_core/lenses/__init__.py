"""The lens objects and their files: ``lens`` (:class:`JacobianLens`, :class:`LogitLens`, safetensors
files), ``shipped`` (the default model's lens and lens specs such as ``"default"``), ``spectra``
(norms and spectra of the fitted ``J_l``). Imports only :mod:`jlens_core.models` and the leaves.
"""
