"""The J-space (docs/method.md §11): the lens's read vectors of one layer as an overcomplete dictionary, sparse
nonnegative decompositions of residuals and concept vectors into it, with controls.

``dictionary`` (:func:`jspace`, :class:`JSpace`: the atoms of one layer, never stored as a block), ``pursuit`` (the
greedy nonnegative pursuit on plain tensors: gradient pursuit and exact NNLS), ``decompose`` (:func:`decompose`,
:func:`split`: a model's residuals or vectors split into their J part and the rest, beside a random and a shuffled
dictionary), ``concepts`` (:func:`concept_vectors`: mean activations of concept prompts minus a baseline).
The edits on the split live in :mod:`jlens_core.interventions.jspace_edits`.
Imports :mod:`jlens_core.models`, :mod:`jlens_core.lenses`, :mod:`jlens_core.reading`,
:mod:`jlens_core.interventions.read_directions` and the leaves.
"""

from .concepts import concept_vector, concept_vectors
from .decompose import Decomposition, Split, decompose, split
from .dictionary import JSpace, jspace
from .pursuit import Pursuit, pursuit

__all__ = ["Decomposition", "JSpace", "Pursuit", "Split", "concept_vector", "concept_vectors", "decompose", "jspace",
           "pursuit", "split"]
