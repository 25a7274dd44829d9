"""Test helpers shared across test folders (not a conftest: several conftest modules exist,
so ``from conftest import ...`` would be ambiguous)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The benchmark data the tests run on, in the repository (a fresh clone tests what CI tests)
TASKS_PATH = ROOT / "benchmarks" / "data" / "tasks.jsonl"
JSONSCHEMABENCH_SAMPLE = ROOT / "benchmarks" / "data" / "jsonschemabench"

# A character vocabulary: enough for small JSON objects and regexes. Id 0 is the eos token.
CHARS = ['<eos>', '{', '}', '"', ':', ',', ' ', '[', ']', 'a', 'b', 'c', 'd', 'e', 'n', 'm',
         '0', '1', '2', '3', '4', '5', '6', '7', '8', '9', '-', '.', 't', 'r', 'u', 'f',
         'l', 's', 'ab', '"a', '": ', 'xyz']


def tiny_llama(vocab_size: int = len(CHARS) + 2, seed: int = 0, layers: int = 2,
               max_positions: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen the random distribution a little so greedy paths vary
        model.lm_head.weight.mul_(8.0)
    return model


def load_tasks() -> list[dict]:
    """The project's benchmark tasks (``benchmarks/data/tasks.jsonl``), in file order."""
    return [json.loads(line) for line in TASKS_PATH.read_text().splitlines() if line.strip()]


