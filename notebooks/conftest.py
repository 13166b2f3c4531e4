"""How the test run treats these notebooks (they run as tests under nbval, see
pyproject.toml): a notebook whose metadata says `{"minserve": {"real_model": true}}`
loads the embedded SmolLM2, so its cells get the `real_model` marker, and
`make test-fast` (`pytest -m "not real_model"`) leaves it out. Nothing here for a
student to read: the lessons start at README.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _uses_real_model(path: Path) -> bool:
    meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    return bool(meta.get("minserve", {}).get("real_model"))


def pytest_collection_modifyitems(config, items):
    seen: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.path))
        if path.suffix != ".ipynb":
            continue
        if path not in seen:
            seen[path] = _uses_real_model(path)
        if seen[path]:
            item.add_marker(pytest.mark.real_model)
