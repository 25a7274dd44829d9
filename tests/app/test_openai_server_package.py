"""The server as part of the package, in this process on the tiny Llama.

- one Generator and one drafter serve requests of every schema mode (the drafter is built
  once, and is the engine loop's);
- ``max_retries`` follows the library's one retry policy: a choice that ended for a reason
  the library does not know is a failed attempt and runs again (by default too);
- ``constrained-spec serve`` takes the flags the former example script took, refuses bad
  limits before loading a model, and without the ``app`` extra names it.
"""

from __future__ import annotations

import importlib
import sys

import httpx
import pytest
from openai_server_process import serve_tiny

import constrained_spec.api as api
from constrained_spec import ConfigError
from constrained_spec.cli import main
from constrained_spec.cli.parser import build_parser
from constrained_spec.config import SpeculativeConfig

MODEL = "tiny"
COLOURS = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["red", "green"]},
                                                   "strict": True}}


def post(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Pick a colour."}], **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_requests_of_every_schema_mode_share_one_generator_and_one_drafter(tiny_loaded,
                                                                           monkeypatch):
    built = []
    real = api.make_drafter
    monkeypatch.setattr(api, "make_drafter", lambda c, m: built.append(c) or real(c, m))
    # a config no other test uses: the tiny model's drafter cache lives for the session
    speculative = SpeculativeConfig(method="ngram", prompt_lookup_max=7, prompt_lookup_min=3)
    with serve_tiny(tiny_loaded, MODEL, speculative=speculative) as (server, url):
        lenient = {"type": "json_schema", "json_schema": {
            "name": "c", "schema": {"enum": ["red", "green"]}, "strict": False}}
        for response_format in (None, COLOURS, lenient, {"type": "json_object"}):
            r = post(url, response_format=response_format)
            assert r.status_code == 200, r.text
        assert server.loop.engine.drafter is server.generator.drafter is not None
    assert built == [speculative]


def test_a_choice_that_ended_for_an_unknown_reason_is_retried(tiny_loaded, monkeypatch):
    with serve_tiny(tiny_loaded, MODEL) as (server, url):
        real = server.generator.finalize
        reasons = []

        def first_attempt_loops(req, spec, return_result=True):
            # as if the engine had ended the first attempt with a finish reason added later
            if not reasons:
                req.finish_reason = "loop"
            reasons.append(req.finish_reason)
            return real(req, spec, return_result)

        monkeypatch.setattr(server.generator, "finalize", first_attempt_loops)
        r = post(url, response_format=COLOURS, max_retries=1)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["choices"][0]["message"]["content"] in ('"red"', '"green"')
        assert reasons == ["loop", "stop"]
        reasons.clear()
        r = post(url, response_format=COLOURS, max_retries=0)  # the incomplete output is returned
        assert r.json()["choices"][0]["finish_reason"] == "length"  # OpenAI's word for a cut output
        reasons.clear()
        r = post(url, response_format=COLOURS)  # retried by default
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert reasons == ["loop", "stop"] and server.retries == 2


def test_serve_takes_the_flags_of_the_former_example_script():
    flags = {"--model", "--served-model-name", "--speculative-config", "--speculative-algorithm",
             "--speculative-num-draft-tokens", "--speculative-draft-model", "--no-speculation",
             "--backend", "--host", "--port", "--api-key", "--api-key-file",
             "--allow-unauthenticated", "--max-batch-size", "--max-queue",
             "--max-request-bytes", "--max-tokens", "--enable-metrics", "--log-level",
             "--engine", "--tensor-parallel-size", "--pipeline-parallel-size",
             "--distributed-executor-backend", "--vllm-arg"}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert {s for a in serve._actions for s in a.option_strings} - {"-h", "--help"} == flags
    args = build_parser().parse_args(["serve", "--port", "9", "--no-speculation"])
    assert (args.host, args.port, args.max_batch_size, args.max_queue) == ("127.0.0.1", 9, 8, 64)


@pytest.mark.parametrize("flag, value", [("--max-batch-size", "0"), ("--max-queue", "-1"),
                                         ("--max-request-bytes", "0")])
def test_serve_refuses_bad_limits_before_loading_a_model(flag, value, capsys, monkeypatch):
    import constrained_spec.model.loading as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["serve", flag, value]) == 2
    assert flag.lstrip("-").replace("-", "_") in capsys.readouterr().err


def test_without_the_app_extra_the_server_names_the_extra_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # "import fastapi" raises ImportError
    for name in [m for m in sys.modules if m.startswith("constrained_spec.server")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install constrained_spec\[app\]") as info:
        importlib.import_module("constrained_spec.server")
    assert isinstance(info.value, ConfigError)
    assert main(["serve"]) == 2
    assert "pip install constrained_spec[app]" in capsys.readouterr().err
