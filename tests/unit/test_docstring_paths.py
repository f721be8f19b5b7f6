"""pytest tests/unit/test_docstring_paths.py — docstrings name files that exist; test files are named by behaviour.

A docstring's ``pytest tests/...`` line is how a reader finds a module's tests, and a path to
another module is how they find its partner; both went stale when files were renamed
(engine_state.py, engine_api.py and as_deepspeed.py named test files that no longer or never
existed). Checked: every repository path in the module docstrings of zerorun/, tests/,
examples/ and scripts/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATH = re.compile(r"\b((?:zerorun|tests|examples|scripts|docs)/[\w/\-.]+\.(?:py|md|yaml))\b")


def _modules():
    for top in ("zerorun", "tests", "examples", "scripts"):
        for path in sorted((REPO / top).rglob("*.py")):
            if "data" not in path.relative_to(REPO).parts[:2]:
                yield path


@pytest.mark.parametrize("top", ["zerorun", "tests", "examples", "scripts"])
def test_module_docstrings_name_files_that_exist(top):
    missing = []
    for path in (p for p in _modules() if p.relative_to(REPO).parts[0] == top):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        missing += [f"{path.relative_to(REPO)}: {name}" for name in PATH.findall(docstring)
                    if not (REPO / name).exists()]
    assert not missing, missing


def test_test_files_are_named_by_behaviour_not_by_issue():
    named = [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if re.search(r"issue_?\d", p.name)]
    assert not named, named
