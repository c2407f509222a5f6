"""What a replica's cold start is made of, and what shortens it: the engine reports its start-up phases, a GGUF
model is dequantized once per machine, and the native kernels keep one build per version of their sources."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine import kernels
from engine import loader
from tests.tiny_models import write_tiny_model


def test_an_engine_reports_where_its_start_up_went(tmp_path):
    path = tmp_path / "tiny"
    write_tiny_model(path, "llama")
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, num_threads=1))
    startup = engine.startup
    assert startup.weights_s > 0 and startup.model_s > 0
    assert startup.total_s >= startup.weights_s + startup.model_s
    assert 0 <= startup.kernels_s <= startup.total_s
    handed = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, num_threads=1),
                       source=loader.load_model_source(path))
    assert handed.startup.weights_s == 0.0  # the caller read the weights


def test_the_kernel_build_is_named_after_its_sources(tmp_path, monkeypatch):
    """Two versions of the sources sharing a machine keep two builds: neither start rebuilds the other's."""
    name = kernels._build_name()
    for source in kernels.SOURCES + kernels.HEADERS:
        (tmp_path / source).write_text(f"// {source}")
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "__init__.py"))
    first = kernels._build_name()
    (tmp_path / kernels.SOURCES[0]).write_text("// changed")
    assert kernels._build_name() != first != name
    changed = kernels._build_name()
    (tmp_path / kernels.HEADERS[0]).write_text("// changed too")
    assert kernels._build_name() != changed
    monkeypatch.undo()
    assert kernels._build_name() == name


def test_one_version_in_two_folders_keeps_two_builds(tmp_path, monkeypatch):
    """torch's build file names the sources by path: a shared name would rebuild on every switch of checkout."""
    names = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        for source in kernels.SOURCES + kernels.HEADERS:
            (tmp_path / folder / source).write_text(f"// {source}")
        monkeypatch.setattr(kernels, "__file__", str(tmp_path / folder / "__init__.py"))
        names.append(kernels._build_name())
    assert names[0] != names[1]


@pytest.mark.slow
def test_a_gguf_model_is_dequantized_once_and_read_back_equal(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLINE_CACHE", str(tmp_path))
    kept = loader._dequantized_path(smollm2_path)
    assert not kept.exists()
    args, weights = loader.load_model_source(smollm2_path)
    assert kept.exists() and not list(kept.parent.glob("*.partial"))
    again_args, again = loader.load_model_source(smollm2_path)
    assert again_args == args
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)


@pytest.mark.slow
def test_a_gguf_tokenizer_is_rebuilt_once_and_read_back_the_same(smollm2_path, tmp_path, monkeypatch):
    """The kept tokenizer encodes, decodes and renders chats as the one rebuilt from the GGUF file; a changed file
    (another modification time) is rebuilt, and a damaged copy is rebuilt over."""
    monkeypatch.setenv("TOKENLINE_CACHE", str(tmp_path))
    kept = loader._cached_path(smollm2_path, "tokenizers", "")
    assert not kept.exists()
    rebuilt = loader.load_tokenizer(smollm2_path)
    assert (kept / "tokenizer.json").exists() and not list(kept.parent.glob("*.partial"))
    again = loader.load_tokenizer(smollm2_path)
    texts = ["Hello world", "  two spaces\n\ta tab", "<|im_start|>user\nhi<|im_end|>", "émoji 🤖 中文", "ab" * 200]
    assert all(again.encode(t) == rebuilt.encode(t) for t in texts)
    ids = rebuilt.encode(texts[3] + texts[2])
    assert again.decode(ids) == rebuilt.decode(ids)
    assert again.get_vocab() == rebuilt.get_vocab()
    assert (again.eos_token, again.bos_token, again.all_special_tokens) == (
        rebuilt.eos_token, rebuilt.bos_token, rebuilt.all_special_tokens)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (again.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == rebuilt.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))

    (kept / "tokenizer.json").write_text("{not json")
    assert loader.load_tokenizer(smollm2_path).encode(texts[0]) == rebuilt.encode(texts[0])
    assert json.loads((kept / "tokenizer.json").read_text())["model"]  # rebuilt over the damaged copy

    copy = tmp_path / "models" / smollm2_path.name
    copy.parent.mkdir()
    shutil.copyfile(smollm2_path, copy)
    os.utime(copy, ns=(smollm2_path.stat().st_atime_ns, smollm2_path.stat().st_mtime_ns))
    same_time = loader._cached_path(copy, "tokenizers", "")
    assert same_time != kept  # another file: its own copy
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 1_000_000_000))
    assert loader._cached_path(copy, "tokenizers", "") != same_time  # the file changed: another key, so it is rebuilt
