"""Attention whose result for a query does not depend on what else is in the call.

An exact runner (``runner.LeanRunner`` with ``exact``) needs a verify row's attention to have
the bits a 1-row decode of the same token at the same position gets, whatever the other rows
of the forward, the other requests of the batch, their lengths or the padding. SDPA's CPU
kernel does not promise that: it hands a block of queries to one GEMM whose shape is the number
of queries, and the keys to GEMMs whose shape is the keys' count modulo its key split, and
oneDNN's reductions change with those shapes (measured: a query among several differs from the
same query alone at some key counts, and a query over more masked keys from the same query
without them; benchmarks/RESULTS.md, "Exactness by default: why SDPA could not give it, what
replaced it, what it costs").

So every call here has ONE shape, whatever the forward: the queries go in groups of exactly
`QUERY_GROUP` (padded), with the ``G = H / KV`` heads that share a kv head as rows of the same
call (``G * QUERY_GROUP`` rows per kv head); the keys go in chunks of exactly `KEY_CHUNK`
positions from the first key read, each (group, chunk) one batch entry of torch's CPU flash
attention kernel, which returns each row's output and log-sum-exp. Within one shape the
kernel's result for a row depends on nothing but that row's query, mask and the chunk's keys
and values (the rows and batch entries are computed independently; tested). The chunks are
then combined per row with weights ``softmax(lse)`` over the chunks, in chunk order: a chunk
the row cannot see gets weight exactly 0 and adds exactly 0, so more masked chunks (a longer
request in the batch, a verify forward reaching one more chunk) change nothing. The combine's
``softmax`` runs on rows padded to a multiple of 64, so every element takes the vectorized
``exp`` (torch's scalar tail loop computes ``exp`` with other bits).

tests/kernels/test_row_invariance.py checks the property; what it costs against one SDPA call,
per layer and in the model: benchmarks/RESULTS.md, the same section and "Exact runner: its
cost with query-invariant chunked attention".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# queries per attention unit: a forward's rows (1 for a decode, 1 + drafts for a verify) are
# padded to a multiple of it
QUERY_GROUP = 8
# keys per attention unit; the keys an exact forward reads are a whole number of chunks (the
# first key read is a multiple of it too: runner.WINDOW_KEY_BLOCK)
KEY_CHUNK = 256
# the combine's softmax runs over rows padded to a multiple of this (a multiple of every CPU's
# float vector width: no element in a scalar tail loop)
_LANES = 64

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class ChunkedMask:
    """One forward's mask in the shape `chunked_attention` calls the kernel with, built once
    per forward (and per window size) and shared by every layer."""

    groups: int  # NQ = ceil(T / QUERY_GROUP)
    chunks: int  # nC = keys / KEY_CHUNK
    heads_per_kv: int  # G
    additive: torch.Tensor  # [B * NQ * nC, 1, G * QUERY_GROUP, KEY_CHUNK]: 0 visible, -inf not
    # [nC, N padded to _LANES]: 0 where a row sees some key of the chunk, -inf where it sees
    # none (the kernel reports such a row with lse 0, not -inf); None with one chunk
    chunk_visible: torch.Tensor | None


def chunk_mask(visible: torch.Tensor, *, heads: int, kv_heads: int, dtype: torch.dtype) -> ChunkedMask:
    """``visible`` [B, T, S] (bool: query row t of batch entry b sees key s; S a multiple of
    `KEY_CHUNK`) -> the forward's `ChunkedMask` for attention in ``dtype``."""
    B, T, S = visible.shape
    if S % KEY_CHUNK:
        raise ValueError(f"exact attention reads whole chunks of {KEY_CHUNK} keys, not {S}")
    G, Q0, C = heads // kv_heads, QUERY_GROUP, KEY_CHUNK
    NQ, nC = -(-T // Q0), S // C
    if NQ * Q0 != T:  # padding rows see what the last row sees (no fully masked row: no NaN)
        visible = torch.cat([visible, visible[:, -1:].expand(B, NQ * Q0 - T, S)], dim=1)
    vis = visible.view(B, NQ, Q0, nC, C).permute(0, 1, 3, 2, 4)  # [B, NQ, nC, Q0, C]
    additive = torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, float("-inf"))
    additive = additive[:, :, :, None].expand(B, NQ, nC, G, Q0, C).reshape(B * NQ * nC, 1, G * Q0, C)
    chunk_visible = None
    if nC > 1:
        seen = vis.any(-1).permute(2, 0, 1, 3)  # [nC, B, NQ, Q0]
        cv = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
        cv = cv[:, :, :, None, None].expand(nC, B, NQ, kv_heads, G, Q0).reshape(nC, -1)
        chunk_visible = F.pad(cv, (0, -cv.shape[1] % _LANES))
    return ChunkedMask(groups=NQ, chunks=nC, heads_per_kv=G, additive=additive,
                       chunk_visible=chunk_visible)


def chunked_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: ChunkedMask,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of q [B, T, H, hd] over keys / vals [B, S, KV, hd] (the keys ``mask`` was
    built for) -> [B, T, H * hd], each row's bits independent of the call (module docstring)."""
    B, T, H, hd = q.shape
    KV = keys.shape[2]
    G, NQ, nC, Q0, C = mask.heads_per_kv, mask.groups, mask.chunks, QUERY_GROUP, KEY_CHUNK
    Tp = NQ * Q0
    if Tp != T:
        q = F.pad(q, (0, 0, 0, 0, 0, Tp - T))
    qg = q.view(B * NQ, Q0, KV, G, hd).permute(0, 2, 3, 1, 4)  # [B * NQ, KV, G, Q0, hd]
    if nC > 1:
        qg = qg[:, None].expand(B * NQ, nC, KV, G, Q0, hd)
    qg = qg.reshape(B * NQ * nC, KV, G * Q0, hd)
    kc = keys.reshape(B, 1, nC, C, KV, hd).permute(0, 1, 2, 4, 3, 5)  # [B, 1, nC, KV, C, hd]
    vc = vals.reshape(B, 1, nC, C, KV, hd).permute(0, 1, 2, 4, 3, 5)
    if NQ > 1:
        kc, vc = kc.expand(B, NQ, nC, KV, C, hd), vc.expand(B, NQ, nC, KV, C, hd)
    kc, vc = kc.reshape(B * NQ * nC, KV, C, hd), vc.reshape(B * NQ * nC, KV, C, hd)
    out, lse = _flash(qg, kc, vc, attn_mask=mask.additive, scale=scale)  # [.., KV, G * Q0, hd], [.., KV, G * Q0]
    if nC > 1:
        cv = mask.chunk_visible
        assert cv is not None
        N = B * NQ * KV * G * Q0
        lse = lse.reshape(B * NQ, nC, KV * G * Q0).transpose(0, 1).reshape(nC, N)
        w = (F.pad(lse, (0, cv.shape[1] - N)) + cv).softmax(dim=0)[:, :N]  # [nC, N]
        parts = out.view(B * NQ, nC, KV, G * Q0, hd).transpose(0, 1)  # [nC, B * NQ, KV, G * Q0, hd]
        out = (parts * w.view(nC, B * NQ, KV, G * Q0, 1)).sum(0).to(q.dtype)  # chunk by chunk
    out = out.view(B, NQ, KV, G, Q0, hd).permute(0, 1, 4, 2, 3, 5).reshape(B, Tp, H * hd)
    return out[:, :T] if Tp != T else out
