"""The client-side tokenizer that makes prompts of exact token lengths.

A Hugging Face tokenizer folder is used as is. The default model's GGUF file holds its tokenizer too, but rebuilding
it from GGUF metadata takes seconds, so the rebuilt tokenizer is saved once beside the model cache and reused.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# engine.model_fetch's names, restated: importing the engine package loads torch, which a client run never needs
# (only rebuilding a tokenizer from a GGUF file does, once, below)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENLINE_CACHE") or Path.home() / ".cache" / "tokenline")


def default_tokenizer_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_FILE


def load_tokenizer(path: str | Path | None = None) -> Any:
    """A transformers tokenizer from an HF folder or a GGUF file (default: the default model's GGUF)."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path) if path else default_tokenizer_path()
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer {path} does not exist: pass --tokenizer with a Hugging Face tokenizer folder or a GGUF "
            f"file, or run `make model` to fetch the default model")
    if not str(path).endswith(".gguf"):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    saved = cache_dir() / "tokenizers" / path.stem
    if (saved / "tokenizer.json").exists() and saved.stat().st_mtime >= path.stat().st_mtime:
        return AutoTokenizer.from_pretrained(saved, local_files_only=True)
    from engine.loader import load_tokenizer as load_from_gguf

    log.info("rebuilding the tokenizer from %s (once; saved to %s)", path, saved)
    tokenizer = load_from_gguf(path)
    try:
        saved.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(saved)
    except OSError as exc:  # a read-only cache still works, just slower next time
        log.warning("could not save the tokenizer to %s: %s", saved, exc)
    return tokenizer
