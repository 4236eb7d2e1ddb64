"""``speccache.devices.fast_compute_dtype``: bf16 only where the hardware multiplies bf16 natively (the demo and
``make acceptance`` ask it; on an AVX2-only CPU bf16 ran a real target 5.5x slower than fp32)."""

from __future__ import annotations

import pytest
import torch

from speccache.devices import fast_compute_dtype

AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"


@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        (AVX2, "fp32"),  # AMD EPYC of the CI machine: no bf16 instructions
        (AVX2.replace("avx2", "avx2 avx512f avx512bw"), "fp32"),  # AVX-512 without its BF16 extension
        (AVX2.replace("avx2", "avx2 avx512f avx512_bf16"), "bf16"),
        (AVX2.replace("avx2", "avx2 amx_bf16 amx_tile"), "bf16"),
        ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", "bf16"),  # an Arm server (Neoverse V1)
        ("processor\t: 0\nFeatures\t: fp asimd\n", "fp32"),
    ],
)
def test_bf16_is_chosen_only_where_the_cpu_computes_it(tmp_path, cpuinfo, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo, encoding="utf-8")
    assert fast_compute_dtype(torch.device("cpu"), str(path)) == expected


def test_unknown_cpu_gets_fp32_and_a_gpu_bf16(tmp_path):
    assert fast_compute_dtype(torch.device("cpu"), str(tmp_path / "missing")) == "fp32"
    assert fast_compute_dtype(torch.device("cuda", 0)) == "bf16"


def test_a_flag_named_in_a_model_name_does_not_count(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: bf16 amx_bf16 Engineering Sample\nflags\t\t: avx2\n", encoding="utf-8")
    assert fast_compute_dtype(torch.device("cpu"), str(path)) == "fp32"
