"""The native bf16 linear (packed weights, AVX512-BF16 dot products) against F.linear, and its fallbacks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import native_linear_available
from engine.models.layers import Linear, select_linear_packing

needs_native = pytest.mark.skipif(not native_linear_available(),
                                  reason="this CPU has no AVX512-BF16 (or no C++ toolchain): the native linear "
                                         "is not built, and oneDNN or F.linear serve instead")


def linear(in_features: int, out_features: int, bias: bool, packing: str | None) -> Linear:
    torch.manual_seed(in_features + out_features)
    layer = Linear(in_features, out_features, bias)
    layer.weight.data = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    if bias:
        layer.bias.data = torch.randn(out_features).to(torch.bfloat16)
    if packing:
        layer.prepack(packing)
    return layer


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32])  # a whole and a partial tile of 6 rows
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (50, 576), (3072, 576), (577, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear_in_bf16(rows, out_features, in_features, bias):
    layer = linear(in_features, out_features, bias, "native")
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # fp32 accumulation either way; the only difference is bf16 rounding of the output.
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    logits = layer(x, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)


@needs_native
def test_native_linear_reads_strided_rows_and_keeps_leading_dims():
    layer = linear(64, 40, True, "native")
    wide = torch.randn(5, 96).to(torch.bfloat16)
    x = wide[:, 16:80]  # rows 96 elements apart, last dim contiguous
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=2e-2, rtol=1e-2)
    batch = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert layer(batch).shape == (2, 3, 40)


@needs_native
def test_an_odd_input_width_falls_back_to_onednn():
    layer = linear(63, 40, False, "native")
    assert layer.packing == "onednn"
    x = torch.randn(3, 63).to(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), atol=2e-2, rtol=1e-2)


@needs_native
def test_native_linear_handles_an_empty_batch():
    layer = linear(64, 40, False, "native")
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 40)


def test_packing_is_native_on_bf16_cpu_when_built_and_never_for_fp32():
    cpu = torch.device("cpu")
    assert select_linear_packing(cpu, torch.float32) is None  # fp32 stays exact: F.linear
    assert select_linear_packing(cpu, torch.bfloat16, enabled=False) is None
    expected = "native" if native_linear_available() else select_linear_packing(cpu, torch.bfloat16)
    assert select_linear_packing(cpu, torch.bfloat16) == expected


def test_every_packing_gives_the_same_layer_output():
    x = torch.randn(3, 576).to(torch.bfloat16)
    reference = linear(576, 96, True, None)(x).float()
    for packing in ["onednn"] + (["native"] if native_linear_available() else []):
        try:
            out = linear(576, 96, True, packing)(x).float()
        except (AttributeError, RuntimeError):  # oneDNN's private ops missing in this torch build
            continue
        torch.testing.assert_close(out, reference, atol=3e-2, rtol=2e-2)
