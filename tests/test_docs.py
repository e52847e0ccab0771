"""The docs' code stays runnable: ```python blocks are executed, ```yaml class paths are instantiated."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*ROOT.joinpath("docs").glob("*.md"), ROOT / "README.md"])
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> list[tuple[str, int, str]]:
    found = []
    for path in DOCS:
        if not path.exists():
            continue
        for index, match in enumerate(FENCE.finditer(path.read_text())):
            if match.group(1) == language:
                found.append((path.name, index, match.group(2)))
    return found


def class_specs(node) -> list[dict]:
    """Every ``{class_path: ..., init_args: ...}`` mapping in a YAML tree."""
    specs = []
    if isinstance(node, dict):
        if "class_path" in node:
            specs.append(node)
        for value in node.values():
            specs.extend(class_specs(value))
    elif isinstance(node, list):
        for value in node:
            specs.extend(class_specs(value))
    return specs


@pytest.mark.parametrize(("page", "index", "code"), blocks("python"), ids=lambda v: str(v)[:30])
def test_python_snippet_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page}[{index}]", "exec"), {"__name__": f"docs_{index}"})


@pytest.mark.parametrize(("page", "index", "text"), blocks("yaml"), ids=lambda v: str(v)[:30])
def test_yaml_snippet_instantiates(page, index, text):
    config = yaml.safe_load(text)
    specs = class_specs(config)
    assert specs, f"{page}[{index}] has no class_path to check"
    for spec in specs:
        if not spec["class_path"].startswith(("lightning_pulse", "examples")):
            continue
        module_name, _, class_name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module_name), class_name)
        init_args = {k: v for k, v in (spec.get("init_args") or {}).items() if not isinstance(v, dict)}
        cls(**init_args)
