"""Round trips, error bounds and footprints of the shard encodings (raw, fp8, zbf16)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccache.format.encoding import ENCODINGS, get_encoding, part_name
from speccache.format.encoding.fp8 import FP8_MAX, fp8_error
from speccache.format.encoding.zbf16 import entropy_bound_bytes, zbf16_plane_stats

# bf16 bit patterns a lossless codec must keep: NaNs with assorted payloads and
# signs, infinities, signed zeros, subnormals, extreme finite values.
SPECIAL_BF16_BITS = [
    0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD3,  # NaN
    0x7F80, 0xFF80,  # +inf, -inf
    0x0000, 0x8000,  # +0, -0
    0x0001, 0x8001, 0x007F, 0x807F, 0x0040,  # subnormals
    0x0080, 0x8080,  # smallest normals
    0x7F7F, 0xFF7F,  # max / min finite
    0x3F80, 0xBF80,  # +-1
]  # fmt: skip


def bf16_from_bits(bits: np.ndarray | list[int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, dtype=np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def bits_of(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.int64)


def hidden_states(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """LLM-like activations: Gaussian, lognormal per-channel scales, a few x50 outlier channels."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(width, generator=g) * 0.7)
    scale[torch.randperm(width, generator=g)[:4]] *= 50
    return (torch.randn(rows, width, generator=g) * scale).to(torch.bfloat16)


def roundtrip(name: str, rows: torch.Tensor, lengths: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    enc = get_encoding(name)
    offsets = offsets_of(lengths)
    parts = enc.encode(rows, offsets)
    return enc.decode(parts, offsets, 0, len(lengths), dtype or rows.dtype)


# --- registry -----------------------------------------------------------------


def test_registry_has_all_encodings() -> None:
    assert {"raw", "fp8", "zbf16"} <= set(ENCODINGS)
    for name in ("raw", "fp8", "zbf16"):
        assert get_encoding(name).name == name
    assert get_encoding("raw").lossless and get_encoding("zbf16").lossless
    assert not get_encoding("fp8").lossless
    with pytest.raises(ValueError, match="zbf16"):
        get_encoding("nope")
    assert part_name("h", "") == "h" and part_name("h", "lo") == "h.lo"


# --- raw ------------------------------------------------------------------------


def test_raw_roundtrip_and_slice() -> None:
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 2, 2)
    offsets = offsets_of([1, 3, 0, 2])
    enc = get_encoding("raw")
    parts = enc.encode(rows, offsets)
    assert set(parts) == {""}
    assert torch.equal(enc.decode(parts, offsets, 0, 4, rows.dtype), rows)
    assert torch.equal(enc.decode(parts, offsets, 1, 3, rows.dtype), rows[1:4])


# --- zbf16 ----------------------------------------------------------------------


def test_zbf16_parts_layout() -> None:
    rows = hidden_states(10, 64)
    lengths = [3, 0, 7]
    parts = get_encoding("zbf16").encode(rows, offsets_of(lengths))
    assert set(parts) == {"lo", "hi", "hi_offsets"}
    assert parts["lo"].dtype == torch.uint8 and parts["lo"].shape == (10, 64)
    assert parts["hi"].dtype == torch.uint8 and parts["hi"].ndim == 1
    assert parts["hi_offsets"].dtype == torch.int64 and parts["hi_offsets"].tolist()[0] == 0
    assert parts["hi_offsets"].shape == (4,) and int(parts["hi_offsets"][-1]) == parts["hi"].numel()
    assert all(p.is_contiguous() for p in parts.values())


def test_zbf16_special_values_exact() -> None:
    special = np.array(SPECIAL_BF16_BITS, dtype=np.uint16)
    rows = bf16_from_bits(np.tile(special, 40)).reshape(-1, len(special))
    for lengths in ([rows.shape[0]], [1, 0, 15, 24], [0, rows.shape[0], 0]):
        assert torch.equal(bits_of(roundtrip("zbf16", rows, lengths)), bits_of(rows))


def test_zbf16_special_values_inside_compressible_data() -> None:
    rows = hidden_states(64, 128)
    bits = rows.view(torch.int16).clone()
    flat = bits.view(-1)
    positions = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3))[: 4 * len(SPECIAL_BF16_BITS)]
    flat[positions] = bf16_from_bits(SPECIAL_BF16_BITS * 4).view(torch.int16)
    rows = bits.view(torch.bfloat16)
    assert torch.equal(bits_of(roundtrip("zbf16", rows, [10, 30, 24])), bits_of(rows))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    width=st.integers(0, 40),
)
def test_zbf16_roundtrip_property(data: st.DataObject, lengths: list[int], width: int) -> None:
    num = sum(lengths) * width
    pool = st.one_of(st.sampled_from(SPECIAL_BF16_BITS), st.integers(0, 0xFFFF))
    bits = data.draw(st.lists(pool, min_size=num, max_size=num))
    rows = bf16_from_bits(bits).reshape(sum(lengths), width)
    enc = get_encoding("zbf16")
    offsets = offsets_of(lengths)
    parts = enc.encode(rows, offsets)
    assert torch.equal(bits_of(enc.decode(parts, offsets, 0, len(lengths), torch.bfloat16)), bits_of(rows))
    start = data.draw(st.integers(0, len(lengths)))
    end = data.draw(st.integers(start, len(lengths)))
    got = enc.decode(parts, offsets, start, end, torch.bfloat16)
    assert torch.equal(bits_of(got), bits_of(rows[int(offsets[start]) : int(offsets[end])]))


