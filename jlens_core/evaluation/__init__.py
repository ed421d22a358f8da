"""Judging lenses over item sets (docs/method.md §8): studies of where concepts appear (:mod:`.study`)."""
