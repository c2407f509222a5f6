"""Building blocks: a linear layer that can use prepacked weights on CPU (our kernel on AVX512-BF16 or AVX2, or
oneDNN's), RMSNorm, RoPE."""
from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import native_int8_max_rows

log = logging.getLogger(__name__)


@functools.cache
def onednn_prepack_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Private oneDNN ops that inductor's freezing uses; absent or changed in some torch builds, and without bf16
    kernels on CPUs with no AVX-512. Probed once a process and dtype."""
    try:
        w = torch.randn(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
        return bool(torch.allclose(out.float(), F.linear(torch.ones(2, 8, dtype=dtype), w).float(), atol=1e-2))
    except (AttributeError, RuntimeError) as exc:
        log.info("oneDNN's prepacked %s linear unavailable here (%s)", dtype, exc)
        return False


def select_linear_packing(device: torch.device, dtype: torch.dtype, enabled: bool = True,
                          quantization: str | None = None) -> str | None:
    """How CPU linears are prepacked. bf16: `native` (engine.kernels: AVX512-BF16 dot products, ~25% less time
    than oneDNN at batch 1 and 32 on a Xeon; or AVX2 FMAs on the weights widened to fp32, 4-5x torch's bf16 matmul
    where the CPU has no bf16 arithmetic), `native-int8` (`quantization: int8`: also int8 weights for decode-sized
    steps), `onednn`, or None (F.linear). fp32: `onednn` (oneDNN's prepacked fp32 weights: a decode step's linears
    in about half the time of F.linear's MKL matmul on an AMD EPYC, which streams small-row steps' weights at a
    fraction of the memory's rate there), or None (F.linear) where those ops are missing; `prepack_weights: false`
    keeps F.linear, the arithmetic transformers runs."""
    from engine.kernels import native_int8_available, native_linear_available
    bf16_cpu = enabled and device.type == "cpu" and dtype == torch.bfloat16
    if quantization is not None:
        if not (bf16_cpu and native_int8_available()):
            raise ValueError("quantization: int8 runs on the native CPU linear kernel: it needs device cpu, dtype "
                             "bfloat16, prepack_weights and a CPU with AVX512-BF16 and AVX512-VNNI, or AVX2 and FMA")
        return "native-int8"
    if enabled and device.type == "cpu" and dtype == torch.float32:
        return "onednn" if onednn_prepack_available(torch.float32) else None
    if not bf16_cpu:
        return None
    if native_linear_available():
        return "native"
    return "onednn" if onednn_prepack_available() else None


def linears_described(packing: str | None, native_max_rows: int | None) -> str:
    """How the linears run, for the engine's ready line: `native`, `native on AMX tiles up to 80 rows, oneDNN
    beyond`, ..."""
    if packing is None:
        return "F.linear"
    from engine.kernels import native_linear_amx
    if packing.startswith("native") and native_linear_amx():
        packing += " on AMX tiles"
    if native_max_rows is None:
        return packing
    return f"{packing} up to {native_max_rows} rows, oneDNN beyond"


# Natively packed linears hand steps of more rows than this to oneDNN's prepacked kernel where the CPU has AMX.
# Where the native kernel runs on AMX tiles itself (built on such a CPU, and Linux lends the process the tile
# state), it streams a step's weights at the memory's rate up to 16 rows, is ahead of oneDNN's kernels up to 80
# rows, and from 64 rows takes two row tiles against two blocks of outputs with K in chunks that stay in L1: level
# with oneDNN's linears alone up to 320 rows (`python -m benchmarks.linear_crossover`), and a whole prefill step of
# 256 tokens runs 1.2-1.6x faster on it than on oneDNN (`make step-breakdown BENCH_ARGS="--batches 1
# --native-linear-max-rows 80"` against 320: 105 / 88 ms on one thread, 80-83 / 51-61 on two), the steps' other
# kernels included. Where it has only the
# AVX512-BF16 dot products, up to 6 rows (one of its row tiles): 18.5 against 22.7 ms a decode step at 6 rows on
# 2 threads, 26.8 against 25.4 at 8 (`make step-breakdown`, README).
# A fixed rule rather than a measurement at start-up: every replica of a machine type then runs the same kernels
# on the same steps, so their answers agree.
AMX_TILES_MAX_ROWS = 320
AMX_NATIVE_MAX_ROWS = 6


def default_native_max_rows() -> int | None:
    """EngineConfig.native_linear_max_rows when unset: where the CPU has AMX, AMX_TILES_MAX_ROWS if the native
    kernel runs on its tiles, else AMX_NATIVE_MAX_ROWS; elsewhere None (the native kernel at every size)."""
    from engine.kernels import cpu_has_amx, native_linear_amx
    if not cpu_has_amx():
        return None
    return AMX_TILES_MAX_ROWS if native_linear_amx() else AMX_NATIVE_MAX_ROWS


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8, symmetric, one scale per output row, packed as the native kernel reads it
    ([N/16, K/2, 16, 2], rows past N zero). Returns (packed int8, fp32 scales of N rounded up to 16)."""
    n, k = weight.shape
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    rows = -(-n // 16) * 16
    q = torch.nn.functional.pad(q, (0, 0, 0, rows - n))
    scales = torch.nn.functional.pad(scales, (0, rows - n), value=1.0)
    return q.view(rows // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous(), scales


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.packed_int8: torch.Tensor | None = None  # quantization int8: for steps of up to native_int8_max_rows()
        self.scales: torch.Tensor | None = None  # the int8 weights': one per output row
        self.packing: str | None = None
        # Native packing: steps of more rows than this run oneDNN's prepacked kernel on `packed_onednn`, a second
        # copy of the weight in its layout (use_onednn_above); None: the native kernel at every size.
        self.native_max_rows: int | None = None
        self.packed_onednn: torch.Tensor | None = None

    def prepack(self, packing: str | None = "onednn") -> None:
        """`native`, `native-int8` or `onednn`; None: unpacked (F.linear)."""
        if self.weight.is_meta:
            raise RuntimeError("this layer's plain weight was let go after packing (drop_plain_weight): pack it "
                               "another way from a freshly loaded model")
        if packing and packing.startswith("native") and self.weight.shape[1] % 2:  # the kernel reads x in pairs
            # oneDNN's prepack, or F.linear on a CPU without oneDNN's bf16 kernels
            packing = "onednn" if onednn_prepack_available() else None
        self.packed_int8 = self.scales = None
        if packing == "native-int8":
            self.packed_int8, self.scales = quantize_int8(self.weight.data)
        if packing in ("native", "native-int8"):
            self.packed = torch.ops.tokenline.pack_linear_weight(self.weight.data.contiguous())
        elif packing == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, None)
        else:
            self.packed = None
        self.packing = packing
        self.native_max_rows = self.packed_onednn = None

    def drop_plain_weight(self) -> int:
        """Once packed, no step reads `weight`: lets its memory go, leaving a tensor of its shape and dtype on the
        meta device (what reads the layer's shape still can; what would compute with it fails loudly). Returns the
        bytes let go; 0 where the layer is not packed."""
        if self.packed is None or self.weight.is_meta:
            return 0
        freed = self.weight.nbytes
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)
        return freed

    def use_onednn_above(self, rows: int) -> None:
        """Natively packed: steps of more than `rows` rows run oneDNN's prepacked kernel (AMX where the CPU has it)."""
        if self.packing in ("native", "native-int8"):
            self.packed_onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, None)
            # quantization int8: steps its int8 weights serve stay on them
            self.native_max_rows = max(rows, native_int8_max_rows()) if self.packed_int8 is not None else rows

    def _native_kernel(self, rows: int) -> str | None:
        """Which kernel a natively packed layer runs for a step of `rows` rows: `onednn` past native_max_rows (where
        it holds oneDNN's copy), `int8` up to native_int8_max_rows() (where it has int8 weights), else `bf16`; None
        where the layer is not natively packed."""
        if self.packing not in ("native", "native-int8"):
            return None
        if self.packed_onednn is not None and rows > self.native_max_rows:
            return "onednn"
        return "int8" if self.packed_int8 is not None and rows <= native_int8_max_rows() else "bf16"

    @staticmethod
    def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
        """x as the native kernels read it: [rows, K], rows even-aligned with a contiguous last dim."""
        rows = x.reshape(-1, x.shape[-1])
        return rows.contiguous() if rows.stride(-1) != 1 or rows.stride(0) % 2 else rows

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, where this layer's output is [gate | up] (a Llama MLP's gate_up_proj): natively packed
        bf16 steps on the native kernel, which takes it straight from its sums on AMX tiles (the same bits as
        silu_and_mul on its output); the rest through forward, then silu_and_mul."""
        from engine.kernels import silu_and_mul
        n, half = x.numel() // x.shape[-1], self.out_features // 2
        if x.dtype == torch.bfloat16 and self._native_kernel(n) == "bf16":
            out = torch.empty(n, half, dtype=x.dtype, device=x.device)
            torch.ops.tokenline.packed_linear_silu_mul(out, self._kernel_rows(x), self.packed, self.bias,
                                                       self.out_features)
            return out.view(*x.shape[:-1], half)
        return silu_and_mul(self(x).reshape(n, self.out_features)).view(*x.shape[:-1], half)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`out_dtype` (the LM head asks for fp32 logits) saves a cast where the kernel can write it directly."""
        kernel = self._native_kernel(x.numel() // x.shape[-1])
        if kernel == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed_onednn, self.bias, "none", [], "")
            return out if out_dtype is None else out.to(out_dtype)
        if kernel is not None:
            rows = self._kernel_rows(x)
            out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype or x.dtype, device=x.device)
            if kernel == "int8":
                torch.ops.tokenline.packed_linear_int8(out, rows, self.packed_int8, self.scales, self.bias,
                                                       self.out_features)
            else:
                torch.ops.tokenline.packed_linear(out, rows, self.packed, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        if self.packing == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if out_dtype is None else out.to(out_dtype)


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it first adds x into it and normalises the sum (returning both)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.fused = False  # the native CPU kernel; set by the model when it is available

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            from engine.kernels import rms_norm
            out = rms_norm(x, self.weight, self.eps, residual)  # updates residual in place
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for the config's RoPE type (as transformers computes them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position)
    raise ValueError(f"RoPE scaling type {kind!r} is not supported; supported: default, linear, llama3, yarn")


def _yarn(head_dim: int, theta: float, s: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_position
    mscale = s.get("mscale")
    mscale_all = s.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all:
        attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
    else:
        attention_factor = s.get("attention_factor") or get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (transformers' rotate_half) from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_scaling).to(dtype), persistent=False)
        # fp32 [position, cos(half) | sin(half)] for the native CPU kernel, which rotates q and k in place.
        # A plain attribute, not a buffer, so that casting the model to bf16 leaves it in fp32.
        self.cos_sin = (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_scaling).contiguous()
        self.half = head_dim // 2

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :self.half], x[..., self.half:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
