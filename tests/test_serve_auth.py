"""API keys on the real app: the session app starts with the API open; a test points its running ingress at key
files of its own (as the app's `security` args would), writes them, and points it back. Key files fail closed.
Keys and prompts never reach the logs."""
from __future__ import annotations

import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from deployments.auth import SecurityArgs
from tests.serve_processes import configure_ingress_security

pytestmark = [pytest.mark.slow, pytest.mark.serve]

HI = [{"role": "user", "content": "hi"}]
ADMIN_PATHS = {("post", "/start_profile"), ("post", "/stop_profile"), ("get", "/debug/trace"),
               ("get", "/v1/timelines/{request_id}")}


def write_atomically(path: Path, text: str) -> None:
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    os.replace(fresh, path)


@contextmanager
def keys_on(serve_app, tmp_path: Path, api_keys: list[str], admin_key: str | None = None):
    """Yields the API key file, which the ingress reads on every request; an admin key file only with a key."""
    api_file, admin_file = tmp_path / "api_keys", tmp_path / "admin_key"
    write_atomically(api_file, "".join(f"{k}\n" for k in api_keys))
    if admin_key:
        write_atomically(admin_file, f"{admin_key}\n")
    configure_ingress_security(SecurityArgs(api_keys_file=str(api_file),
                                            admin_key_file=str(admin_file) if admin_key else None))
    try:
        yield api_file
    finally:
        configure_ingress_security(serve_app.args.security)


def assert_401(response: httpx.Response) -> dict:
    assert response.status_code == 401, response.text
    assert response.headers.get("www-authenticate") == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    return error


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_v1_needs_a_configured_key_once_keys_are_on(serve_app, tmp_path):
    body = {"model": serve_app.model, "messages": HI, "max_tokens": 2}
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        with keys_on(serve_app, tmp_path, ["sk-alpha-1", "sk-beta-2"]) as api_file:
            assert "provide an API key" in assert_401(http.get("/v1/models"))["message"]
            assert_401(http.post("/v1/chat/completions", json=body))
            assert_401(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
            error = assert_401(http.post("/v1/chat/completions", json=body, headers=bearer("sk-alpha-2")))
            assert "sk-alpha" not in error["message"]  # a wrong key is not echoed back
            assert http.get("/v1/models", headers=bearer("sk-beta-2")).status_code == 200
            assert http.get("/health").status_code == 200  # probes carry no key
            with openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="sk-alpha-1", max_retries=0,
                               timeout=60) as client:
                answer = client.chat.completions.create(model=serve_app.model, messages=HI, max_tokens=2)
                assert answer.choices[0].message.content is not None
            with openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="sk-gamma-3", max_retries=0,
                               timeout=60) as client:
                with pytest.raises(openai.AuthenticationError):
                    client.models.list()
            # Keys rotate by rewriting the file: the old key stops working on the next request.
            write_atomically(api_file, "sk-gamma-3\n")
            assert_401(http.get("/v1/models", headers=bearer("sk-alpha-1")))
            assert http.get("/v1/models", headers=bearer("sk-gamma-3")).status_code == 200
        assert http.get("/v1/models").status_code == 200  # keys off again


def test_key_file_emptied_or_unreadable_closes_the_api_until_keys_are_back(serve_app, tmp_path):
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        with keys_on(serve_app, tmp_path, ["sk-delta-4"]) as api_file:
            assert http.get("/v1/models", headers=bearer("sk-delta-4")).status_code == 200
            api_file.write_text("")  # emptied, as a rotation that truncates before it writes would leave it
            assert_401(http.get("/v1/models", headers=bearer("sk-delta-4")))
            assert_401(http.get("/v1/models"))
            api_file.write_bytes(b"\xff\xfe")  # not text
            assert_401(http.get("/v1/models", headers=bearer("sk-delta-4")))
            api_file.unlink()
            assert_401(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
            assert http.get("/health").status_code == 200  # probes carry no key
            write_atomically(api_file, "sk-delta-4\n")
            assert http.get("/v1/models", headers=bearer("sk-delta-4")).status_code == 200


def admin_routes(http: httpx.Client) -> list[tuple[str, str]]:
    spec = http.get("/openapi.json").json()
    return sorted((method, path) for path, ops in spec["paths"].items() for method in ops
                  if (method, path) in ADMIN_PATHS)


def call(http: httpx.Client, method: str, path: str, key: str | None = None) -> httpx.Response:
    url = path.replace("{request_id}", "chatcmpl-unknown")
    return http.request(method.upper(), url, headers=bearer(key) if key else {})


def test_admin_endpoints_need_the_admin_key(serve_app, tmp_path):
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        routes = admin_routes(http)
        if not routes:
            pytest.skip("this build serves no profiler, timeline or trace endpoint")
        with keys_on(serve_app, tmp_path, ["sk-user-1"], admin_key="sk-admin-1"):
            for method, path in routes:
                assert_401(call(http, method, path))
                assert_401(call(http, method, path, "sk-user-1"))
            for method, path in routes:
                if method == "get":  # reads only: the admin key gets past the guard
                    assert call(http, method, path, "sk-admin-1").status_code not in (401, 403), path
            assert http.get("/v1/models", headers=bearer("sk-admin-1")).status_code == 200
        with keys_on(serve_app, tmp_path, ["sk-user-1"]):
            # API keys on and no admin key: closed to every key, so no API-key holder can profile the server.
            for method, path in routes:
                response = call(http, method, path, "sk-user-1")
                assert response.status_code == 403 and response.json()["error"]["code"] == "admin_key_not_configured"


def session_log_files(serve_app) -> list[Path]:
    return [p for p in (Path(serve_app.session_dir) / "logs").rglob("*") if p.is_file()]


def test_keys_prompts_and_outputs_stay_out_of_the_logs(serve_app, tmp_path):
    key, marker = f"sk-{secrets.token_hex(8)}", f"zebra-{secrets.token_hex(4)}"
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http, keys_on(serve_app, tmp_path, [key]):
        for stream in (False, True):
            response = http.post("/v1/chat/completions", headers=bearer(key), json={
                "model": serve_app.model, "messages": [{"role": "user", "content": f"Repeat: {marker}"}],
                "max_tokens": 8, "stream": stream, "temperature": 0})
            assert response.status_code == 200
        output = http.post("/v1/completions", headers=bearer(key), json={
            "prompt": f"{marker} {marker} {marker}", "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
        assert_401(http.get("/v1/models", headers=bearer(key + "x")))
    time.sleep(2)  # Ray flushes worker logs to files in the background
    needles = [key.encode(), marker.encode()] + ([output.encode()] if marker in output else [])
    files = session_log_files(serve_app)
    assert files
    leaks = [(p.name, n) for p in files for n in needles if n in p.read_bytes()]
    assert not leaks
