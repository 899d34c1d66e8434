"""The layers contract (``pyproject.toml``, checked by ``lint-imports``) names every module of
``llmgw_site``: a module it does not name is checked by no layer at all."""

from __future__ import annotations

import pkgutil
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
