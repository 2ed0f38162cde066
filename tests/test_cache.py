"""The cache protocol: KV caches (full and ring) and the recurrent cache roll back through `trim`,
and `snapshot`/`restore` return to an earlier state, so that a verification block followed by a
rollback leaves exactly the state that feeding only the accepted rows gives."""
import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.runtime.cache import Cache, CacheGroup, RecurrentCache, delta_rule_update
from mtpllm.runtime.kv_cache import SWA_SLACK, KVCache

H, K, V, C, KL = 2, 3, 4, 5, 3  # heads, key dim, value dim, conv channels, conv state length


def _feed(cache: RecurrentCache, x: torch.Tensor) -> torch.Tensor:
    """A small recurrent layer written against the cache API: causal depthwise convolution over the
    inputs, then the delta rule (`delta_rule_update`) with k, v, decay and beta read off the
    convolution; rows recorded for a rollback, the final state written. x [T, C] -> y [T, V] (one
    output per row: the state summed over heads and keys). Layer 0 only."""
    T = x.shape[0]
    w = torch.linspace(0.5, 1.5, KL + 1)[:, None]  # conv weights [KL + 1, 1]
    hist = torch.cat([cache.conv_state(0).clone(), x])  # [KL + T, C]: read before push_conv
    cache.push_conv(0, x)
    s = cache.state_of(0)
    ys = []
    for t in range(T):
        c = (hist[t:t + KL + 1] * w).sum(0)  # [C]
        k = torch.nn.functional.normalize(c[:K], dim=0).repeat(H, 1)  # [H, K]
        v = torch.tanh(c[:V]).repeat(H, 1)  # [H, V]
        decay, beta = torch.sigmoid(c[-1]).repeat(H), torch.sigmoid(c[1]).repeat(H)
        s = delta_rule_update(s, k, v, decay, beta)
        if T <= cache.max_rows:
            cache.record_row(0, t, k, v, decay, beta)
        ys.append(s.sum((0, 1)))
    cache.final_state(0).copy_(s)
    cache.advance(T)
    return torch.stack(ys)


def _rec(max_rows=8):
    return RecurrentCache(1, C, KL, H, K, V, max_len=256, max_rows=max_rows)


def test_caches_follow_the_protocol():
    assert isinstance(_rec(), Cache)
    assert isinstance(KVCache(2, 1, 4, 16), Cache)
    assert isinstance(CacheGroup(kv=KVCache(2, 1, 4, 16), rec=RecurrentCache(1, C, KL, H, K, V, 16)), Cache)


@pytest.mark.parametrize("T,n", [(4, 0), (4, 1), (4, 3), (8, 5), (2, 1)])
def test_recurrent_trim_equals_feeding_only_the_kept_rows(T, n):
    g = torch.Generator().manual_seed(T * 10 + n)
    prompt, block, after = (torch.randn(m, C, generator=g) for m in (20, T, 3))
    a = _rec()
    _feed(a, prompt)  # a prompt chunk longer than max_rows: kept as its final state only
    _feed(a, block)
    assert a.max_trim() == T - 1
    assert a.trim(n) == n
    ya = _feed(a, after)
    b = _rec()
    _feed(b, prompt)
    _feed(b, block[:T - n])
    yb = _feed(b, after)
    assert a.length == b.length == 20 + T - n + 3
    assert torch.equal(ya, yb)
    assert torch.equal(a.state_of(0), b.state_of(0))
    assert torch.equal(a.conv_state(0), b.conv_state(0))


def test_recurrent_trim_limits():
    a = _rec(max_rows=4)
    _feed(a, torch.randn(10, C))  # a long chunk: no per-row states, nothing to roll back
    assert a.max_trim() == 0
    with pytest.raises(MtpllmError, match="cannot be rolled back"):
        a.trim(1)
    _feed(a, torch.randn(3, C))
    a.trim(1)
    a.trim(1)  # two trims of the same block add up
    assert a.max_trim() == 0 and a.length == 11


def _same(a: RecurrentCache, b: RecurrentCache):
    assert a.length == b.length
    assert torch.equal(a.state_of(0), b.state_of(0))
    assert torch.equal(a.conv_state(0), b.conv_state(0))


