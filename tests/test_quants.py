"""Dequantization of every storage type against straightforward per-block reference code
(written from the GGML block layouts), and the Q4_K -> int4 kernel mapping."""
import os
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


# ---------------------------------------------------------------------------- the engine's CPU kernel
from mtpllm.runtime import kernels  # noqa: E402
from mtpllm.runtime.linear import BlockWeight, block_weight_from_raw  # noqa: E402

needs_kernel = pytest.mark.skipif(not kernels._cpu_has_avx2(), reason="the CPU kernel needs AVX2")
EXACT = [QT.Q8_0, QT.Q5_0, QT.Q4_0, QT.Q4_1, QT.Q5_1, QT.Q2_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _raw(qtype, n, k, seed):
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return random_kquant((n, k), qtype, rng, 0.1)
    return quantize(rng.normal(0, 0.05, size=(n, k)).astype(np.float32), qtype)


@needs_kernel
def test_kernel_is_built_here():
    """On an AVX2 machine a build failure must not pass silently (it would fall back to slower kernels)."""
    assert kernels.available(), kernels.status()


@pytest.mark.parametrize("qtype", EXACT + [QT.Q3_K])
def test_block_weights_keep_the_file_codes(qtype):
    """Mapped types keep the file's integers: scale * code - min reproduces the dequantized weight up
    to float32 rounding (1e-6 of the largest weight); codes stay in the type's range (Q4_K packed two
    per byte). Q3_K has no mapping: int8 per group of 32, each weight within half a step."""
    n, k = 48, 512
    raw = _raw(qtype, n, k, int(qtype))
    ref = dequantize(raw, qtype, (n, k))
    bw = block_weight_from_raw(raw, qtype, n, k)
    assert bw.shape == (n, k)
    if qtype == QT.Q3_K:
        step = ref.reshape(n, k // 32, 32).abs().amax(-1, keepdim=True) / 127
        assert ((bw.dequantized() - ref).reshape(n, k // 32, 32).abs() <= step * 0.5 + 1e-7).all()
        return
    torch.testing.assert_close(bw.dequantized(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    codes = bw.int_codes()
    lo, hi = {QT.Q8_0: (-128, 127), QT.Q5_0: (-16, 15), QT.Q4_0: (-8, 7), QT.Q4_1: (0, 15), QT.Q5_1: (0, 31),
              QT.Q2_K: (0, 3), QT.Q4_K: (0, 15), QT.Q5_K: (0, 31), QT.Q6_K: (-32, 31)}[qtype]
    assert int(codes.min()) >= lo and int(codes.max()) <= hi
    assert bw.group == (16 if qtype in (QT.Q2_K, QT.Q6_K) else 32)
    assert bw.nibbles == (qtype == QT.Q4_K)


def _kernel_reference(x: torch.Tensor, w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What the kernel computes, in float64 after quantizing x exactly as the kernel does (float32:
    d = max|x| / 127 per block of 32, or 256 for K-quant weights, codes =
    round-half-even(x * (127 / max|x|)))."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    mx = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, 127.0 / mx, torch.zeros_like(mx))
    q = torch.round(xb * inv)
    return ((q.double() * (mx / 127.0).double()).reshape(m, k) @ w.double().t()).float()


@needs_kernel
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q5_0, QT.Q4_1, QT.Q4_K, QT.Q6_K, QT.Q2_K, QT.Q3_K])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_block_kernel_matches_reference(qtype, m):
    """The kernel equals the int8-activation formula to float32 accumulation error (1e-5 relative),
    and the full product x @ W^T to within the worst case of the activation rounding: each x moves
    by at most half its block's step d = max|x|/127, so |error| <= sum over blocks d/2 * sum|w|."""
    n, k = 40, 768
    raw = _raw(qtype, n, k, 7)
    bw = block_weight_from_raw(raw, qtype, n, k)
    w = bw.dequantized()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 5] *= 20  # an outlier channel, as in real activations
    y = bw.matmul(x)
    ref = _kernel_reference(x, w)
    # float32 sums of 24 block terms that partly cancel: a few 1e-5 of the largest output
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=3e-5 * float(ref.abs().max()))
    exact = x.double() @ w.double().t()
    d = x.double().reshape(m, k // 32, 32).abs().amax(-1) / 127  # [m, blocks]
    wsum = w.double().abs().reshape(n, k // 32, 32).sum(-1)  # [n, blocks]
    bound = d / 2 @ wsum.t()
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert float((y.double() - exact).norm() / exact.norm()) < 0.02  # typical size: about 1%


@needs_kernel
def test_block_kernel_rows_are_independent_of_batch_and_threads():
    """Verification of k+1 tokens must give the logits of k+1 single steps bit for bit: each output
    row depends only on its own input row, whatever the batch size or thread count."""
    n, k = 300, 1024
    for qtype in (QT.Q5_0, QT.Q4_K, QT.Q6_K):
        bw = block_weight_from_raw(_raw(qtype, n, k, 3), qtype, n, k)
        x = torch.randn(7, k)
        full = bw.matmul(x)
        for i in range(7):
            assert torch.equal(bw.matmul(x[i:i + 1].contiguous()), full[i:i + 1])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = bw.matmul(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, full)


@needs_kernel
def test_block_linear_fuses_formats_and_slices_rows():
    """q/k (Q4_K) and v (Q6_K) differ in format: one Linear runs them as two segments in order;
    `rows` (the MTP draft vocabulary) keeps the kernel format for a single segment."""
    from mtpllm.runtime.linear import Linear
    k = 512
    parts = [block_weight_from_raw(_raw(t, n, k, i), t, n, k)
             for i, (t, n) in enumerate([(QT.Q4_K, 64), (QT.Q4_K, 32), (QT.Q6_K, 32)])]
    segs = [BlockWeight.cat(parts[:2]), parts[2]]
    lin = Linear("blocks", None, torch.randn(128), blocks=segs)
    assert (lin.out_features, lin.in_features) == (128, k)
    x = torch.randn(2, k)
    w = torch.cat([p.dequantized() for p in parts])
    torch.testing.assert_close(lin(x), _kernel_reference(x, w) + lin.bias, rtol=1e-5, atol=1e-4)
    head = Linear("blocks", None, None, blocks=[parts[0]])
    ids = torch.tensor([3, 0, 17])
    sub = head.rows(ids)
    assert sub.kind == "blocks"
    assert torch.equal(sub(x), head(x)[:, ids])


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0])
def test_block_weights_converted_in_row_chunks_are_the_same(qtype, monkeypatch):
    """Loading converts big tensors a few thousand rows at a time (bounded temporaries): the result
    is identical to converting the whole tensor at once."""
    from mtpllm.runtime import linear
    n, k = 40, 512
    raw = _raw(qtype, n, k, 11)
    whole = block_weight_from_raw(raw, qtype, n, k)
    monkeypatch.setattr(linear, "CONVERT_ROWS", 16)
    parts = block_weight_from_raw(raw, qtype, n, k)
    assert torch.equal(parts.codes, whole.codes) and torch.equal(parts.scales, whole.scales)
    assert (parts.mins is None) == (whole.mins is None)


# ------------------------------------------------------------- the kernel on the file's own blocks
NATIVE = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def _blocks(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw))


@needs_kernel
@pytest.mark.parametrize("qtype", NATIVE)
def test_gguf_dequantize_is_exact(qtype):
    """The kernel's block decoders give exactly the reference dequantization (gguf-py's formulas)."""
    n, k = 24, 768
    raw = _raw(qtype, n, k, 5)
    assert torch.equal(kernels.gguf_dequantize([_blocks(raw)], [int(qtype)], k), dequantize(raw, qtype, (n, k)))


@needs_kernel
@pytest.mark.parametrize("qtype", NATIVE)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_gguf_kernel_matches_reference(qtype, m):
    """Products straight on the file's blocks equal the int8-activation formula to float32
    accumulation error, and the exact product within the activation-rounding bound: each x moves by
    at most half its block's step d = max|x|/127, so |error| <= sum over blocks d/2 * sum|w|.
    Activations are quantized per 32 (llama.cpp's Q8_0), per 256 against K-quants (Q8_K: integer
    sums over a super-block). K = 800 for 32-blocks: an odd number of blocks (the two-at-a-time
    loop's tail)."""
    kq = qtype in K_QUANTS
    n, k, block = (40, 768, 256) if kq else (40, 800, 32)
    raw = _raw(qtype, n, k, 7)
    w = dequantize(raw, qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 5] *= 20
    y = kernels.gguf_linear(x, [_blocks(raw)], [int(qtype)])
    ref = _kernel_reference(x, w, block)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    exact = x.double() @ w.double().t()
    d = x.double().reshape(m, k // block, block).abs().amax(-1) / 127
    bound = d / 2 @ w.double().abs().reshape(n, k // block, block).sum(-1).t()
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()


@needs_kernel
def test_gguf_kernel_rows_are_independent_of_batch_and_threads():
    """Each output row depends only on its own input row (bit for bit), whatever the batch size or
    the thread count: speculative verification equals one-token decoding."""
    cases = [(qtype, 304, 1024) for qtype in (QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K, kernels.Q4_KX8, kernels.Q6_KX8)]
    # K > 2048: Q4_Kx8 verification rows take row groups in pairs (37 groups: one left unpaired per thread)
    cases += [(kernels.Q4_KX8, 296, 2560), (kernels.Q6_KX8, 296, 2560)]
    for qtype, n, k in cases:
        w = _blocks(_raw(qtype, n, k, 3)) if qtype not in kernels.KX8_TYPES else _x8(n, k, 3, qtype)
        x = torch.randn(7, k)
        full = kernels.gguf_linear(x, [w], [int(qtype)])
        for i in range(7):
            assert torch.equal(kernels.gguf_linear(x[i:i + 1].contiguous(), [w], [int(qtype)]), full[i:i + 1])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.gguf_linear(x, [w], [int(qtype)])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, full)


@needs_kernel
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_kquant_prompt_chunks_stay_on_the_kernel_row_for_row(qtype):
    """K-quant matrices run prompt chunks (32+ rows) on the integer kernel too, in tiles of weight
    rows x activation rows swept over chunks of K: every row equals its one-row product bit for bit
    (odd N and M exercise the tile remainders, K = 17 super-blocks spans two K chunks), and the
    result is the exact product within the activation-rounding bound."""
    from mtpllm.runtime.linear import GEMM_MIN_ROWS, Linear
    n, k, m = 35, 17 * 256, GEMM_MIN_ROWS + 5
    raw = _raw(qtype, n, k, 11)
    lin = Linear("gguf", None, None, in_features=k, ggufs=[(_blocks(raw), int(qtype))])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    y = lin(x)
    for i in (0, 3, 4, 17, m - 1):
        assert torch.equal(kernels.gguf_linear(x[i:i + 1].contiguous(), lin._gw, lin._gt), y[i:i + 1])
    w = dequantize(raw, qtype, (n, k)).double()
    d = x.double().reshape(m, k // 256, 256).abs().amax(-1) / 127
    bound = d / 2 @ w.abs().reshape(n, k // 256, 256).sum(-1).t()
    assert ((y.double() - x.double() @ w.t()).abs() <= bound * (1 + 1e-4) + 1e-4).all()


@needs_kernel
def test_gguf_linear_fuses_types_and_slices_rows():
    """q (Q5_0), k (Q4_K) and v (Q8_0) of mixed types run as one call in order; `rows` (the MTP
    draft vocabulary) slices the file's blocks, repacked when whole 8-row groups allow; 32+ rows (prompt chunks) take the integer chunk
    kernels (the same formula: x quantized per block) in one call too."""
    from mtpllm.runtime.linear import GEMM_MIN_ROWS, Linear
    k = 512
    parts = [(t, n, _raw(t, n, k, i)) for i, (t, n) in enumerate([(QT.Q5_0, 64), (QT.Q4_K, 32), (QT.Q8_0, 32)])]
    lin = Linear("gguf", None, torch.randn(128), in_features=k,
                 ggufs=[(_blocks(raw), int(t)) for t, _, raw in parts])
    assert (lin.out_features, lin.in_features) == (128, k)
    w = torch.cat([dequantize(raw, t, (n, k)) for t, n, raw in parts])
    assert torch.equal(lin.dequantized(), w)
    x = torch.randn(2, k)
    ref = torch.cat([_kernel_reference(x, w[:64]), _kernel_reference(x, w[64:96], 256), _kernel_reference(x, w[96:])], 1)
    torch.testing.assert_close(lin(x), ref + lin.bias, rtol=1e-5, atol=1e-4)
    xb = torch.randn(GEMM_MIN_ROWS, k)
    ref = torch.cat([_kernel_reference(xb, w[:64]), _kernel_reference(xb, w[64:96], 256),
                     _kernel_reference(xb, w[96:])], 1)
    torch.testing.assert_close(lin(xb), ref + lin.bias, rtol=1e-5, atol=1e-4)
    head = Linear("gguf", None, None, in_features=k, ggufs=[lin.ggufs[0]])
    ids = torch.tensor([3, 0, 17])
    sub = head.rows(ids)
    assert sub.kind == "gguf"
    assert torch.equal(sub(x), head(x)[:, ids])
    # 8 or more rows in whole groups: the slice is repacked, and only the repacked copy is kept
    ids = torch.tensor([5, 1, 40, 2, 63, 8, 9, 30, 11, 12, 50, 14, 33, 16, 0, 18])
    sub = head.rows(ids)
    assert [t for _, t in sub.ggufs] == [kernels.Q5_0X8] and (sub.out_features, sub.in_features) == (16, k)
    assert torch.equal(sub.dequantized(), w[:64][ids])
    # the 8-row layout's products sum in the prompt-chunk kernel's order, not the file kernel's
    torch.testing.assert_close(sub(x), head(x)[:, ids], rtol=1e-5, atol=1e-4)
    again = sub.rows(torch.tensor([15, 3, 7]))  # a slice of a slice: the repacked rows' exact weights
    torch.testing.assert_close(again(x), x @ w[:64][ids[[15, 3, 7]]].T, rtol=1e-5, atol=1e-4)


def _x8(n, k, seed, t8=kernels.Q4_KX8):
    qtype = QT.Q4_K if t8 == kernels.Q4_KX8 else QT.Q6_K
    return kernels.gguf_repack(_blocks(_raw(qtype, n, k, seed)), int(qtype), k)


@needs_kernel
@pytest.mark.parametrize("qtype,nbytes", [(QT.Q4_K, 1184), (QT.Q6_K, 1680)])
def test_kquant_repacked_by_8_rows_is_exact(qtype, nbytes):
    """Q4_K / Q6_K repacked by 8 rows (the kernel's layout: 8 codes of each of 8 rows per 64 bytes,
    scales unpacked) hold exactly the file's weights; what cannot be repacked is refused."""
    n, k = 24, 768
    raw = _raw(qtype, n, k, 5)
    x8 = kernels.gguf_repack(_blocks(raw), int(qtype), k)
    t8 = kernels.X8_OF[int(qtype)]
    assert x8.shape == (n // 8, k // 256 * nbytes)
    assert torch.equal(kernels.gguf_dequantize([x8], [t8], k), dequantize(raw, qtype, (n, k)))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.gguf_repack(_blocks(_raw(qtype, 12, k, 5)), int(qtype), k)
    with pytest.raises(RuntimeError, match="Q4_K, Q6_K, Q4_0, Q5_0 and Q8_0"):
        kernels.gguf_repack(_blocks(_raw(QT.Q5_K, 8, k, 5)), int(QT.Q5_K), k)
    with pytest.raises(RuntimeError, match="_Kx8 weights"):
        kernels.gguf_linear(torch.randn(1, 512), [x8], [t8])


@needs_kernel
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K])
@pytest.mark.parametrize("m,k", [(1, 1280), (2, 1280), (3, 1280), (4, 1280), (5, 1280), (9, 1280), (40, 1280),
                                 (2, 2560), (3, 2560), (4, 2560), (6, 2560)])
def test_repacked_kquant_kernel_matches_reference(qtype, m, k):
    """The 8-row kernels compute the K-quant formula (x quantized per 256, integer sums per
    super-block) to float32 accumulation error, and the exact product within the
    activation-rounding bound, for every tile of x rows (4 per tile with VNNI, 2 with AVX2, and
    the remainders, and pairs of row groups past K = 2048); they match the one-row kernels of the
    file's blocks to rounding."""
    n = 48
    raw = _raw(qtype, n, k, 8)
    w = dequantize(raw, qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 5] *= 20
    y = kernels.gguf_linear(x, [kernels.gguf_repack(_blocks(raw), int(qtype), k)], [kernels.X8_OF[int(qtype)]])
    ref = _kernel_reference(x, w, 256)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(y, kernels.gguf_linear(x, [_blocks(raw)], [int(qtype)]), rtol=1e-5,
                               atol=1e-5 * float(ref.abs().max()))
    exact = x.double() @ w.double().t()
    d = x.double().reshape(m, k // 256, 256).abs().amax(-1) / 127
    bound = d / 2 @ w.double().abs().reshape(n, k // 256, 256).sum(-1).t()
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()


@needs_kernel
@pytest.mark.parametrize("sign", [1, -1])
def test_q6_tiles_are_exact_at_the_largest_codes(sign):
    """Q6_Kx8 tiles of 3+ rows of x sum a group's products in 16-bit lanes before scaling (four
    u6 x s8 products, at most 4 * 63 * 127 < 2^15): with every code 63, the extreme scales and
    |x| = 127 everywhere those sums reach their bound, and every tile row still equals its
    one-row product and the float64 product of the file's weights with x's codes."""
    n, k = 16, 512
    raw = np.zeros((n, k // 256 * 210), dtype=np.uint8)
    blocks = raw.reshape(n, k // 256, 210)
    blocks[..., :192] = 0xFF  # ql and qh: every code 63
    blocks[..., 192:208] = np.array([127, -128] * 8, dtype=np.int8).view(np.uint8)
    blocks[..., 208:210] = np.array([np.float16(2.0 ** -10)]).view(np.uint8)
    w = dequantize(raw, QT.Q6_K, (n, k))
    w8 = kernels.gguf_repack(_blocks(raw), int(QT.Q6_K), k)
    for m in (3, 4, 8):
        x = torch.full((m, k), sign * 127 / 128)  # codes +-127, step 1/128: every product exact
        y = kernels.gguf_linear(x, [w8], [kernels.Q6_KX8])
        for i in range(m):
            assert torch.equal(kernels.gguf_linear(x[i:i + 1].contiguous(), [w8], [kernels.Q6_KX8]), y[i:i + 1])
        assert torch.equal(y.double(), x.double() @ w.double().t())


def _tilings_agree(set_choice, values, ms, seed, rows_checked=None):
    """For each 8-row K-quant layout, short and long K and each row count in `ms` (x with an
    outlier): every value of a kernel choice (`set_choice(v)`) gives bit-identical products, and
    the rows `rows_checked(m)` (default all) equal their one-row products."""
    for t8 in (kernels.Q4_KX8, kernels.Q6_KX8):
        for k in (512, 2560):
            w = _x8(24, k, seed, t8)
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                x[:, 9] *= 30
                ys = []
                for v in values:
                    set_choice(v)
                    ys.append(kernels.gguf_linear(x, [w], [t8]))
                assert all(torch.equal(ys[0], y) for y in ys[1:]), (t8, k, m)
                for i in (rows_checked(m) if rows_checked else range(m)):
                    assert torch.equal(kernels.gguf_linear(x[i:i + 1].contiguous(), [w], [t8]), ys[0][i:i + 1])


@needs_kernel
def test_wide_verification_tiles_give_the_same_bits():
    """The VNNI build's tiles of 4 or 8 rows of x over Q4_Kx8 / Q6_Kx8 (the `tile_rows` choice:
    several sequences' verification rows in one step) compute the same integers: bit-identical
    outputs for every row count that splits differently into tiles, short and long K (paired
    tiles below 5 rows), with an outlier in x; every row equals its one-row product. In the
    AVX2 build the choice is accepted and has no effect (its tiles are of 2 or 4 rows)."""
    with pytest.raises(RuntimeError, match="4 or 8"):
        kernels.tuning("tile_rows", 6)
    old = kernels.tuning("tile_rows")
    try:
        _tilings_agree(lambda v: kernels.tuning("tile_rows", v), (4, 8), (5, 7, 8, 9, 12, 16, 19), 41)
    finally:
        kernels.tuning("tile_rows", old)


@needs_kernel
def test_avx2_verification_tiles_give_the_same_bits():
    """The AVX2 build's two tilings of 3+ rows of x over Q4_Kx8 / Q6_Kx8 (`kernels.x8_tile4`: all
    rows of a tile of 4 in one pass, or tiles of 2) compute the same integers: bit-identical
    outputs for verification and prompt-chunk row counts, short and long K, with an outlier in x;
    every row equals its one-row product. The VNNI build has one tiling (the choice reads -1)."""
    old = kernels.x8_tile4()
    if old < 0:
        assert kernels.isa() == "avx512vnni" and kernels.x8_tile4(0) == -1
        return
    with pytest.raises(RuntimeError, match="mask"):
        kernels.x8_tile4(4)

    def set_mask(mask):
        assert kernels.x8_tile4(mask) in (0, 1, 2, 3)
    try:
        _tilings_agree(set_mask, (0, 1, 2, 3), (2, 3, 4, 5, 6, 7, 33), 40, lambda m: (0, m - 1))
    finally:
        kernels.x8_tile4(old)


@needs_kernel
@pytest.mark.parametrize("types,k", [((QT.Q4_K, QT.Q6_K, QT.Q4_K), 512), ((QT.Q5_0, QT.Q8_0, QT.Q5_0), 256)])
def test_linear_repacks_at_load(tmp_path, monkeypatch, types, k):
    """A model's Q4_K / Q6_K / Q5_0 / Q8_0 matrices (rows divisible by 8) run repacked by 8 rows, fused with
    other types in one call; MTPLLM_REPACK=0 keeps the file's blocks; both give the same products
    to rounding (Q5_0/Q8_0 prompt chunks: exactly), and `rows` / `dequantized` still give the
    file's weights."""
    from mtpllm.gguf.reader import GGUFFile
    from mtpllm.gguf.writer import write_gguf
    from mtpllm.runtime.linear import make_linear
    tensors = {f"{c}.weight": (_raw(t, n, k, s), t) for c, t, n, s in zip("abc", types, (32, 16, 12), (1, 2, 3))}
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", {}, tensors)
    g = GGUFFile(path)
    lin = make_linear(g, ["a.weight", "b.weight", "c.weight"])
    # the third matrix (12 rows) is never repacked
    assert lin._gt == [kernels.X8_OF.get(int(t), int(t)) for t in types[:2]] + [int(types[2])]
    monkeypatch.setenv("MTPLLM_REPACK", "0")
    plain = make_linear(g, ["a.weight", "b.weight", "c.weight"])
    assert plain._gt == [int(t) for t in types]
    x = torch.randn(3, k)
    torch.testing.assert_close(lin(x), plain(x), rtol=1e-5, atol=1e-4)
    if QT.Q4_K not in types:
        x = torch.randn(33, k)  # a prompt chunk: the same 8-row GEMM either way
        assert torch.equal(lin(x), plain(x))
    assert torch.equal(lin.dequantized(), plain.dequantized())
    assert (lin.out_features, lin.in_features) == (60, k)
    ids = torch.tensor([0, 31, 5, 40])
    assert torch.equal(lin.rows(ids).dequantized(), plain.dequantized()[ids])


CHUNK = [QT.Q4_0, QT.Q5_0, QT.Q8_0]


@needs_kernel
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_0, QT.Q8_0])
def test_32_weight_blocks_repacked_by_8_rows_are_the_chunk_products(qtype):
    """Q4_0 / Q5_0 / Q8_0 repacked by 8 rows hold exactly the file's weights (in the file's byte count), and
    their kernel gives, for every number of rows (decoding, verification, prompt chunks; tiles of 4
    and 2 rows of x and the remainders), bit for bit what the prompt-chunk GEMM gives on the file's
    blocks: each row from its own row of x, whatever the batch and thread count."""
    n, k = 40, 800
    raw = _raw(qtype, n, k, 11)
    x8 = kernels.gguf_repack(_blocks(raw), int(qtype), k)
    t8 = kernels.X8_OF[int(qtype)]
    assert x8.numel() == _blocks(raw).numel()
    assert torch.equal(kernels.gguf_dequantize([x8], [t8], k), dequantize(raw, qtype, (n, k)))
    w = dequantize(raw, qtype, (n, k))
    for m in (1, 2, 3, 4, 5, 9, 31, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        x[:, 3] *= 30
        y = kernels.gguf_linear(x, [x8], [t8])
        assert torch.equal(y, kernels.gguf_linear_chunk(x, [_blocks(raw)], [int(qtype)])), m
        assert torch.equal(y, kernels.gguf_linear_chunk(x, [x8], [t8])), m
        ref = _kernel_reference(x, w, 32)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert torch.equal(y[m - 1:], kernels.gguf_linear(x[m - 1:], [x8], [t8]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.gguf_linear(x, [x8], [t8])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, y)
    with pytest.raises(RuntimeError, match="Q4_0x8/Q5_0x8/Q8_0x8 weights"):
        kernels.gguf_linear(torch.randn(1, 512), [x8], [t8])


@needs_kernel
@pytest.mark.parametrize("qtype", CHUNK)
@pytest.mark.parametrize("m", [1, 32, 37])
def test_prompt_chunk_gemm_matches_reference(qtype, m):
    """The 8-row prompt-chunk GEMM for 32-weight blocks computes the int8-activation formula to
    float32 accumulation error and the exact product within the activation-rounding bound; N = 45
    leaves a partial group of 5 weight rows, K = 800 an odd number of blocks; every row equals its
    one-row call bit for bit, whatever the thread count (a prompt split into other chunks gives the
    same values)."""
    n, k = 45, 800
    raw = _raw(qtype, n, k, 9)
    w = dequantize(raw, qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 5] *= 20
    y = kernels.gguf_linear_chunk(x, [_blocks(raw)], [int(qtype)])
    ref = _kernel_reference(x, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    exact = x.double() @ w.double().t()
    d = x.double().reshape(m, k // 32, 32).abs().amax(-1) / 127
    bound = d / 2 @ w.double().abs().reshape(n, k // 32, 32).sum(-1).t()
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    for i in {0, m // 2, m - 1}:
        assert torch.equal(kernels.gguf_linear_chunk(x[i:i + 1].contiguous(), [_blocks(raw)], [int(qtype)]), y[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.gguf_linear_chunk(x, [_blocks(raw)], [int(qtype)]), y)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_gguf_kernel_rejects_mismatched_blocks():
    """A byte count that does not match the type and K is an error, not a wild read."""
    raw = _blocks(_raw(QT.Q8_0, 4, 256, 1))
    with pytest.raises(RuntimeError, match="row bytes"):
        kernels.gguf_linear(torch.randn(1, 512), [raw], [int(QT.Q8_0)])
    with pytest.raises(RuntimeError, match="no block kernel"):
        kernels.gguf_linear(torch.randn(1, 256), [raw], [int(QT.Q3_K)])


_ISA_SCRIPT = """
import sys, numpy as np, torch
from mtpllm.runtime import kernels
assert kernels.available(), kernels.status()
data = torch.load(sys.argv[1])
torch.save([kernels.attend_cached(*x) if op == "attend_cached" else getattr(kernels, op)(x, [w], [t])
            for x, w, t, op in data], sys.argv[2])
print(kernels.status())
"""


@needs_kernel
@pytest.mark.skipif(kernels.isa() != "avx512vnni", reason="the CPU has no AVX-512 VNNI: one build only")
def test_avx512_vnni_build_is_bit_identical_to_avx2(tmp_path):
    """The AVX-512 VNNI build computes exactly the integers of the AVX2 build (vpdpbusd / vpdpwssd
    for vpmaddubsw + vpmaddwd + add, no saturation reachable): the same outputs bit for bit, for
    every type, decoding, verification and prompt-chunk row counts, with an outlier in x (the
    extremes of the int8 codes); and decode attention, whose P.V uses 512-bit registers there."""
    import subprocess
    import sys
    data = []
    for i, qtype in enumerate(NATIVE):
        k = 1024 if qtype in K_QUANTS else 800
        w = _blocks(_raw(qtype, 37, k, 20 + i))
        for m in (1, 4, 9, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + i))
            x[:, 7] *= 30
            data.append((x, w, int(qtype), "gguf_linear"))
            if qtype in CHUNK:
                data.append((x, w, int(qtype), "gguf_linear_chunk"))
    for m in (1, 2, 3, 4, 5, 9, 40):  # repacked by 8 rows: tiles of 4 (VNNI) and 2 (AVX2) rows of x
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(100 + m))
        x[:, 7] *= 30
        data.append((x, _x8(40, 1024, 30), kernels.Q4_KX8, "gguf_linear"))
        for qtype in (QT.Q6_K, QT.Q4_0, QT.Q5_0, QT.Q8_0):
            data.append((x, kernels.gguf_repack(_blocks(_raw(qtype, 40, 1024, 31)), int(qtype), 1024),
                         kernels.X8_OF[int(qtype)], "gguf_linear"))
        if m <= 4:  # K > 2048: with VNNI, row groups in pairs (5 groups: one unpaired)
            x = torch.randn(m, 2560, generator=torch.Generator().manual_seed(200 + m))
            data.append((x, _x8(40, 2560, 32), kernels.Q4_KX8, "gguf_linear"))
    # decode attention (P.V runs on 512-bit registers in the VNNI build): 1 and 4 rows, head sizes
    # 128 and 192 (a 64-dim tail), 300 positions in the cache
    g = torch.Generator().manual_seed(7)
    for (H, KV, D), T in [((12, 2, 128), 1), ((12, 2, 128), 4), ((4, 2, 192), 4)]:
        ang = torch.randn(310, D // 2, generator=g)
        args = (torch.randn(T, (H + 2 * KV) * D, generator=g), ang.cos().contiguous(), ang.sin().contiguous(),
                torch.randn(KV, 310, D, generator=g), torch.randn(KV, 310, D, generator=g), 300, H, KV, D, D, True,
                D ** -0.5, None, None, 1e-6)
        data.append((args, None, None, "attend_cached"))
    torch.save(data, tmp_path / "in.pt")
    env = dict(os.environ, MTPLLM_KERNELS_ISA="avx2")
    r = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "built (avx2)" in r.stdout
    assert kernels.status() == "built (avx512vnni)"
    for (x, w, t, op), y2 in zip(data, torch.load(tmp_path / "out.pt")):
        if op == "attend_cached":
            assert torch.equal(kernels.attend_cached(*x), y2), (x[0].shape, op)
            continue
        assert torch.equal(getattr(kernels, op)(x, [w], [t]), y2), (t, x.shape, op)
