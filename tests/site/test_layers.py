"""The layout holds: the layers contract (``pyproject.toml``, checked by ``lint-imports``) names
every module of ``llmgw_site`` (a module it does not name is checked by no layer at all), and no
module outgrows what a newcomer can read as one idea."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import tomllib

import llmgw_site
from tests.harness.procs import REPO_ROOT


def test_the_layers_contract_names_every_module_of_the_site() -> None:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers"]
    named = {
        module.strip().strip("()")
        for layer in contract["layers"]
        for module in layer.replace("|", ":").split(":")
    }
    modules = {f"llmgw_site.{m.name}" for m in pkgutil.iter_modules(llmgw_site.__path__)}
    assert modules - named == set()
    assert {"llmgw_site.settings", "llmgw_site.config"} <= modules


MAX_MODULE_LINES = 600
# Not ours to split: tests, migrations and the code protoc generates.
NOT_JUDGED = ("tests", "migrations")


def test_no_module_is_over_600_lines_unless_its_docstring_says_why_it_is_one_idea() -> None:
    # The modules the repository holds: nothing installed or written under .venv or var/.
    tracked = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-files", "*.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    too_long = {}
    for name in tracked:
        path = REPO_ROOT / name
        if set(path.relative_to(REPO_ROOT).parts) & set(NOT_JUDGED) or name.endswith("_pb2.py"):
            continue
        source = path.read_text()
        lines = source.count("\n")
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if lines > MAX_MODULE_LINES and "one idea" not in docstring:
            too_long[name] = lines
    assert tracked and too_long == {}
