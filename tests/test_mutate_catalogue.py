"""The focused mutation check's catalogue stays usable (scripts/mutate.py): every catalogued
mutation still applies to the tree (each replaced text is in its file exactly once) and names
test files that exist, the names its docstring lists are catalogued, and `--module` picks the
mutations of a file or of the files under a folder (those changing two files included).
Not covered: running the mutations (`python3 scripts/mutate.py --all` does; each runs tests).
"""

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("scripts_mutate", ROOT / "scripts" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_every_catalogued_mutation_applies_and_names_existing_tests(mutate):
    assert len(mutate.BY_NAME) == len(mutate.CATALOGUE)  # names are unique
    for m in mutate.CATALOGUE:
        texts = mutate.mutated_files(ROOT, m)
        assert texts is not None, f"{m.name}: not applied (update the catalogue)"
        assert set(texts) == set(m.files)
        assert all(texts[f] != (ROOT / f).read_text() for f in texts), m.name
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).is_file(), f"{m.name}: no test file {t}"


def test_docstring_lists_catalogued_names_and_module_selects_by_file(mutate, capsys):
    table = mutate.__doc__.split("The catalogue, by the module")[1].split("\n\n")[0]
    listed = {w for w in re.split(r"[\s,()]+", table)
              if re.fullmatch(r"[a-z_]+\.[a-z_]+", w) and not w.endswith(".py")}
    assert listed and listed <= set(mutate.BY_NAME), listed - set(mutate.BY_NAME)

    names = lambda ms: {m.name for m in ms}
    assert names(mutate.select(modules=["rl/advantages.py"])) == {"advantages.last_token_by_count"}
    losses = names(mutate.select(modules=["rl/losses.py"]))
    assert {"losses.old_logp_differentiated", "train_step.current_old_logp_differentiated"} <= losses
    assert "train_step.current_old_logp_differentiated" in names(
        mutate.select(modules=["rl/train_step.py"]))
    model = mutate.select(modules=["model/"])
    assert model and all(any(f.startswith("model/") for f in m.files) for m in model)
    assert names(mutate.select(modules=["model"])) == names(model)  # a folder with or without /
    with pytest.raises(ValueError, match="no catalogued mutation touches"):
        mutate.select(modules=["rl/no_such_module.py"])
    with pytest.raises(ValueError, match="unknown mutation"):
        mutate.select(names=["no.such_mutation"])

    assert mutate.main(["--list", "--module", "rl/advantages.py"]) == 0
    out = capsys.readouterr().out
    assert "advantages.last_token_by_count" in out and "sampler." not in out
