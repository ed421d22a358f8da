"""The lens objects and their files: ``lens`` (:class:`JacobianLens`, :class:`LogitLens`, safetensors
files), ``kinds`` (the table of lens kinds: names, colours, rules, shipped variants), ``shipped`` (the catalogue of
shipped lenses), ``loading`` (:func:`load_lens`: any lens by name, file or Hub path), ``spectra``
(norms and spectra of the fitted ``J_l``). Imports only :mod:`jlens_core.models` and the leaves.
"""
