"""KeyGuard on its own: where keys come from, the admin rule, rotation, and key files that fail closed."""
from __future__ import annotations

import os

import pytest
from starlette.requests import Request

from deployments.auth import KeyGuard, SecurityArgs
from deployments.errors import OpenAIError


def request(key: str | None = None, scheme: str = "Bearer") -> Request:
    headers = [(b"authorization", f"{scheme} {key}".encode())] if key is not None else []
    return Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": headers})


def status(check, req: Request) -> int:
    try:
        check(req)
    except OpenAIError as exc:
        assert set(exc.body.error.model_dump()) == {"message", "type", "param", "code"}
        return exc.status
    return 200


@pytest.fixture
def files(tmp_path):
    api, admin = tmp_path / "api_keys", tmp_path / "admin_key"
    api.write_text("")
    admin.write_text("")
    return api, admin


def guard_for(api, admin, env: str = "TOKENLINE_TEST_KEYS") -> KeyGuard:
    """Files that are None are not configured."""
    return KeyGuard(SecurityArgs(api_keys_file=api and str(api), admin_key_file=admin and str(admin),
                                 api_keys_env=env, admin_key_env="TOKENLINE_TEST_ADMIN_KEY"))


def test_without_keys_everything_is_open():
    guard = guard_for(None, None)
    assert status(guard.check_api, request()) == 200
    assert status(guard.check_admin, request()) == 200


@pytest.mark.parametrize("content", ["", "\n  \n", "# no keys yet\n", b"\xff\xfe not text"],
                         ids=["empty", "blank-lines", "only-comments", "not-utf8"])
def test_configured_key_file_without_a_readable_key_closes_the_api(files, content):
    api, _ = files
    api.write_bytes(content if isinstance(content, bytes) else content.encode())
    guard = guard_for(api, None)
    for req in (request(), request("sk-anything"), request("")):
        assert status(guard.check_api, req) == 401
    assert status(guard.check_admin, request("sk-anything")) == 403  # API keys on, no admin key: closed


def test_key_file_that_is_a_folder_or_missing_at_start_closes_the_api(tmp_path):
    for path in (tmp_path, tmp_path / "not-written-yet"):
        guard = guard_for(path, None)
        assert status(guard.check_api, request()) == 401
        assert status(guard.check_api, request("sk-1")) == 401


def test_api_keys_from_a_file_and_the_environment(files, monkeypatch):
    api, _ = files
    api.write_text("# one key a line\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv("TOKENLINE_TEST_KEYS", "sk-env-1, sk-env-2")
    guard = guard_for(api, None)
    for key in ("sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2"):
        assert status(guard.check_api, request(key)) == 200, key
    for req in (request(), request("sk-file"), request("# one key a line"), request("sk-env-1", "Basic")):
        assert status(guard.check_api, req) == 401
    # API keys on and no admin key: admin endpoints are closed to every key.
    assert status(guard.check_admin, request("sk-file-1")) == 403


def test_admin_key_opens_admin_endpoints_and_the_api(files):
    api, admin = files
    api.write_text("sk-user\n")
    admin.write_text("sk-admin\n")
    guard = guard_for(api, admin)
    assert status(guard.check_admin, request("sk-admin")) == 200
    assert status(guard.check_admin, request("sk-user")) == 401
    assert status(guard.check_admin, request()) == 401
    assert status(guard.check_api, request("sk-admin")) == 200


def test_rewritten_key_file_rotates_keys(files):
    api, _ = files
    api.write_text("sk-old\n")
    guard = guard_for(api, None)
    assert status(guard.check_api, request("sk-old")) == 200
    fresh = api.with_suffix(".new")
    fresh.write_text("sk-new-and-longer\n")
    os.replace(fresh, api)
    assert status(guard.check_api, request("sk-old")) == 401
    assert status(guard.check_api, request("sk-new-and-longer")) == 200
    # A rotation that truncates the file before writing it: in between, no key opens the API.
    api.write_text("")
    assert status(guard.check_api, request("sk-new-and-longer")) == 401
    assert status(guard.check_api, request()) == 401
    api.write_text("sk-third\n")
    assert status(guard.check_api, request("sk-third")) == 200


def test_key_file_that_goes_missing_refuses_every_key(files):
    api, _ = files
    api.write_text("sk-1\n")
    guard = guard_for(api, None)
    assert status(guard.check_api, request("sk-1")) == 200
    api.unlink()
    assert status(guard.check_api, request("sk-1")) == 401
    assert status(guard.check_api, request()) == 401
    api.write_text("sk-2\n")
    assert status(guard.check_api, request("sk-2")) == 200