def byte_level_bpe():
    """A tiny byte-level BPE tokenizer (the SmolLM2 / Llama-3 / Qwen family), built in memory:
    the 256 byte symbols, three merges, ``<|endoftext|>`` = 0. Encodes any text."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "a"), ('"', ":"), ("{", '"')]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    model = tokenizers.models.BPE(vocab=vocab, merges=merges)
    tk = tokenizers.Tokenizer(model)
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


def tiny_loaded_model(seed: int = 0, tok=None):
    """A LoadedModel over a tiny random Llama and :func:`byte_level_bpe` (or ``tok``, one with
    added tokens or a chat template) (fp32, CPU): the whole public API and the server run on
    it in milliseconds per token, on any prompt text."""
    from constrained_spec.model.loading import load_model

    tok = byte_level_bpe() if tok is None else tok
    model = tiny_llama(vocab_size=len(tok) + 2, seed=seed, max_positions=2048)
    for cfg in (model.config, model.generation_config):  # Llama's default eos id 2 is a byte here
        cfg.bos_token_id = cfg.eos_token_id = tok.eos_token_id
    return load_model((model, tok))


def bigram_llama(table: torch.Tensor, max_positions: int = 2048):
    """A Llama whose next-token logits depend on the last token alone: ``logits = table[last]``
    (float [V, V]). Attention and MLP write nothing (zero output projections), the embeddings
    are one-hot and the head reads the table, so loops can be built by construction."""
    from transformers import LlamaConfig, LlamaForCausalLM

    V = table.shape[0]
    hidden = 64 * ((V + 63) // 64)  # one-hot embeddings need vocab_size <= hidden_size
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(V, hidden)
        emb[torch.arange(V), torch.arange(V)] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        # rms_norm(one-hot) = sqrt(hidden) * one-hot, so head[y, x] = table[x, y] / sqrt(hidden)
        head = torch.zeros(V, hidden)
        head[:, :V] = table.T / hidden ** 0.5
        model.lm_head.weight.copy_(head)
    return model


def exact_distribution(model, compiled, params, vocab: int, prompt: list[int]) -> dict[tuple, float]:
    """P(sequence) for every complete token sequence after ``prompt``, by walking the grammar:
    grammar mask, then the repetition guard when ``params`` sets one, then temperature / top-k /
    top-p (``sampling.py``, the one definition the engine uses). Token 0 (EOS) is left out."""
    from constrained_spec.generation.sampling import apply_repetition_guard, process_logits

    out: dict[tuple, float] = {}
    words = (vocab + 31) // 32

    def walk(prefix: list[int], matcher, prob: float) -> None:
        if matcher.is_terminated() or matcher.must_stop():
            key = tuple(t for t in prefix if t != 0)
            out[key] = out.get(key, 0.0) + prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1:].float()
        mask = torch.empty((1, words), dtype=torch.int32)
        matcher.fill_bitmask(mask, 0)
        allowed = torch.tensor([(int(mask[0, t >> 5]) >> (t & 31)) & 1 for t in range(vocab)],
                               dtype=torch.bool)
        logits[0, ~allowed] = float("-inf")
        if params.guarded:
            logits = apply_repetition_guard(logits, [prefix], [len(prefix)], [params],
                                            [[bool(matcher.forced_tokens())]])
        logits = process_logits(logits, torch.tensor([params.temperature]),
                                torch.tensor([params.top_k]), torch.tensor([params.top_p]))
        probs = logits.softmax(-1)[0]
        for t in torch.nonzero(probs > 0).flatten().tolist():
            m = matcher.fork()
            assert m.accept(t)
            walk(prefix + [t], m, prob * float(probs[t]))

    walk([], compiled.new_matcher(), 1.0)
    return out


def gof(counts, exact: dict[tuple, float], n: int) -> float:
    """Chi-square goodness-of-fit p-value of sampled sequence ``counts`` against ``exact``
    (rare outcomes pooled so every expected count is >= 5)."""
    from scipy.stats import chisquare

    assert set(counts) <= set(exact), set(counts) - set(exact)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for key in sorted(exact, key=lambda k: -exact[k]):
        e = exact[key] * n
        if e >= 5:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            rest_o += counts.get(key, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue


def bigram_loaded(edges: dict[tuple[str, str], float], tok=None):
    """A LoadedModel whose logits are ``table[last token]`` over the byte-level BPE of
    `byte_level_bpe` (or ``tok``, one with added tokens or a chat template), built from
    ``edges`` {(token, next token): logit} (others -10): a model whose greedy behaviour, e.g. a
    repetition loop, is fixed by construction."""
    from constrained_spec.model.loading import load_model

    tok = byte_level_bpe() if tok is None else tok
    V = len(tok) + 2
    table = torch.full((V, V), -10.0)
    for (a, b), w in edges.items():
        table[tok.convert_tokens_to_ids(a), tok.convert_tokens_to_ids(b)] = w
    model = bigram_llama(table)
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = cfg.eos_token_id = tok.eos_token_id
    return load_model((model, tok))


def greedy_outputs(runner, compiled, prompts, spec=None, drafter=None, max_tokens: int = 30):
    """Greedy output ids of ``prompts`` (token lists) under ``compiled``, batched through an
    Engine over ``runner`` with speculation ``spec`` / ``drafter`` (None: off)."""
    from constrained_spec.config import SamplingParams
    from constrained_spec.generation.engine import Engine, Request

    eng = Engine(runner, speculative=spec, drafter=drafter)
    reqs = [Request(list(p), compiled.new_matcher(), SamplingParams(max_tokens=max_tokens), (0,))
            for p in prompts]
    eng.run(reqs)
    return [r.output_ids for r in reqs]


def greedy_tool_texts(loaded, tools, choice, parallel: bool, prompts) -> tuple[list, list, list]:
    """Greedy tool-call texts of ``prompts`` with speculation on (the default) and off, and the
    stats of the speculative run: (texts on, texts off, stats)."""
    from constrained_spec.api import Generator
    from constrained_spec.errors import IncompleteOutputError

    texts, stats = {}, []
    for spec in (None, False):
        gen: Generator[Any] = Generator(loaded, tools=tools, tool_choice=choice,
                                        parallel_tool_calls=parallel, max_tokens=120,
                                        speculative=spec, max_retries=0, system_prompt=False)
        out = gen.batch(prompts, return_result=True)
        texts[spec] = [r.partial_text if isinstance(r, IncompleteOutputError) else r.text for r in out]
        if spec is None:
            stats = [r.stats for r in out if not isinstance(r, BaseException)]
    return texts[None], texts[False], stats



def sampled_tool_values(loaded, tools, parallel: bool, n: int, max_tokens: int) -> list[tuple]:
    """``n`` sampled (temperature 1, seeds 0..n-1) required tool calls for "Weather?", run in one
    batch: (request, finalized value or error) per seed."""
    from constrained_spec.api import Generator

    gen: Generator[Any] = Generator(loaded, tools=tools, tool_choice="required",
                                    parallel_tool_calls=parallel, max_tokens=max_tokens,
                                    temperature=1.0, max_retries=0, system_prompt=False)
    reqs = [gen.make_request("Weather?", seed=s) for s in range(n)]
    gen.new_engine().run([r for r, _ in reqs])
    return [(req, gen.finalize(req, spec, return_result=False)) for req, spec in reqs]

@contextlib.contextmanager
def recording_http_server(body: bytes = b'{"type": "string"}') -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server that answers every GET with ``body`` (a JSON Schema) and records
    its path: yields ``(base_url, paths)``. A test asserts ``paths == []`` to show that a
    ``$ref`` to it was never fetched."""
    import http.server

    paths: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            paths.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="recording-http")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", paths
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def silent_listener() -> Iterator[tuple[str, list[socket.socket]]]:
    """A loopback socket that accepts connections and never answers (a host that hangs):
    yields ``(base_url, accepted)``, the connections accepted so far."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            accepted.append(conn)  # held open, never read or answered

    thread = threading.Thread(target=accept, daemon=True, name="silent-listener")
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        sock.close()


def race(target, arg_tuples, timeout: float = 30) -> list:
    """Run ``target(*args, start, results)`` in one forked process per tuple of
    ``arg_tuples``, all released at once by the ``start`` event; each puts one item on the
    ``results`` queue. Returns the items (in arrival order) after every process exited 0."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, results)) for args in arg_tuples]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0
    return [results.get(timeout=5) for _ in procs]
