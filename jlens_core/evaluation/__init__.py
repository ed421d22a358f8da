"""Judging lenses over sets of items and corpora (docs/method.md §8): one prompt at a time is :mod:`jlens_core.reading`.

* ``by_layer`` (:func:`evaluate`: per-layer KL / CE over a corpus);
* ``passk`` (pass@k of latent intermediate steps: the shipped sets, the protocol, the decoy control);
* ``labelled_items`` (pass@k items read once at their readout positions, for learning expert weights);
* ``lens_comparison`` (lenses compared on the same items with paired intervals; held-out items);
* ``study`` (:func:`study`: where each item's concepts enter every lens's top k, the band, paired onsets).

Imports :mod:`jlens_core.reading`, :mod:`jlens_core.interventions`, :mod:`jlens_core.figures` and what
they stand on; never :mod:`jlens_core.cli`.
"""
