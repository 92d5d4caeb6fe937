"""Every notebook runs top to bottom on the CPU, so none of them rots."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One kernel for every notebook: its start-up and the first trace's warm-up (imports, torch's dispatch caches)
    are paid once. Each notebook starts from an empty namespace (`%reset -f`), so none leans on another's names."""
    from jupyter_client import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path_factory.mktemp("notebooks")))
    yield manager
    manager.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
    NotebookClient(notebook, km=kernel, timeout=300, kernel_name="python3").execute()
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
    assert any(o.get("data", {}).get("image/png") for cell in notebook.cells if cell.cell_type == "code"
               for o in cell.outputs), "the breakdown picture is missing"
