"""Native CPU kernels, compiled on first use with torch's extension builder and cached on disk.

Everything here is optional: if the compiler or build fails, callers fall back to plain PyTorch ops.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, bool] = {}


def cpu_kernels_available() -> bool:
    """Builds (once per machine, ~30 s) and loads the CPU kernels; False if that is not possible here."""
    with _lock:
        if "cpu" not in _state:
            _state["cpu"] = _load()
        return _state["cpu"]


def _load() -> bool:
    if os.environ.get("TOKENLINE_DISABLE_CPU_KERNELS") == "1":
        return False
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).with_name("paged_attention_cpu.cpp")
        load(name="tokenline_cpu_kernels", sources=[str(source)], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
        return hasattr(torch.ops.tokenline, "paged_decode_attention")
    except Exception as exc:  # no compiler, no ninja, an unsupported platform: all mean "use plain torch"
        log.warning("CPU kernels unavailable, using plain PyTorch attention: %s", exc)
        return False


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.ops.tokenline.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
