"""Finding where two runs of a model part ways: ``dump`` (hidden states of one forward pass to files)
and ``diff`` (two dumps compared layer by layer). Imports :mod:`jlens_core.models` and the leaves.
"""
