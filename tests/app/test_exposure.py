"""The server is not exposed by accident, written as the attacks: an address beyond loopback
without a key refuses to start (before any model loads), an empty key never turns
authentication off, the key comes from exactly one source (flag, environment, file), and a
wrong, missing, doubled or non-ASCII ``Authorization`` header is a 401 in OpenAI's envelope on
every route but ``/health``, never a 500. In this process, on the tiny Llama (milliseconds)."""

from __future__ import annotations

import logging
import os
import secrets

import pytest
import uvicorn
from fastapi.testclient import TestClient

import constrained_spec.model.loading as models
from constrained_spec.errors import ConfigError
from constrained_spec.server import create_app, serve
from constrained_spec.server.app import Guard
from constrained_spec.server.state import (
    API_KEY_ENV,
    ServerConfig,
    check_api_key,
    check_bind,
    check_exposure,
    is_loopback,
    resolve_api_key,
)

KEY = "sk-test-" + "x" * 24

EXPOSED = ["0.0.0.0", "::", "192.168.1.10", "10.0.0.7", "8.8.8.8", "fe80::1%eth0",
           "::ffff:192.168.0.1", "example.com", "my-laptop", "localhost.", "127.1", "",
           "127.0.0.1 ", " ::1"]
LOOPBACK = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost",
            "::ffff:127.0.0.1"]


@pytest.mark.parametrize("host", EXPOSED)
def test_an_address_beyond_loopback_without_a_key_is_refused_naming_both_ways_out(host):
    assert not is_loopback(host)
    with pytest.raises(ConfigError) as info:
        check_exposure(host, ServerConfig())
    message = str(info.value)
    assert info.value.option == "host" and repr(host) in message
    assert "--allow-unauthenticated" in message and API_KEY_ENV in message
    assert "--api-key-file" in message


@pytest.mark.parametrize("host", LOOPBACK)
def test_a_loopback_address_needs_no_key(host):
    assert is_loopback(host)
    assert check_exposure(host, ServerConfig()) is False


@pytest.mark.parametrize("host,port,option", [
    ("127.0.0.1", 99999, "port"), ("127.0.0.1", -1, "port"), ("127.0.0.1 ", 0, "host"),
    ("127.0.0.1\t", 0, "host"), ("", 0, "host"), ("no-such-host.invalid", 0, "host"),
])
def test_an_address_the_server_could_not_listen_on_is_refused_before_loading(host, port, option):
    with pytest.raises(ConfigError) as info:
        check_bind(host, port)
    assert info.value.option == option


def test_a_port_in_use_is_refused_and_a_free_one_passes():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="in use") as info:
            check_bind("127.0.0.1", port)
        assert info.value.option == "port"
    check_bind("127.0.0.1", 0)
    check_bind("localhost", 0)


def test_allow_unauthenticated_accepts_an_exposed_address_on_purpose_and_a_key_accepts_it_anyway():
    assert check_exposure("0.0.0.0", ServerConfig(allow_unauthenticated=True)) is True
    assert check_exposure("0.0.0.0", ServerConfig(api_key=KEY)) is False
    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        ServerConfig(allow_unauthenticated="yes")


def test_serve_refuses_an_exposed_address_before_loading_the_model(monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("served"))
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        serve(None, ServerConfig(), host="0.0.0.0", port=8123)


def test_serve_on_purpose_without_a_key_warns_naming_the_address(monkeypatch, caplog, tiny_loaded):
    bound = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_loaded)
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **k: bound.append((host, port)))
    try:
        with caplog.at_level(logging.WARNING, logger="constrained_spec.server"):
            assert serve(None, ServerConfig(allow_unauthenticated=True), host="0.0.0.0",
                         port=8123) == 0
    finally:
        logging.captureWarnings(False)  # serve turns it on for its process
    assert bound == [("0.0.0.0", 8123)]  # handed to uvicorn (here a stand-in: nothing bound)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("0.0.0.0 port 8123" in m and "WITHOUT an API key" in m for m in warned), warned


@pytest.mark.parametrize("key", ["", " ", "\t\n"])
def test_an_empty_key_is_a_config_error_never_authentication_off(key, tmp_path):
    for make in (lambda: ServerConfig(api_key=key),
                 lambda: resolve_api_key(flag=key, environ={}),
                 lambda: resolve_api_key(environ={API_KEY_ENV: key})):
        with pytest.raises(ConfigError, match="empty"):
            make()
    path = tmp_path / "key"
    path.write_text(key + "\n" + KEY)  # the first line is the key: an empty one is refused
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="empty") as info:
        resolve_api_key(file=str(path), environ={})
    assert info.value.option == "--api-key-file"


@pytest.mark.parametrize("key", ["two words", "ключ", "k\x00ey", "sk\r\nX-Injected: 1"])
def test_a_key_no_header_can_carry_is_refused_without_echoing_it(key):
    with pytest.raises(ConfigError) as info:
        check_api_key(key, "--api-key")
    assert key not in str(info.value) and "printable ASCII" in str(info.value)


def test_the_key_is_kept_out_of_the_config_repr():
    assert KEY not in repr(ServerConfig(api_key=KEY))


