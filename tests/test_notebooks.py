"""The notebooks run top to bottom, headless (nbclient + ipykernel), and are committed without
outputs.

Each notebook has one cell tagged `parameters`; the test inserts a cell of its own right after
it with smaller settings (as papermill does): the quickstart on the `test` model preset with 3
GRPO steps and without the per-device plan, the kernels notebook as is (on CPU it checks the
small shapes in interpret mode and skips the accelerator-only steps). The kernel process
inherits this process's environment, so XLA_FLAGS from tests/conftest.py apply, and the
notebooks' setup cell (scripts/_common.setup_jax) uses the suite's persistent compilation cache
under .cache/jax. A failing cell (the notebooks assert their own results: parameter totals,
restored checkpoint digests and samples, every kernel within tolerance) fails the test.

Measured 2026-12-01 on 2 CPU cores shared with other jobs (load average 8-10): quickstart 36-58 s
with a warm compilation cache, 116 s with an empty one; kernels notebook 18-19 s / 52 s. CPU time
of the kernel processes and the test together: 34-36 s warm, 74 s cold.
"""

import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = ("quickstart.ipynb", "kernels.ipynb")


def execute(name: str, overrides: str, timeout_s: int = 600):
    """The notebook executed in a fresh kernel (cwd notebooks/) with `overrides` run right
    after its parameters cell; returns the executed notebook."""
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: expected one cell tagged 'parameters', found {tagged}"
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(overrides))
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    return nb


def output_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "text/plain" in out.get("data", {}):
                parts.append(out.data["text/plain"])
    return "\n".join(parts)


def unstripped(nb) -> list[str]:
    """Why a notebook is not fit to commit: code cells with outputs or execution counts, and
    saved widget state."""
    problems = [f"cell {i}: {len(c.outputs)} outputs" for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and c.outputs]
    problems += [f"cell {i}: execution_count {c.execution_count}" for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and c.execution_count is not None]
    if "widgets" in nb.metadata:
        problems.append("metadata holds widget state")
    return problems


@pytest.mark.slow
def test_quickstart_runs_top_to_bottom(tmp_path):
    nb = execute("quickstart.ipynb", f'MODEL = "test"\nGRPO_STEPS = 3\nPLAN_PER_DEVICE = False\n'
                                     f'WORKDIR = {str(tmp_path)!r}')
    text = output_text(nb)
    assert "layer pattern 'KD'" in text and "2.84 T" in text
    # the sandbox section: isolation held and every reward hack scored 0
    assert re.search(r"network\s+status=error", text) and "Network is unreachable" in text
    assert re.search(r"read host files\s+status=error", text)
    assert re.search(r"infinite loop\s+status=timeout", text)
    assert re.search(r"memory hog\s+status=memory", text)
    assert len(re.findall(r"demonstration\s+score 1\.0", text)) == 3
    assert len(re.findall(r"wrong\s+score 0\.0", text)) == 3
    assert len(re.findall(r"hack\s+score 0\.0", text)) == 3
    # live plot: the GRPO cell shows a figure and every step's metrics
    grpo = next(c for c in nb.cells if c.cell_type == "code" and "show(history)" in c.source
                and "for i in range(GRPO_STEPS)" in c.source)
    assert any("image/png" in o.get("data", {}) for o in grpo.outputs)
    assert len(re.findall(r"step +\d+ +reward [\d.]+ +kl [\d.]+", text)) == 3
    assert "parameters identical: True" in text
    assert "same samples from the restored model: True" in text
    assert (tmp_path / "checkpoints" / "3").is_dir()
    assert unstripped(nb), "the stripped-notebook check must catch an executed notebook"


@pytest.mark.slow
def test_kernels_notebook_runs_in_interpret_mode_on_cpu(tmp_path):
    nb = execute("kernels.ipynb", f"OUT_DIR = {str(tmp_path)!r}")
    text = output_text(nb)
    assert "INTERPRET mode" in text
    assert "numerics: 5/5 cases within tolerance" in text
    for kernel in ("kda", "dsa_indexer", "dsa_attention", "mxfp4_matmul", "mxfp4_grouped"):
        assert re.search(rf"^{kernel}\s+\S+\s+(float32|bfloat16)\s.* yes ", text, re.M), kernel
    assert "summary: {'check': 'ok'}" in text
    assert (tmp_path / "check.json").is_file()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebooks_are_stripped(name):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    nbformat.validate(nb)
    assert not unstripped(nb), f"{name}: {unstripped(nb)}; clear all outputs before committing"


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)
