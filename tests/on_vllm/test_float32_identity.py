"""Where the arithmetic allows, the two engines agree token for token: float32 on both sides
over the same weights (the embedded file's 4-bit values are exact float32 numbers; in bfloat16
they are not, so the bf16 comparison in test_vllm_engine.py allows near-ties), and our
proposer's drafts inside vLLM change none of them. Its own process
(float32_identity.py): a vLLM engine of a second dtype after others in one process fails inside
vLLM's Triton dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

PROMPTS = ["Extract the person: Ada Lovelace is a 36 year old mathematician living in London.",
           "Extract the person: Grace Hopper, 85, lives in New York.",
           "Extract the person: Alan Turing was 41 and lived in Manchester."]


def test_greedy_tokens_are_identical_on_both_engines_and_with_our_drafts_in_float32(vllm_usable):
    script = Path(__file__).with_name("float32_identity.py")
    run = subprocess.run([sys.executable, str(script)], input=json.dumps(PROMPTS), text=True,
                         capture_output=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    for prompt, (ours, theirs, drafted) in zip(PROMPTS, rows):
        assert ours["tokens"] and ours["tokens"] == theirs["tokens"], prompt
        # lossless: our proposer's drafts inside vLLM change no greedy token
        assert drafted["tokens"] == theirs["tokens"], prompt
        assert theirs["drafted"] == 0 < drafted["accepted"] <= drafted["drafted"], prompt
