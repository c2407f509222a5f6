"""Native CPU kernels, compiled on first use with torch's extension builder and cached on disk.

Everything here is optional: if the compiler or build fails, callers fall back to plain PyTorch ops.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, bool] = {}
_load_report: list["KernelLoad"] = []


@dataclass(frozen=True)
class KernelLoad:
    """How this process got its CPU kernels: the seconds it took, and whether they had to be compiled (a build
    cache miss: the sources changed, or this machine never built them)."""

    seconds: float
    built: bool
NAME = "tokenline_cpu_kernels"
# A build takes ~30 s (minutes on a busy machine). torch's builder waits forever on the lock file of a build
# whose process died, so a lock older than this is taken to be such a leftover and removed.
STALE_LOCK_S = 600.0


def cpu_kernels_available() -> bool:
    """Builds (once per machine, ~30 s) and loads the CPU kernels; False if that is not possible here."""
    with _lock:
        if "cpu" not in _state:
            started = time.perf_counter()
            before = _newest_library()
            _state["cpu"] = _load()
            after = _newest_library()
            _load_report.append(KernelLoad(time.perf_counter() - started, after is not None and after != before))
        return _state["cpu"]


def kernel_load() -> KernelLoad | None:
    """How the kernels were loaded in this process; None before any engine asked for them."""
    return _load_report[0] if _load_report else None


@functools.cache
def build_name() -> str:
    """The build's name carries a digest of the sources: torch's builder keeps one build per name and rebuilds it
    whenever the sources differ, so two checkouts (or versions) sharing a machine would otherwise rebuild on
    every engine start that alternates between them (~20 s here)."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.cpp")):
        digest.update(source.name.encode() + source.read_bytes())
    return f"{NAME}_{digest.hexdigest()[:12]}"


def _newest_library() -> float | None:
    """The newest modification time among the built libraries (torch's builder names them NAME[_vN].so)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        libraries = Path(_get_build_directory(build_name(), verbose=False)).glob("*.so")
        return max((lib.stat().st_mtime for lib in libraries), default=None)
    except Exception:  # no build directory: nothing was built
        return None


def _load() -> bool:
    if os.environ.get("TOKENLINE_DISABLE_CPU_KERNELS") == "1":
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        _remove_stale_lock(Path(_get_build_directory(build_name(), verbose=False)) / "lock")
        here = Path(__file__).parent
        load(name=build_name(), sources=[str(here / "paged_attention_cpu.cpp"),
                                                    str(here / "layers_cpu.cpp")], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
             extra_ldflags=["-fopenmp"], verbose=False)
        return all(hasattr(torch.ops.tokenline, op) for op in
                   ("paged_decode_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "write_kv_cache"))
    except Exception as exc:  # no compiler, no ninja, an unsupported platform: all mean "use plain torch"
        log.warning("CPU kernels unavailable, using plain PyTorch attention: %s", exc)
        return False


def _remove_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> None:
    torch.ops.tokenline.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * norm(x), or with a residual: residual += x (in place), then weight * norm(residual)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.tokenline.rms_norm(out, x, residual, weight, eps)
    return out


def rotary_embedding_(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_q_heads: int,
                      num_kv_heads: int, head_dim: int) -> None:
    torch.ops.tokenline.rotary_embedding(qkv, positions, cos_sin, num_q_heads, num_kv_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    torch.ops.tokenline.silu_and_mul(out, gate_up)
    return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    torch.ops.tokenline.write_kv_cache(k, v, k_cache, v_cache, slots)
