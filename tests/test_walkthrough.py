"""examples/walkthrough.ipynb: stripped in the repository, and it runs top to bottom on the default model (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "walkthrough.ipynb"
nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install jacobian-lens[dev])")


def test_the_notebook_is_stored_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert len(code) >= 10
    dirty = [i for i, cell in enumerate(code) if cell.outputs or cell.execution_count is not None]
    assert not dirty, f"code cells {dirty} hold outputs: clear them before committing (jupyter nbconvert --clear-output)"


@pytest.mark.slow
def test_the_notebook_runs_on_the_default_model(tmp_path):
    """Every cell runs on the embedded default model (its speed is no test's business: a loaded host only slows it)."""
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install jacobian-lens[dev])")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    kinds = [sorted(o.get("data", {})) for o in outputs if o.output_type in ("execute_result", "display_data")]
    figures = [k for k in kinds if "application/vnd.plotly.v1+json" in k or "text/html" in k]
    assert len(figures) >= 8, kinds  # the reading's own heatmap and every .figure() / *_figure()
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "walkthrough.html" in printed and "walkthrough.jlens.json" in printed