@pytest.mark.parametrize("seed", range(4))
def test_recurrent_lazy_replay_equals_feeding_only_the_kept_rows(seed):
    """Blocks of random sizes each trimmed by a random amount (sometimes twice, sometimes not at
    all), with snapshots, restores and single rows between them: the state and outputs are bit for
    bit those of a cache fed only the kept rows, whether the pending replay is applied by the next
    forward or by `materialize` (a snapshot, `state_of`)."""
    g = torch.Generator().manual_seed(seed)
    a, b = _rec(max_rows=6), _rec(max_rows=6)
    x = torch.randn(12, C, generator=g)
    _feed(a, x)
    _feed(b, x)
    snap = None
    for step in range(40):
        T = int(torch.randint(1, 7, (1,), generator=g))
        blk = torch.randn(T, C, generator=g)
        ya = _feed(a, blk)
        n = int(torch.randint(0, T, (1,), generator=g))
        first = int(torch.randint(0, n + 1, (1,), generator=g))
        assert a.trim(first) == first  # two trims of the same block add up (a trim of 0 included)
        assert a.trim(n - first) == n - first
        assert a.max_trim() == T - n - 1
        yb = _feed(b, blk[:T - n])
        assert torch.equal(ya[:T - n], yb)
        what = int(torch.randint(0, 4, (1,), generator=g))
        if what == 0:
            _same(a, b)  # materialized here
            assert a.max_trim() == T - n - 1  # ... and still as trimmable
        elif what == 1:
            snap = a.snapshot(), b.snapshot()
            assert snap[0][0] == snap[1][0] and torch.equal(snap[0][2], snap[1][2])
        elif what == 2 and snap is not None:
            a.restore(snap[0])
            b.restore(snap[1])
            assert a.max_trim() == 0
    _same(a, b)
    a.reset()
    assert a.length == a.max_trim() == 0 and not a.state_of(0).any()


def test_recurrent_keeps_two_states():
    """Memory: two delta-rule states per layer (the committed one and the one before the last
    forward) and the recorded rows, not one state per verification row."""
    a = _rec(max_rows=8)
    assert a.state.shape == (1, 2, H, K, V)
    assert a.nbytes() == 4 * (a.conv.numel() + 2 * H * K * V + 8 * H * (K + V + 2))


def test_recurrent_snapshot_restore():
    a = _rec()
    _feed(a, torch.randn(6, C))
    snap = a.snapshot()
    y1 = _feed(a, torch.ones(3, C))
    _feed(a, torch.randn(5, C))
    a.restore(snap)
    assert a.length == 6
    assert torch.equal(_feed(a, torch.ones(3, C)), y1)


def test_kv_snapshot_restore_and_ring_trim_limit():
    kv = KVCache(2, 1, 2, 64, windows=(4, 0))  # layer 0: a ring of 4 + SWA_SLACK, capped at 64
    x = torch.randn(10, 1, 2)
    for layer in (0, 1):
        kv.update(layer, x, x + 1, torch.arange(10))
    kv.advance(10)
    snap = kv.snapshot()
    kv.update(1, x[:3] * 7, x[:3], torch.arange(10, 13))
    kv.advance(3)
    kv.restore(snap)
    assert kv.length == 10
    assert torch.equal(kv.k[kv.slot[1], :, :10], x.transpose(0, 1))
    # a ring that has not wrapped can drop anything; once wrapped, SWA_SLACK - 1 positions at most
    assert kv.max_trim() == 10
    ring = KVCache(1, 1, 2, 512, windows=(4,))
    ring.length = 200
    assert ring.max_trim() == SWA_SLACK - 1
    with pytest.raises(MtpllmError, match="overwritten"):
        ring.trim(SWA_SLACK)


def test_cache_group_moves_together():
    grp = CacheGroup(kv=KVCache(1, 1, 2, 256), rec=_rec())
    x = torch.randn(4, 1, 2)
    grp.kv.update(0, x, x, torch.arange(4))
    _feed(grp.rec, torch.randn(4, C))  # advances the recurrent part
    grp.kv.advance(4)
    assert grp.length == 4 and grp.max_trim() == 3
    grp.trim(2)
    assert grp.kv.length == grp.rec.length == 2
    with pytest.raises(MtpllmError):
        grp.trim(2)
    with pytest.raises(MtpllmError, match="one context size"):
        CacheGroup(a=KVCache(1, 1, 2, 8), b=KVCache(1, 1, 2, 9))
