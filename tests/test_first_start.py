"""The first start explains itself: served names, a wrong model path or a busy port named before Ray starts,
the engine's configuration in one line, and the dashboard behind Ray's token auth."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deployments.config import AppArgs, served_name
from deployments.local import free_port
from deployments.ray_auth import auth_headers, dashboard_auth_mode, dashboard_help
from engine.model_fetch import GGUF_NAME
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("file_name", "name"), [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Llama-3.1-8B-Instruct.Q4_K_M.gguf", "Llama-3.1-8B-Instruct"),
    ("Qwen2.5-0.5B-Instruct-Q8_0.gguf", "Qwen2.5-0.5B-Instruct"),
    ("qwen2-7b-instruct-q4_k_m.gguf", "qwen2-7b-instruct"),
    ("Meta-Llama-3-8B-Instruct-IQ2_XXS.gguf", "Meta-Llama-3-8B-Instruct"),
    ("Mistral-7B-v0.3.BF16.gguf", "Mistral-7B-v0.3"),
    ("Mistral-7B-v0.3.gguf", "Mistral-7B-v0.3"),
    ("Q4_K_M.gguf", "Q4_K_M"),  # nothing left without the tag: the name stays whole
    ("Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct"),  # a Hugging Face folder
])
def test_served_name_is_the_file_name_without_gguf_and_a_trailing_quantisation_tag(file_name, name):
    assert served_name(f"/models/{file_name}") == name
    assert AppArgs(model=f"/models/{file_name}").model_name() == name


def test_served_model_name_overrides_the_file_name():
    args = AppArgs(model="/models/Llama-3.1-8B-Instruct.Q4_K_M.gguf", served_model_name="meta-llama/Llama-3.1-8B")
    assert args.model_name() == "meta-llama/Llama-3.1-8B"


def test_build_app_refuses_a_model_path_that_is_missing_or_not_a_model(tmp_path):
    from deployments.app import build_app

    not_gguf = tmp_path / "half-downloaded.gguf"
    not_gguf.write_bytes(b"<html>")
    for model, words in ((tmp_path / "absent.gguf", "does not exist"), (not_gguf, "is not a GGUF file"),
                         (tmp_path, "has no config.json")):
        with pytest.raises((OSError, ValueError)) as info:
            build_app(AppArgs(model=str(model)))
        assert str(model) in str(info.value) and words in str(info.value) and "make model" in str(info.value)


def test_run_with_a_missing_model_exits_at_once_naming_the_path_and_make_model():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "deployments.run", "--http-port", str(free_port()),
                           "--dashboard-port", str(free_port()), "--metrics-port", str(free_port()),
                           "deployments.app:build_app", "model=/nonexistent"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and time.monotonic() - start < 30
    assert "/nonexistent" in proc.stderr and "make model" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_make_serve_with_its_http_port_taken_exits_naming_the_port_before_ray_starts(tmp_path):
    venv = Path(sys.prefix)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # -o: the install and the model count as done (this test runs in an installed venv; the port check comes
        # before the model is needed).
        proc = subprocess.run(["make", "-s", "-o", f"{venv}/.installed", "-o", f"{tmp_path}/{GGUF_NAME}", "serve",
                               f"VENV={venv}", f"TOKENLINE_CACHE={tmp_path}", f"HTTP_PORT={port}",
                               f"DASHBOARD_PORT={free_port()}", f"METRICS_PORT={free_port()}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"port {port} on 127.0.0.1 (the OpenAI API) is already in use" in proc.stderr
    assert "HTTP_PORT" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_engine_start_logs_model_load_and_its_configuration_in_one_line(tmp_path, caplog):
    from engine import EngineConfig, LLMEngine

    write_tiny_model(tmp_path, "llama")
    with caplog.at_level(logging.INFO, logger="engine"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", attention_backend="torch", num_kv_blocks=64,
                               num_threads=1, max_model_len=256))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"loading the model from {tmp_path}") for m in messages)
    assert any(m.startswith("loaded ") and " in " in m for m in messages)
    (ready,) = [m for m in messages if m.startswith("engine ready")]
    for part in ("float32", "attention backend torch", "1 torch threads", "64 KV blocks", "max context 256 tokens"):
        assert part in ready


@pytest.mark.slow
@pytest.mark.serve
def test_ray_dashboard_wants_the_token_and_answers_the_rest_api_with_it(serve_app):
    url = serve_app.dashboard_url
    if os.environ.get("RAY_AUTH_MODE", "token") == "token":  # Ray's default for a local cluster
        assert dashboard_auth_mode(url) == "token"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/api/serve/applications/", timeout=30)
        assert refused.value.code == 401
        assert auth_headers()["Authorization"].startswith("Bearer ")
        assert "token auth on" in dashboard_help(url)
    assert "tokenline" in serve_app.dashboard_json("/api/serve/applications/")["applications"]
