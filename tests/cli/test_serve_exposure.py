"""``constrained-spec serve`` is not exposed by accident, through the command line: ``--host
0.0.0.0`` without a key exits 2 before any model loads and names ``--allow-unauthenticated``;
an empty key (flag, variable, file) exits 2; the key reaches the server's config from the
environment or a file, from one source only; the help says ``ps`` shows ``--api-key``. Nothing
is bound (``uvicorn.run`` is a stand-in where a test gets that far)."""

from __future__ import annotations

import logging

import pytest
import uvicorn

import constrained_spec.model.loading as models
from constrained_spec.cli import main
from constrained_spec.cli.args import server_config_from_args
from constrained_spec.cli.parser import build_parser
from constrained_spec.errors import ConfigError
from constrained_spec.server.state import API_KEY_ENV

KEY = "sk-cli-" + "y" * 24


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything loads a model or binds an address."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("served"))


def key_file(tmp_path, text=KEY):
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_serve_beyond_loopback_without_a_key_exits_2_before_loading_a_model(host, no_model, capsys):
    assert main(["serve", "--host", host]) == 2
    err = capsys.readouterr().err
    assert "--allow-unauthenticated" in err and API_KEY_ENV in err and repr(host) in err


@pytest.mark.parametrize("argv, env", [(["--api-key", ""], None), (["--api-key", "  "], None),
                                       ([], ""), (["--api-key-file", "FILE"], None)])
def test_an_empty_key_exits_2_never_serving_without_authentication(argv, env, no_model, capsys,
                                                                   monkeypatch, tmp_path):
    if env is not None:
        monkeypatch.setenv(API_KEY_ENV, env)
    argv = [key_file(tmp_path, " \n") if a == "FILE" else a for a in argv]
    assert main(["serve", *argv]) == 2
    assert "the API key is empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv, env, names", [
    (["--api-key", KEY], KEY, ["--api-key", API_KEY_ENV]),
    (["--api-key", KEY, "--api-key-file", "FILE"], None, ["--api-key", "--api-key-file"]),
    (["--api-key-file", "FILE"], KEY, [API_KEY_ENV, "--api-key-file"]),
])
def test_two_sources_of_the_key_exit_2_naming_both(argv, env, names, no_model, capsys, monkeypatch,
                                                   tmp_path):
    if env is not None:
        monkeypatch.setenv(API_KEY_ENV, env)
    argv = [key_file(tmp_path) if a == "FILE" else a for a in argv]
    assert main(["serve", "--host", "0.0.0.0", *argv]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in names) and KEY not in err


def test_a_missing_key_file_exits_2_naming_it(no_model, capsys, tmp_path):
    missing = str(tmp_path / "no-such-key")
    assert main(["serve", "--api-key-file", missing]) == 2
    assert missing in capsys.readouterr().err


def config_of(*argv: str):
    return server_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_the_key_reaches_the_config_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config_of("--host", "0.0.0.0", "--api-key-file", key_file(tmp_path)).api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert config_of("--host", "0.0.0.0").api_key == KEY
    with pytest.raises(ConfigError, match="given by both"):
        config_of("--api-key", KEY)


def test_allow_unauthenticated_accepts_an_exposed_host_and_warns(monkeypatch, tmp_path, caplog,
                                                                 tiny_loaded):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config_of("--host", "0.0.0.0", "--allow-unauthenticated").allow_unauthenticated
    bound = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_loaded)
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **k: bound.append((host, port)))
    try:
        with caplog.at_level(logging.WARNING, logger="constrained_spec.server"):
            assert main(["serve", "--host", "0.0.0.0", "--port", "8124",
                         "--allow-unauthenticated"]) == 0
    finally:
        logging.captureWarnings(False)  # serve turns it on for its process
    assert bound == [("0.0.0.0", 8124)]
    assert any("0.0.0.0 port 8124" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


def test_the_help_says_ps_shows_the_flag_and_names_the_other_sources(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "`ps` shows it to every local user" in out
    assert API_KEY_ENV in out and "--api-key-file" in out and "VLLM_API_KEY" in out
    assert "--allow-unauthenticated" in out