def test_zbf16_trailing_shape_and_float_output() -> None:
    rows = hidden_states(12, 3 * 8).reshape(12, 3, 8)
    got = roundtrip("zbf16", rows, [5, 7])
    assert got.shape == rows.shape and torch.equal(bits_of(got), bits_of(rows))
    as_float = roundtrip("zbf16", rows, [5, 7], torch.float32)
    assert as_float.dtype == torch.float32 and torch.equal(as_float, rows.float())


def test_zbf16_decodes_only_requested_samples() -> None:
    rows = hidden_states(120, 256)
    lengths = [30, 20, 0, 25, 45]
    offsets = offsets_of(lengths)
    enc = get_encoding("zbf16")
    parts = enc.encode(rows, offsets)
    hi = parts["hi"].clone()
    chunk = parts["hi_offsets"].tolist()
    # Garble every chunk outside samples 1..3; decoding one of them would fail or differ.
    for i in (0, 4):
        hi[chunk[i] : chunk[i + 1]] = 0xAB
    garbled = {**parts, "hi": hi}
    got = enc.decode(garbled, offsets, 1, 4, torch.bfloat16)
    assert torch.equal(bits_of(got), bits_of(rows[30:75]))
    with pytest.raises(ValueError, match="corrupt high-byte chunk of sample 0"):
        enc.decode(garbled, offsets, 0, 1, torch.bfloat16)


def test_zbf16_empty_and_single_sample_shards() -> None:
    enc = get_encoding("zbf16")
    empty = torch.empty(0, 16, dtype=torch.bfloat16)
    for lengths in ([0], [0, 0, 0]):
        offsets = offsets_of(lengths)
        parts = enc.encode(empty, offsets)
        assert parts["hi"].numel() == 0
        got = enc.decode(parts, offsets, 0, len(lengths), torch.bfloat16)
        assert got.shape == (0, 16)
        assert enc.decode(parts, offsets, 1 if len(lengths) > 1 else 0, len(lengths), torch.bfloat16).shape == (0, 16)
    one = hidden_states(1, 16)
    assert torch.equal(bits_of(roundtrip("zbf16", one, [1])), bits_of(one))
    zeros = torch.zeros(50, 512, dtype=torch.bfloat16)
    parts = enc.encode(zeros, offsets_of([50]))
    assert parts["hi"].numel() < 200
    assert torch.equal(bits_of(enc.decode(parts, offsets_of([50]), 0, 1, torch.bfloat16)), bits_of(zeros))


def test_zbf16_incompressible_chunks_stored_raw() -> None:
    rng = np.random.default_rng(7)
    rows = bf16_from_bits(rng.integers(0, 1 << 16, size=(40, 64), dtype=np.uint16))
    lengths = [1, 13, 26]
    enc = get_encoding("zbf16")
    offsets = offsets_of(lengths)
    parts = enc.encode(rows, offsets)
    sizes = np.diff(parts["hi_offsets"].numpy())
    assert (sizes <= np.array(lengths) * 64).all()
    assert parts["hi"].numel() <= rows.numel()
    assert torch.equal(bits_of(enc.decode(parts, offsets, 0, 3, torch.bfloat16)), bits_of(rows))


def test_zbf16_compresses_hidden_states_near_entropy_bound() -> None:
    rows = hidden_states(512, 2048)
    stats = zbf16_plane_stats(rows, offsets_of([128] * 4))
    assert stats["raw"] == rows.numel() * 2 and stats["lo"] == rows.numel()
    assert stats["ratio"] >= 0.85
    assert stats["total"] == stats["lo"] + stats["hi_compressed"]
    assert stats["total"] < 0.75 * stats["raw"]


def test_zbf16_check_dtype() -> None:
    enc = get_encoding("zbf16")
    enc.check_dtype("hidden", torch.bfloat16)
    for dtype in (torch.float32, torch.float16, torch.int64):
        with pytest.raises(ValueError, match=r"'hidden'.*(raw|fp8)") as info:
            enc.check_dtype("hidden", dtype)
        assert str(dtype) in str(info.value)
    with pytest.raises(ValueError):
        enc.encode(torch.zeros(2, 2), offsets_of([2]))


def test_entropy_bound_bytes() -> None:
    assert entropy_bound_bytes(np.zeros(1000, dtype=np.uint8)) == 0.0
    assert entropy_bound_bytes(np.zeros(0, dtype=np.uint8)) == 0.0
    assert entropy_bound_bytes(np.tile(np.array([3, 9], dtype=np.uint8), 400)) == pytest.approx(100.0)
    assert entropy_bound_bytes(np.tile(np.arange(256, dtype=np.uint8), 8).reshape(8, 256)) == pytest.approx(2048.0)


