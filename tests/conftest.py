"""Shared fixtures: tiny random Llama-family checkpoints and the default model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"


def default_model_path() -> Path:
    from engine.model_fetch import default_model_path as cached
    return Path(os.environ.get("TOKENLINE_MODEL") or cached())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = default_model_path()
    if not path.exists():
        pytest.skip(f"default model not at {path}: run `make model` (make test does it)")
    return path
