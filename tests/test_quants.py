"""Dequantization of every storage type against straightforward per-block reference code
(written from the GGML block layouts), and the Q4_K -> int4 kernel mapping."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from mtpllm.gguf.quants import dequantize, SUPPORTED_TYPES
from mtpllm.gguf.writer import quantize, random_kquant
from mtpllm.runtime.linear import Linear, q4k_to_int4


def f16(b):
    return float(np.frombuffer(bytes(b), dtype=np.float16)[0])


def ref_q8_0(block):  # d f16, 32 x int8
    d = f16(block[0:2])
    return [d * int(np.int8(x)) for x in block[2:34]]


def ref_q5_0(block):  # d f16, qh 4 bytes (bit 5 of each weight), qs 16 bytes
    d = f16(block[0:2])
    qh = int.from_bytes(bytes(block[2:6]), "little")
    out = [0.0] * 32
    for j in range(16):
        lo = int(block[6 + j]) & 0x0F
        hi = int(block[6 + j]) >> 4
        out[j] = d * ((lo | (((qh >> j) & 1) << 4)) - 16)
        out[j + 16] = d * ((hi | (((qh >> (j + 16)) & 1) << 4)) - 16)
    return out


def _scale_min_k4(j, s):
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def ref_q4_k(block):  # d, dmin f16; 12 bytes scales; 128 bytes qs
    d, dmin = f16(block[0:2]), f16(block[2:4])
    s = [int(x) for x in block[4:16]]
    q = block[16:144]
    out = []
    for chunk in range(4):  # 64 weights per chunk: low nibbles then high nibbles
        sc1, m1 = _scale_min_k4(2 * chunk, s)
        sc2, m2 = _scale_min_k4(2 * chunk + 1, s)
        qs = q[32 * chunk:32 * chunk + 32]
        out += [d * sc1 * (int(b) & 0xF) - dmin * m1 for b in qs]
        out += [d * sc2 * (int(b) >> 4) - dmin * m2 for b in qs]
    return out


def ref_q6_k(block):  # ql 128, qh 64, scales 16 (int8), d f16
    ql, qh = block[0:128], block[128:192]
    sc = [int(np.int8(x)) for x in block[192:208]]
    d = f16(block[208:210])
    out = [0.0] * 256
    for half in range(2):
        for l in range(32):
            is_ = l // 16
            base_l, base_h, base_s = 64 * half, 32 * half, 8 * half
            q1 = ((int(ql[base_l + l]) & 0xF) | (((int(qh[base_h + l]) >> 0) & 3) << 4)) - 32
            q2 = ((int(ql[base_l + l + 32]) & 0xF) | (((int(qh[base_h + l]) >> 2) & 3) << 4)) - 32
            q3 = ((int(ql[base_l + l]) >> 4) | (((int(qh[base_h + l]) >> 4) & 3) << 4)) - 32
            q4 = ((int(ql[base_l + l + 32]) >> 4) | (((int(qh[base_h + l]) >> 6) & 3) << 4)) - 32
            o = 128 * half
            out[o + l] = d * sc[base_s + is_] * q1
            out[o + l + 32] = d * sc[base_s + is_ + 2] * q2
            out[o + l + 64] = d * sc[base_s + is_ + 4] * q3
            out[o + l + 96] = d * sc[base_s + is_ + 6] * q4
    return out


REFS = {QT.Q8_0: (ref_q8_0, 34), QT.Q5_0: (ref_q5_0, 22), QT.Q4_K: (ref_q4_k, 144), QT.Q6_K: (ref_q6_k, 210)}


@pytest.mark.parametrize("qtype", list(REFS))
def test_block_types_match_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    shape = (4, 512)
    if qtype in (QT.Q4_K, QT.Q6_K):
        raw = random_kquant(shape, qtype, rng, 0.1)
    else:
        raw = quantize(rng.normal(0, 1, size=shape).astype(np.float32), qtype)
    ref_fn, bsize = REFS[qtype]
    ref = np.array([v for row in raw for b in range(0, row.shape[0], bsize) for v in ref_fn(row[b:b + bsize])],
                   dtype=np.float32).reshape(shape)
    got = dequantize(raw, qtype, shape).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16])
def test_float_types(qtype):
    x = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    got = dequantize(quantize(x, qtype), qtype, x.shape).numpy()
    tol = {QT.F32: 0, QT.F16: 1e-3, QT.BF16: 1e-2}[qtype]
    np.testing.assert_allclose(got, x, rtol=tol, atol=tol)


def test_real_file_types_supported():
    for t in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K):
        assert t in SUPPORTED_TYPES


def test_q4k_int4_mapping_is_exact_up_to_bf16_scales():
    """Q4_K -> group-32 int4: the integer codes are identical; scale and zero are rounded to bf16
    (relative error <= 2^-8 each), so weights agree to within ~1% of the group's scale*15 range."""
    rng = np.random.default_rng(0)
    n, k = 64, 512
    raw = random_kquant((n, k), QT.Q4_K, rng, 0.1)
    ref = dequantize(raw, QT.Q4_K, (n, k))
    q, sz = q4k_to_int4(raw, n, k)
    assert q.min() >= 0 and q.max() <= 15
    scale = sz[..., 0].float().t().repeat_interleave(32, 1)
    zero = sz[..., 1].float().t().repeat_interleave(32, 1)
    w = (q.float() - 8) * scale + zero
    group_range = scale.abs() * 16 + zero.abs()
    assert ((w - ref).abs() <= 2 ** -7 * group_range + 1e-8).all()
    # and the packed kernel computes x @ w^T with that weight (bf16 activations)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    lin = Linear("int4", packed, None, sz, out_features=n, in_features=k)
    x = torch.randn(3, k)
    y_ref = x.bfloat16().float() @ w.t()
    torch.testing.assert_close(lin(x), y_ref, rtol=2e-2, atol=2e-2 * float(y_ref.abs().max()))


def test_int8_rows_track_the_dequantized_weight():
    """int8 with one scale per row: each weight within half a step (max|row|/127/2, plus the bf16
    rounding of the scale, relative 2^-8) of the float weight; the kernel matches x @ w^T for
    bf16 activations; prompt-sized inputs take the fp32 GEMM with the same weights."""
    from mtpllm.runtime.linear import GEMM_MIN_ROWS, int8_linear
    rng = np.random.default_rng(1)
    raw = quantize(rng.normal(0, 0.05, size=(96, 256)).astype(np.float32), QT.Q5_0)
    w = dequantize(raw, QT.Q5_0, (96, 256))
    lin = int8_linear(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((lin.dequantized() - w).abs() <= step * (0.5 + 2 ** -7)).all()
    x = torch.randn(3, 256)
    ref = x.bfloat16().float() @ lin.dequantized().t()
    torch.testing.assert_close(lin(x), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    xb = torch.randn(GEMM_MIN_ROWS, 256)
    torch.testing.assert_close(lin(xb), xb @ lin.dequantized().t(), rtol=1e-5, atol=1e-5)
