"""The Triton kernels compile for a real GPU target, checked without a GPU.

The other kernel tests run the kernels in the CPU interpreter, which accepts some code the
compiler rejects (and the reverse). Here every kernel goes through the real frontend, the
MLIR passes and ptxas for an sm_90 (H100 / H200) target, in a subprocess without
TRITON_INTERPRET (the test modules set it before Triton decorates the kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from constrained_spec.kernels._backend import triton_available

COMPILE_ALL = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from constrained_spec.kernels import _triton as K

ROWS = {"vocab": "i32", "num_words": "i32", "logits_row_stride": "i32",
        "bitmask_row_stride": "i32"}
cases = [
    (K.apply_bitmask_kernel, {"logits_ptr": "*bf16", "bitmask_ptr": "*i32",
                              "indices_ptr": "*i64", **ROWS},
     {"HAS_INDICES": True, "BLOCK": 4096}),
    (K.apply_bitmask_kernel, {"logits_ptr": "*fp32", "bitmask_ptr": "*i32",
                              "indices_ptr": "*i32", **ROWS},
     {"HAS_INDICES": False, "BLOCK": 4096}),
    (K.bitmask_to_draft_vocab_kernel, {
        "bitmask_ptr": "*i32", "d2t_ptr": "*i64", "out_ptr": "*i32", "draft_vocab": "i32",
        "target_words": "i32", "draft_words": "i32", "bitmask_row_stride": "i32",
        "out_row_stride": "i32"}, {"WORDS": 32}),
    (K.apply_target_bitmask_to_draft_logits_kernel, {
        "logits_ptr": "*fp16", "bitmask_ptr": "*i32", "indices_ptr": "*i64", "d2t_ptr": "*i64",
        "vocab": "i32", "draft_vocab": "i32", "target_words": "i32",
        "logits_row_stride": "i32", "bitmask_row_stride": "i32"},
     {"HAS_INDICES": True, "BLOCK": 4096}),
    (K.rejection_row_stats_kernel, {
        "logits_ptr": "*bf16", "logits_row_stride": "i32", "row_max_ptr": "*fp32",
        "row_sum_ptr": "*fp32", "row_argmax_ptr": "*i64", "vocab": "i32"},
     {"COMPUTE_SUM": True, "BLOCK": 4096}),
]
for has_q in (True, False):
    cases.append((K.rejection_sample_kernel, {
        "logits_ptr": "*fp32", "logits_row_stride": "i32", "draft_ptr": "*i64",
        "cu_ptr": "*i64", "q_ptr": "*fp32", "q_row_stride": "i32", "greedy_ptr": "*i32",
        "uniform_ptr": "*fp32", "noise_ptr": "*fp32", "noise_row_stride": "i32",
        "row_max_ptr": "*fp32", "row_sum_ptr": "*fp32", "row_argmax_ptr": "*i64",
        "out_ptr": "*i64", "out_row_stride": "i32", "num_accepted_ptr": "*i64",
        "recovered_ptr": "*i64", "bonus_ptr": "*i64", "vocab": "i32"},
        {"HAS_Q": has_q, "NOISE_PER_REQUEST": not has_q, "BLOCK": 4096}))
for kernel, signature, constants in cases:
    signature = {**signature, **{name: "constexpr" for name in constants}}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert compiled.asm["cubin"], kernel.__name__
'''


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernels_compile_for_a_cuda_sm90_target_without_a_gpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", COMPILE_ALL], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
