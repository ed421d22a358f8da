"""The workspace experiments of the Jacobian-lens paper (docs/experiments.md), each one call on any model:
``run_experiment(model, lens, name, items, band=...)`` from the reference's prompt-set formats."""