@pytest.mark.parametrize("flag, env, use_file", [(KEY, KEY, False), (KEY, None, True),
                                                (None, KEY, True), (KEY, KEY, True)])
def test_two_sources_of_the_key_are_refused_naming_them(flag, env, use_file, tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY)
    path.chmod(0o600)
    environ = {} if env is None else {API_KEY_ENV: env}
    with pytest.raises(ConfigError, match="give it one way only") as info:
        resolve_api_key(flag=flag, file=str(path) if use_file else None, environ=environ)
    named = [n for n, given in (("--api-key", flag), (API_KEY_ENV, env),
                                ("--api-key-file", use_file or None)) if given is not None]
    assert all(n in str(info.value) for n in named)


def test_the_key_file_gives_its_first_line_stripped(tmp_path, caplog):
    path = tmp_path / "key"
    path.write_text(f"  {KEY}  \nsecond line ignored\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert resolve_api_key(file=str(path), environ={}) == KEY
    assert not caplog.records  # owner-only: nothing to warn about


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o622])
def test_a_key_file_others_may_read_or_write_warns_naming_it(mode, tmp_path, caplog):
    path = tmp_path / "key"
    path.write_text(KEY)
    path.chmod(mode)
    with caplog.at_level(logging.WARNING):
        assert resolve_api_key(file=str(path), environ={}) == KEY
    assert any(str(path) in r.getMessage() and "chmod 600" in r.getMessage()
               for r in caplog.records)


def test_a_missing_unreadable_or_binary_key_file_is_a_config_error_naming_it(tmp_path):
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00key\n")
    huge = tmp_path / "huge"
    huge.write_bytes(b"k" * 100_000)
    for path, words in ((tmp_path / "missing", "No such file"), (tmp_path, "cannot read"),
                        (binary, "not UTF-8"), (huge, "longer than")):
        with pytest.raises(ConfigError, match=words) as info:
            resolve_api_key(file=str(path), environ={})
        assert info.value.option == "--api-key-file" and str(path) in str(info.value)


# ---- the key on the wire: the app over the tiny Llama, in a TestClient ----

@pytest.fixture(scope="module")
def keyed_client(tiny_loaded, tmp_path_factory):
    """The app with a key read from a file (metrics on)."""
    path = tmp_path_factory.mktemp("key") / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    config = ServerConfig(model_name="tiny", api_key=resolve_api_key(file=str(path), environ={}),
                          enable_metrics=True, max_tokens=4)
    with TestClient(create_app(tiny_loaded, config)) as client:
        yield client


def bearer(value: str | bytes) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", value if isinstance(value, bytes) else value.encode())]


def assert_401(response):
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers["www-authenticate"] == "Bearer"


def test_a_key_from_the_environment_authenticates(tiny_loaded):
    key = resolve_api_key(environ={API_KEY_ENV: KEY})
    with TestClient(create_app(tiny_loaded, ServerConfig(model_name="tiny", api_key=key))) as c:
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert_401(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}))


def test_a_key_from_a_file_authenticates_on_every_route_but_health(keyed_client):
    ok = {"Authorization": f"Bearer {KEY}"}
    assert keyed_client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "tiny"
    assert keyed_client.get("/metrics", headers=ok).status_code == 200
    assert keyed_client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert keyed_client.get("/health").status_code == 200  # the liveness probe stays open
    for path in ("/v1/models", "/metrics", "/no-such-route"):  # no key: nothing else answers
        assert_401(keyed_client.get(path))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert_401(keyed_client.post("/v1/chat/completions", json=body))
    assert keyed_client.post("/v1/chat/completions", json=body, headers=ok).status_code == 200


@pytest.mark.parametrize("value", [
    "Bearer wrong", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, f"Basic {KEY}", "Bearer",
    "Bearer ", "", f"Token {KEY}",
    "Bearer ключ".encode(), b"Bearer \xff\xfe\x80", "Bearer café".encode("latin-1"),
    f"Bearer {KEY}".encode() + b"\xc3",
])
def test_a_wrong_malformed_or_non_ascii_authorization_is_401_never_500(keyed_client, value):
    assert_401(keyed_client.get("/v1/models", headers=bearer(value)))


def test_two_authorization_headers_are_401_even_if_one_is_right(keyed_client):
    headers = [*bearer(f"Bearer {KEY}"), *bearer("Bearer wrong")]
    assert_401(keyed_client.get("/v1/models", headers=headers))
    assert_401(keyed_client.get("/v1/models", headers=list(reversed(headers))))


def test_the_key_is_compared_as_equal_length_digests_whatever_is_sent(monkeypatch):
    compared = []
    real = secrets.compare_digest

    def recording(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(secrets, "compare_digest", recording)
    for sent in (b"Bearer ", b"Bearer k", b"Bearer " + KEY.encode(), b"Bearer " + b"k" * 5000):
        Guard.authorized([sent], KEY)
    assert compared == [(32, 32)] * 4  # the time taken cannot tell the key's length either
    assert Guard.authorized([b"Bearer " + KEY.encode()], KEY)


def test_without_a_key_every_route_stays_open_on_loopback(tiny_loaded):
    with TestClient(create_app(tiny_loaded, ServerConfig(model_name="tiny"))) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers=bearer(b"Bearer \xff")).status_code == 200
