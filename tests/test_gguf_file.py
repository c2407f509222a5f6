"""engine.gguf_file reads a GGUF file's header and tensors as the `gguf` package's own reader does."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.gguf_file import GGUFFile  # noqa: E402


def write_gguf(path, alignment: int | None = None) -> None:
    """Every kind of metadata value, and float, integer and block-quantized tensors (one not a multiple of 8 bytes,
    so the next starts on the alignment's padding)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_uint32("general.alignment", alignment)
        writer.data_alignment = alignment
    writer.add_uint32("llama.block_count", 2)
    writer.add_int8("test.int8", -5)
    writer.add_uint64("test.uint64", 2**40 + 3)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_float64("test.float64", -1.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "ünïcode ✓")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "héllo", "", "▁world"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 1, 1, 1])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", rng.standard_normal((7, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(3).astype(np.float16))
    writer.add_tensor("test.int32", np.arange(5, dtype=np.int32))
    weights = rng.standard_normal((4, 64), dtype=np.float32)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        quantized = gguf.quants.quantize(weights, qtype)
        writer.add_tensor(f"blk.0.ffn_{qtype.name}.weight", quantized, raw_shape=quantized.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_fields_and_tensors_are_what_the_gguf_package_reads(tmp_path, alignment):
    path = tmp_path / "model.gguf"
    write_gguf(path, alignment)
    theirs, ours = gguf.GGUFReader(str(path)), GGUFFile(path)
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}  # its header's
    assert list(ours.fields) == list(fields)
    for key, field in fields.items():
        if key != "test.nested":  # its contents() flattens an array of arrays
            assert ours.fields[key] == field.contents(), key
    assert ours.fields["test.string"] == "ünïcode ✓" and ours.fields["test.nested"] == [[1, 2], [3]]
    assert ours.fields["general.architecture"] == "llama" and ours.fields["test.uint64"] == 2**40 + 3
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
        if mine.name != "test.int32":  # integers are not dequantized
            assert np.array_equal(gguf.dequantize(mine.data, mine.tensor_type),
                                  gguf.dequantize(reference.data, reference.tensor_type)), mine.name


def test_a_file_that_is_not_gguf_or_ends_early_is_refused_with_a_reason(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path)
    data = path.read_bytes()
    (tmp_path / "other.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(tmp_path / "other.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="ends inside its header"):
        GGUFFile(tmp_path / "header.gguf")
    (tmp_path / "short.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(tmp_path / "short.gguf")


def test_the_default_model_reads_whole(smollm2_path):
    model = GGUFFile(smollm2_path)
    assert model.fields["general.architecture"] == "llama"
    assert len(model.fields["tokenizer.ggml.tokens"]) == 49152 and len(model.tensors) == 272
    embedding = next(t for t in model.tensors if t.name == "token_embd.weight")
    assert embedding.shape == (576, 49152)
