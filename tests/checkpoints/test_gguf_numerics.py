"""GGUF numerics (engine/features/quant/gguf/numerics.py) against the `gguf` package's numpy code: the torch
dequantizers equal gguf.quants.dequantize bit for bit in float32; quantize writes bytes both decode alike."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from engine.features.quant.gguf import numerics as gn

Q = GGMLQuantizationType
# byte offsets of each block's fp16 scales (d, dmin, ...), from the block layouts in gguf.quants
SCALES = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
          Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
PACKAGE_QUANTIZES = (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _random_blocks(qtype, rows, blocks_per_row, seed=0):
    """Random bytes for rows x blocks of ``qtype`` whose fp16 scales are finite (values of every magnitude,
    subnormals and negatives included); F16/F32/BF16 bytes are random finite values."""
    g = np.random.default_rng(seed + int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        n = rows * blocks_per_row * block
        top = 10 if qtype == Q.F16 else 80  # within fp16's range / float32's
        vals = (g.standard_normal(n) * np.exp(g.uniform(-top, top, n))).astype(np.float32)
        vals[::7] = 0.0
        if qtype == Q.F16:
            raw = vals.astype(np.float16)
        elif qtype == Q.BF16:
            raw = (vals.view(np.uint32) >> 16).astype(np.uint16)
        else:
            raw = vals
        return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    raw = g.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    for off in SCALES[qtype]:
        scale = (g.standard_normal(len(raw)) * np.exp(g.uniform(-12, 6, len(raw)))).astype(np.float16)
        raw[:, off:off + 2] = scale.reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, -1)


def _reference(raw: np.ndarray, qtype) -> np.ndarray:
    return gq.dequantize(raw, qtype).astype(np.float32, copy=False)


def _bits_equal(ours: torch.Tensor, ref: np.ndarray) -> bool:
    a = ours.detach().cpu().contiguous().numpy().view(np.uint32)
    return a.shape == ref.shape and np.array_equal(a, np.ascontiguousarray(ref).view(np.uint32))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", gn.SUPPORTED, ids=lambda t: Q(t).name)
def test_dequantize_random_blocks_bit_exact(qtype, device):
    block = GGML_QUANT_SIZES[qtype][0]
    for rows, per_row in ((1, 1), (3, 5), (7, 2)):
        raw = _random_blocks(qtype, rows, per_row)
        n = per_row * block
        ref = _reference(raw, qtype).reshape(rows, n)
        ours = gn.dequantize(torch.from_numpy(raw).to(device), qtype, (rows, n))
        assert ours.dtype == torch.float32 and ours.device.type == device and ours.shape == (rows, n)
        assert _bits_equal(ours, ref), f"{Q(qtype).name}: {rows}x{n} differs from gguf"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", (Q.F16, Q.BF16), ids=lambda t: Q(t).name)
def test_half_types_every_bit_pattern(qtype, device):
    # all 65536 patterns: zeros, subnormals, infinities and NaNs (their payloads too) as gguf decodes them
    raw = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(1, -1)
    ours = gn.dequantize(torch.from_numpy(raw.copy()).to(device), qtype, (1, 65536))
    assert _bits_equal(ours, _reference(raw, qtype).reshape(1, -1))


@pytest.mark.parametrize("qtype", PACKAGE_QUANTIZES, ids=lambda t: Q(t).name)
def test_dequantize_package_written_blocks_bit_exact(qtype):
    g = np.random.default_rng(1)
    w = (g.standard_normal((6, 256 * 3)) * np.exp(g.uniform(-4, 4, (6, 1)))).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: scale 0
    raw = np.ascontiguousarray(gq.quantize(w, qtype)).view(np.uint8).reshape(6, -1)
    ours = gn.dequantize(torch.from_numpy(raw), qtype, w.shape)
    assert _bits_equal(ours, _reference(raw, qtype).reshape(w.shape))


@pytest.mark.parametrize("qtype", (Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K), ids=lambda t: Q(t).name)
def test_dequantize_shapes_dtypes_inference_mode(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    raw = torch.from_numpy(_random_blocks(qtype, 12, 4))
    full = gn.dequantize(raw, qtype, (12, 4 * block))
    # the same bytes as a 3-D tensor and as a flat byte string: same values, in the asked shape
    with torch.inference_mode():
        cube = gn.dequantize(raw.reshape(-1), qtype, (3, 4, 4 * block))
        assert torch.equal(cube.reshape(12, -1), full)
        for dtype in (torch.bfloat16, torch.float16):
            out = gn.dequantize(raw, qtype, (12, 4 * block), dtype=dtype)
            assert out.dtype == dtype and torch.equal(out, full.to(dtype))


def test_dequantize_reshaped_tensor_in_its_original_shape():
    # ComfyUI-GGUF stores a tensor whose rows are not whole blocks as rows of 256 values, with its shape in
    # metadata: the same bytes decode straight into the original shape
    raw = torch.from_numpy(_random_blocks(Q.Q4_K, 16, 1))
    as_rows = gn.dequantize(raw, Q.Q4_K, (16, 256))
    assert torch.equal(gn.dequantize(raw, Q.Q4_K, (64, 64)), as_rows.reshape(64, 64))
    assert torch.equal(gn.dequantize(raw, Q.Q4_K, (64, 16, 2, 2)), as_rows.reshape(64, 16, 2, 2))


def test_dequantize_bad_input_is_a_clear_value_error():
    raw = torch.zeros(2, gn.row_bytes(Q.Q8_0, 64), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q8_0 tensor of shape \[2, 64\] has 136 bytes, not 135"):
        gn.dequantize(raw.reshape(-1)[:-1], Q.Q8_0, (2, 64))
    with pytest.raises(ValueError, match=r"multiple of 32 values; shape \[2, 40\] has 80"):
        gn.dequantize(raw, Q.Q8_0, (2, 40))
    with pytest.raises(ValueError, match="uint8"):
        gn.dequantize(raw.float(), Q.Q8_0, (2, 64))
    with pytest.raises(ValueError, match="GGUF type IQ2_XXS is not supported; supported: f32, f16"):
        gn.dequantize(raw, Q.IQ2_XXS, (2, 64))
    with pytest.raises(ValueError, match="GGUF type 999 is not supported"):
        gn.row_bytes(999, 64)


def test_row_bytes_and_names():
    assert gn.row_bytes(Q.Q8_0, 64) == 68 and gn.row_bytes(Q.Q4_K, 512) == 288 and gn.row_bytes(Q.F32, 3) == 12
    with pytest.raises(ValueError, match="multiple of 256"):
        gn.row_bytes(Q.Q6_K, 128)
    assert gn.NAMES["q4_k"] == Q.Q4_K and gn.NAMES["bf16"] == Q.BF16
    assert set(gn.NAMES.values()) == set(gn.SUPPORTED) and len(gn.SUPPORTED) == 13


@pytest.mark.parametrize("qtype", (Q.F32,) + PACKAGE_QUANTIZES, ids=lambda t: Q(t).name)
def test_quantize_equals_package_bytes(qtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 3, 512, generator=g) * torch.logspace(-3, 2, 3).reshape(1, 3, 1)
    ours = gn.quantize(w, qtype)
    assert ours.dtype == torch.uint8 and ours.shape == (2, 3, gn.row_bytes(qtype, 512))
    ref = np.ascontiguousarray(gq.quantize(w.numpy().reshape(6, 512), qtype)).view(np.uint8).reshape(2, 3, -1)
    assert np.array_equal(ours.numpy(), ref)


def _relative_rms(qtype, w):
    raw = gn.quantize(w, qtype)
    ref = _reference(raw.numpy(), qtype).reshape(w.shape)  # decoded by gguf's numpy code
    assert _bits_equal(gn.dequantize(raw, qtype, w.shape), ref)  # ... and by ours, identically
    return float(np.sqrt(((ref - w.numpy()) ** 2).mean() / (w.numpy() ** 2).mean()))


def test_k_quants_round_trip_error_bounded_and_ordered():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 1024, generator=g) * 0.02
    err = {Q(t).name: _relative_rms(t, w) for t in K_QUANTS + (Q.Q4_0, Q.Q5_0)}
    # upper bounds: about 1.3x what these quantizers give on gaussian weights (llama.cpp's are similar)
    bounds = {"Q6_K": 0.025, "Q5_K": 0.05, "Q4_K": 0.1, "Q3_K": 0.2, "Q2_K": 0.4}
    for name, bound in bounds.items():
        assert err[name] < bound, err
    assert err["Q6_K"] < err["Q5_K"] < err["Q4_K"] < err["Q3_K"] < err["Q2_K"], err
    # a K type is no worse than the legacy type of its size
    assert err["Q4_K"] < err["Q4_0"] and err["Q5_K"] < err["Q5_0"], err


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: Q(t).name)
def test_k_quants_edge_blocks(qtype):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(5, 512, generator=g)
    w[0] = 0.0  # all zero: decodes to exact zeros
    w[1, :256] = 3.5  # constant block
    w[2, 7] = 1e3  # an outlier in a block
    w[3] = w[3].abs()  # no negative values (mins of zero)
    w[4] = -w[3]  # no positive values
    raw = gn.quantize(w, qtype)
    out = _reference(raw.numpy(), qtype).reshape(w.shape)
    assert _bits_equal(gn.dequantize(raw, qtype, w.shape), out)
    assert np.all(out[0] == 0) and np.isfinite(out).all()
    assert np.abs(out[1, :256] - 3.5).max() < 0.2
    assert abs(out[2, 7] - 1e3) < 1e3 * 0.1
    for row in (3, 4):
        assert np.sqrt(((out[row] - w[row].numpy()) ** 2).mean()) < 0.5 * w[row].norm() / np.sqrt(512)


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="multiple of 256 values, not 96"):
        gn.quantize(torch.randn(2, 96), Q.Q4_K)
    w = torch.randn(2, 256)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        gn.quantize(w, Q.Q8_0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: Q(t).name)
def test_k_quants_on_cuda_equal_cpu_decode(qtype):
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(5))
    raw = gn.quantize(w.cuda(), qtype)
    assert raw.device.type == "cuda"
    assert _bits_equal(gn.dequantize(raw, qtype, w.shape), _reference(raw.cpu().numpy(), qtype).reshape(w.shape))


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_K, Q.Q6_K), ids=lambda t: Q(t).name)
def test_quantize_under_inference_mode(qtype):
    # quant=q4_k at load runs under ComfyUI's inference mode: the same bytes as outside it
    w = torch.randn(4, 512, generator=torch.Generator().manual_seed(6))
    outside = gn.quantize(w, qtype)
    with torch.inference_mode():
        inside = gn.quantize(w, qtype)
        assert torch.equal(inside, outside)
        assert torch.equal(gn.dequantize(inside, qtype, w.shape), gn.dequantize(outside, qtype, w.shape))
