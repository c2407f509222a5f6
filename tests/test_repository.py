"""A clone of the repository is self-contained: nothing it runs or tests reads from a folder beside it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from loadtests.datasets import MOONCAKE_TRACE, load_trace

ROOT = Path(__file__).resolve().parents[1]
# Built from parts, so this file does not match itself.
OUTSIDE = re.compile("|".join([re.escape("../" + "shared"), re.escape("/work/" + "shared"),
                               r"/\s*[\"']" + "shared" + r"[\"']"]))
SKIPPED_DIRS = {".git", ".venv", "results", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", ".cache"}


def repository_files() -> list[Path]:
    """The checkout's files (tracked, or new and not ignored); every file under the root outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                                text=True, check=True, timeout=60).stdout.splitlines()
        return [ROOT / name for name in listed if (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in p.parts)]


def test_no_file_refers_to_a_folder_beside_the_repository():
    files = repository_files()
    assert any(p.name == "Makefile" for p in files) and any(p.parts[-2:] == ("tests", "conftest.py") for p in files)
    offenders = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary
            continue
        offenders += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1)
                      if OUTSIDE.search(line)]
    assert not offenders


def test_vendored_data_sits_in_the_repository_with_its_licence():
    assert len(load_trace(MOONCAKE_TRACE)) > 3000
    crd = ROOT / "tests" / "fixtures" / "kuberay" / "ray.io_rayservices.yaml"
    for data, licence in ((MOONCAKE_TRACE, "LICENSE-mooncake"), (crd, "LICENSE-kuberay")):
        assert data.stat().st_size > 100_000
        assert "Apache License" in (data.parent / licence).read_text()


def test_ray_pin_holds_the_installed_ray_and_the_images_ray():
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    pin = SpecifierSet(re.search(r'"ray\[serve\]([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1))
    assert pin.contains(version("ray"))
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        image_ray = re.search(r"^ARG RAY_VERSION=(\S+)$", (ROOT / dockerfile).read_text(), re.M).group(1)
        assert pin.contains(image_ray), f"{dockerfile} installs Ray {image_ray}, outside pyproject's {pin}"
