"""TokenizerData: raw-string vocabularies for tests and Hugging Face tokenizers."""

from __future__ import annotations

import pytest
from cs_testlib import byte_level_bpe

from constrained_spec.grammar import TokenizerData, compile_spec
from constrained_spec.schemas import JsonLayout, normalize_schema


def test_from_tokens_basics_and_padding():
    tok = TokenizerData.from_tokens(["<eos>", "a", "b"], 0, vocab_size=40)
    assert tok.vocab_size == 40 and tok.eos_token_ids == (0,)
    assert tok.decoded[1] == b"a" and tok.decoded[39] == b""
    assert tok.text_tokens() == {b"a": [1], b"b": [2]}


def test_key_is_stable_and_content_addressed():
    a = TokenizerData.from_tokens(["<eos>", "a", "b"], 0)
    b = TokenizerData.from_tokens(["<eos>", "a", "b"], 0)
    assert a.key == b.key and a == b and hash(a) == hash(b)
    assert a.key != TokenizerData.from_tokens(["<eos>", "a", "c"], 0).key
    assert a.key != TokenizerData.from_tokens(["<eos>", "a", "b"], 0, vocab_size=8).key


def test_from_tokens_rejects_bad_arguments():
    with pytest.raises(ValueError):
        TokenizerData.from_tokens(["<eos>", "a"], 5)
    with pytest.raises(ValueError):
        TokenizerData.from_tokens(["<eos>", "a"], 0, vocab_size=1)


def test_from_hf_byte_level_bpe_decodes_bytes_for_both_backends():
    hf = byte_level_bpe()
    tok = TokenizerData.from_hf(hf, vocab_size=len(hf) + 5)
    assert tok.eos_token_ids == (0,) and tok.vocab_size == len(hf) + 5
    assert tok.decoded[hf.convert_tokens_to_ids("Ġa")] == b" a"
    spec = normalize_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                            layout=JsonLayout())
    text = '{"a": "é ok"}'
    for backend in ("xgrammar", "outlines"):
        m = compile_spec(spec, tok, backend=backend).new_matcher()
        for t in hf.encode(text, add_special_tokens=False):
            assert m.accept(t), (backend, hf.convert_ids_to_tokens(t))
        assert m.is_completed() and m.accept(0)
