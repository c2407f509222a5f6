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
SOURCES = ("paged_attention_cpu.cpp", "layers_cpu.cpp", "linear_cpu.cpp", "shm_collectives_cpu.cpp", "llama_cpu.cpp",
           "sampling_cpu.cpp")
HEADERS = ("vec_math.h", "thread_pool.h")  # included by the sources: a change to one is a new build too
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")


def _build_name() -> str:
    """One cached build per set of sources and checkout: checkouts of different versions, or of one version in two
    folders, share the cache without rebuilding over each other (torch's cache keeps one build per name, and its
    build file names the sources by path, so a second folder's start rebuilt the first's: 20-30 s)."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    digest.update(str(Path(__file__).resolve().parent).encode())
    for source in SOURCES + HEADERS:
        digest.update((Path(__file__).parent / source).read_bytes())
    return f"tokenline_cpu_kernels_{digest.hexdigest()[:12]}"


@dataclass(frozen=True)
class KernelLoad:
    """How this process got its CPU kernels: the seconds it took, and whether they had to be compiled (a build
    cache miss: the sources changed, or this machine never built them)."""

    seconds: float
    built: bool


# A build takes ~30 s (minutes on a busy machine). torch's builder waits forever on the lock file of a build
# whose process died, so a lock older than this is taken to be such a leftover and removed.
STALE_LOCK_S = 600.0
BUILT_AFTER_S = 5.0  # a load that took longer compiled the kernels (loading a cached build takes well under 1 s)


def cpu_kernels_available() -> bool:
    """Builds (once per machine and checkout, ~30 s) and loads the CPU kernels; False if that is not possible here."""
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


def _newest_library() -> float | None:
    """The newest modification time among the built libraries (torch's builder names them NAME[_vN].so)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        libraries = Path(_get_build_directory(_build_name(), verbose=False)).glob("*.so")
        return max((lib.stat().st_mtime for lib in libraries), default=None)
    except Exception:  # no build directory: nothing was built
        return None


def _load() -> bool:
    if os.environ.get("TOKENLINE_DISABLE_CPU_KERNELS") == "1":
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = _build_name()
        build_dir = Path(_get_build_directory(name, verbose=False))
        _remove_stale_lock(build_dir / "lock")
        if not any(build_dir.glob("*.so")):
            log.info("compiling the native CPU kernels: once per machine, version and checkout, about 30 s "
                     "(cached in %s)", build_dir)
        start = time.perf_counter()
        here = Path(__file__).parent
        load(name=name, sources=[str(here / s) for s in SOURCES], is_python_module=False,
             extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], verbose=False)
        elapsed = time.perf_counter() - start
        if elapsed > BUILT_AFTER_S:
            log.info("compiled the native CPU kernels in %.0f s; later starts load them from %s", elapsed, build_dir)
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


@functools.cache
def cpu_has_amx() -> bool:
    """AMX tiles for bf16 (Sapphire Rapids and later Xeons), as Linux reports them: oneDNN's matmuls and torch's
    flash attention use them, and outrun the native kernels past a few rows (engine.models.layers, engine.attention)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def native_linear_available() -> bool:
    """The bf16 packed linear (engine/kernels/linear_cpu.cpp) needs the kernels and a CPU with AVX512-BF16 and
    AVX512-VNNI (bf16 dot products), or AVX2 and FMA (the weights widened to fp32 as they stream in)."""
    return cpu_kernels_available() and bool(torch.ops.tokenline.packed_linear_supported())


def native_int8_available() -> bool:
    """int8 weights (`quantization: int8`) run on AVX512-VNNI's int16 dot products, or on AVX2's (vpmaddwd)."""
    return cpu_kernels_available() and bool(torch.ops.tokenline.packed_linear_int8_supported())


@functools.cache
def native_int8_max_rows() -> int:
    """Steps of up to this many rows run on the int8 weights where a layer has them, larger steps on its bf16 ones:
    where the int8 kernel is ahead on this build's instruction set (8 with AVX512-VNNI, 32 with AVX2); 0 where
    there is no int8 kernel."""
    return int(torch.ops.tokenline.packed_linear_int8_max_rows()) if native_int8_available() else 0


def native_linear_amx() -> bool:
    """Whether the packed linear runs on AMX tiles in this process: built on a CPU with them (-march=native) and
    lent the tile state by Linux. Its rows from which it does (1 by default) are torch.ops.tokenline
    .linear_amx_min_rows(rows), which 0 turns off."""
    return native_linear_available() and torch.ops.tokenline.linear_amx_min_rows() > 0


def native_layers_available() -> bool:
    """The decoder layers in one native call (engine/kernels/llama_cpu.cpp), whose attention takes every new token
    as a row: keys packed (AVX512-BF16) or bf16 rows in the plain layout (AVX2)."""
    return (native_linear_available() and hasattr(torch.ops.tokenline, "llama_layers")
            and (packed_keys_supported(16, 64, 1) or plain_token_rows_supported(64)))


def packed_keys_supported(block_size: int, head_dim: int, group: int) -> bool:
    """Whether the bf16 decode kernel can read keys in the packed layout (CpuAttention) on this CPU."""
    return cpu_kernels_available() and bool(torch.ops.tokenline.packed_keys_supported(block_size, head_dim, group))


def plain_token_rows_supported(head_dim: int) -> bool:
    """Whether bf16 attention rows in the plain key layout, prompt rows as well as decodes, run on the AVX2 kernel on
    this CPU (one without AVX-512)."""
    return cpu_kernels_available() and bool(torch.ops.tokenline.plain_token_rows_supported(head_dim))


def native_attention_amx() -> bool:
    """Whether the attention kernel's query tiles (prompt rows) run on AMX tiles in this process; where the build and
    Linux allow it, on unless torch.ops.tokenline.attention_amx(0) turned them off."""
    return cpu_kernels_available() and bool(torch.ops.tokenline.attention_amx())


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           query_tiles: bool = True) -> None:
    """Attention of token rows over the paged cache, each row causal up to its own length. With packed keys, runs
    of rows of one sequence go in query tiles unless query_tiles is False."""
    torch.ops.tokenline.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale, query_tiles)


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


def native_sampler_available() -> bool:
    """One native call per step for greedy and plain temperature sampling (engine/kernels/sampling_cpu.cpp)."""
    return cpu_kernels_available() and hasattr(torch.ops.tokenline, "sample_rows")


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token of fp32 logits [rows, vocab]: its argmax where temperature <= 0, else a draw from
    softmax(logits / temperature) at the row's uniform (float64 in [0, 1))."""
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.tokenline.sample_rows(out, logits, temperature, uniform)
    return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    torch.ops.tokenline.write_kv_cache(k, v, k_cache, v_cache, slots)