# --- fp8 ------------------------------------------------------------------------


def fp8_bound(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element error bound: e4m3 keeps 3 mantissa bits, so rounding moves a normal
    value by at most half an ulp = 2**-4 of its magnitude; values in e4m3's subnormal
    range move by at most half of 2**-9 in scaled units (amax * 2**-10 / 448). The
    output cast adds its own half ulp."""
    xf = x.float().reshape(x.shape[0], -1)
    amax = xf.abs().amax(dim=1, keepdim=True)
    out_eps = torch.finfo(out_dtype).eps / 2
    bound = xf.abs() * (2.0**-4) * (1 + 2 * out_eps) + amax * (2.0**-18 + out_eps * 2.0**-4)
    return bound.reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_error_bounds(dtype: torch.dtype) -> None:
    rows = hidden_states(96, 512, seed=1).to(dtype)
    rows[5] *= 1e-3
    rows[7, :] = 0
    rows[9, :100] = 0
    got = roundtrip("fp8", rows, [40, 0, 56])
    assert got.dtype == dtype and got.shape == rows.shape
    err = (got.float() - rows.float()).abs()
    assert (err <= fp8_bound(rows, dtype)).all()
    assert torch.equal(got[7], torch.zeros_like(got[7]))
    report = fp8_error(rows, got)
    assert set(report) == {"rel_rms", "max_rel_to_row_amax"}
    assert 0.005 < report["rel_rms"] < 0.035
    assert report["max_rel_to_row_amax"] <= 2.0**-4 * 1.01


def test_fp8_parts_and_size() -> None:
    rows = hidden_states(64, 4096, seed=2)
    enc = get_encoding("fp8")
    parts = enc.encode(rows, offsets_of([64]))
    assert set(parts) == {"", "scale"}
    assert parts[""].dtype == torch.float8_e4m3fn and parts[""].shape == rows.shape
    assert parts["scale"].dtype == torch.float32 and parts["scale"].shape == (64,)
    assert float(parts[""].float().abs().amax()) == FP8_MAX
    size = sum(p.numel() * p.element_size() for p in parts.values())
    half_bf16 = rows.numel() * 2 / 2
    assert abs(size - half_bf16) <= 0.02 * half_bf16


def test_fp8_zero_rows_tiny_rows_and_slices() -> None:
    rows = torch.zeros(6, 3, 4, dtype=torch.float32)
    rows[2] = torch.linspace(-1e-40, 1e-40, 12).reshape(3, 4)  # fp32 subnormals
    rows[4] = torch.linspace(-1, 1, 12).reshape(3, 4) * 3e38
    lengths = [2, 0, 3, 1]
    enc = get_encoding("fp8")
    offsets = offsets_of(lengths)
    parts = enc.encode(rows, offsets)
    assert torch.isfinite(parts["scale"]).all() and (parts["scale"] > 0).all()
    got = enc.decode(parts, offsets, 0, 4, torch.float32)
    assert torch.equal(got[[0, 1, 3, 5]], torch.zeros(4, 3, 4))
    assert (((got - rows).abs()) <= fp8_bound(rows, torch.float32)).all()
    assert torch.equal(enc.decode(parts, offsets, 1, 3, torch.float32), got[2:5])
    assert enc.decode(parts, offsets, 1, 2, torch.float32).shape == (0, 3, 4)
    empty = torch.empty(0, 8)
    assert roundtrip("fp8", empty, [0, 0]).shape == (0, 8)
    assert fp8_error(empty, empty) == {"rel_rms": 0.0, "max_rel_to_row_amax": 0.0}


def test_fp8_rejects_non_finite() -> None:
    enc = get_encoding("fp8")
    for bad in (float("nan"), float("inf"), float("-inf")):
        rows = torch.ones(4, 8, dtype=torch.bfloat16)
        rows[2, 3] = bad
        with pytest.raises(ValueError, match="non-finite"):
            enc.encode(rows, offsets_of([4]))


def test_fp8_check_dtype() -> None:
    enc = get_encoding("fp8")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        enc.check_dtype("h", dtype)
    for dtype in (torch.int32, torch.uint8, torch.float64, torch.bool):
        with pytest.raises(ValueError, match="'h'") as info:
            enc.check_dtype("h", dtype)
        assert str(dtype) in str(info.value)


def test_fp8_error_report() -> None:
    x = torch.tensor([[1.0, -2.0], [0.0, 0.0]])
    assert fp8_error(x, x) == {"rel_rms": 0.0, "max_rel_to_row_amax": 0.0}
    y = torch.tensor([[1.0, -1.5], [0.0, 0.0]])
    report = fp8_error(x, y)
    assert report["rel_rms"] == pytest.approx(0.5 / 5**0.5)
    assert report["max_rel_to_row_amax"] == pytest.approx(0.25)
