"""bench/step_profile.py's reading of a profile: XLA:GPU's optimized HLO (cuBLAS calls with tuple
results, cuDNN attention), kernels named by their library inside command buffers, the GPU's busy
time, and a report made again from a kept trace (--save, then --from) with nothing but the files."""

from __future__ import annotations

import collections
import json

import pytest
from helpers import load_script

prof = load_script("step_profile", "bench")

# Lines of the optimized HLO an H100 compiled for GPT-2 124M's step (2026-11-27), shortened.
GEMM = ('  %custom-call.7 = (bf16[16384,2304]{1,0}, s8[33554432]{0}) custom-call(%bitcast.166.0, %bitcast.165.0), '
        'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
        '{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],'
        '"rhs_contracting_dimensions":["0"]}}}')
ATTENTION = ('  %dot_product_attention_fwd.5 = (bf16[16,12,1024,64]{3,1,2,0}, f32[16,12,1024]{2,1,0}, u8[256]{0}) '
             'custom-call(%bitcast.6.0, %bitcast.7.0, %bitcast.8.0), custom_call_target="__cudnn$fmhaSoftmax"')
TYPES = {"bitcast.166.0": "bf16[16384,768]{1,0}", "bitcast.165.0": "bf16[768,2304]{1,0}"}


def test_a_cublas_call_counts_its_flops_from_its_operands_and_contraction():
    flops, shapes = prof.dot_info([GEMM], TYPES)
    assert flops == 2 * 16384 * 2304 * 768
    assert shapes == "bf16[16384,768] x bf16[768,2304] (cuBLAS)"
    assert prof.result_type(GEMM) == "bf16[16384,2304]{1,0}"  # a tuple's first array: the product
    assert prof.classify(GEMM, [GEMM]) == "matmul" and prof.classify(ATTENTION, [ATTENTION]) == "attention"


def test_bytes_of_an_op_are_its_operands_and_its_results():
    assert prof.type_bytes("(bf16[16384,2304]{1,0}, s8[64]{0})") == 16384 * 2304 * 2 + 64
    assert prof.op_bytes(GEMM, TYPES) == (16384 * 2304 * 2 + 33554432) + 16384 * 768 * 2 + 768 * 2304 * 2


def test_library_kernels_are_named_by_kind():
    assert prof.kernel_kind("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x256x32") == "matmul"
    assert prof.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert prof.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert prof.kernel_kind("memcpy128") == "transpose/copy"


def test_busy_time_counts_overlapping_kernels_once():
    assert prof.union_length([(0, 10), (5, 12), (20, 25), (24, 24)]) == 17
    assert prof.union_length([]) == 0


def test_a_kernel_named_after_its_fusion_is_matched_to_the_hlo_op(capsys):
    """Inside a command buffer a fusion's kernel is named `fusion_12` for the op `fusion.12`; a
    library's kernel matches no op and is counted by its name's kind."""
    hlo = ("ENTRY %main {\n"
           "  %fusion.12 = f32[1024]{0} fusion(%p.1), kind=kLoop, calls=%fused_add\n"
           + GEMM + "\n}\n"
           "%fused_add {\n  %add.1 = f32[1024]{0} add(%a, %b)\n}\n")
    times = collections.Counter({"fusion_12": 2e6, "custom-call.7": 4e6, "nvjet_sm90_tst_128x128": 6e6})
    prof.report(times, hlo, steps=2, top=5, busy_ns=10e6, wall_ms=6.0)
    out = capsys.readouterr().out
    assert "op time 6.0 ms per step, on the GPU's streams" in out
    assert "GPU busy 5.0 ms of the 6.0 ms step (83.3%)" in out
    kinds = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
             if line.startswith("  ") and len(line.split()) > 2 and line.split()[2] == "ms"}
    assert kinds["matmul"] == pytest.approx(5.0) and kinds["elementwise"] == pytest.approx(1.0)  # 2 + 3; 1


@pytest.mark.parametrize("missing", ["profile.json", "step.hlo.txt", "trace.xplane.pb"])
def test_from_a_kept_directory_without_its_files_names_the_file(tmp_path, missing):
    for name in ("profile.json", "step.hlo.txt", "trace.xplane.pb"):
        (tmp_path / name).write_text(json.dumps({"header": "h", "steps": 1, "wall_ms": 1.0}))
    (tmp_path / missing).unlink()
    with pytest.raises(SystemExit, match=missing):
        prof.main_from(str(tmp_path), 5)
