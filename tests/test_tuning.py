"""Kernel choices by timing (runtime/tuning.py) on a tiny real model: the cheaper option is picked
(timings given through the `timer` seam), a cached choice is reused without timing, a wrong or
corrupt entry is timed again, and every option computes the same bits."""
import json

import pytest
import torch

from mtpllm.models import load_model
from mtpllm.runtime import kernels, tuning
from tiny import make_tiny

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(make_tiny(tiny_dir / "tune.gguf", "qwen2", seed=8), "fast")


@pytest.fixture(autouse=True)
def attention_choice(monkeypatch):
    """The tiny model's cache is far below the size from which attention's prefetch is a choice:
    no size here, so that the choice exists (and its real timer stays cheap: two layers)."""
    monkeypatch.setattr(tuning, "ATTN_BYTES", 0)


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


class Timer:
    """Given timings per (choice, option): the cheapest is the one set to cost least."""

    def __init__(self, cheapest: dict):
        self.cheapest = cheapest
        self.calls = 0

    def __call__(self, name, value):
        self.calls += 1
        return 1.0 if value == self.cheapest.get(name) else 2.0 + value % 7


def _restore():
    kernels.tuning("grain_macs", 262144)
    kernels.tuning("pair_nsb", 8)
    kernels.tuning("tile_rows", 4)
    kernels.tuning("prefetch", 2048)
    kernels.tuning("q6_prefetch", 2048)
    kernels.tuning("attn_prefetch", 0)


def test_the_cheaper_option_is_chosen_and_set(model, tmp_path, two_threads):
    opts = tuning.choices(model)
    assert opts["grain_macs"] == list(tuning.GRAIN_OPTIONS)  # two threads: a real choice
    assert opts["attn_prefetch"] == list(tuning.ATTN_PREFETCH_OPTIONS)  # timed on its own operator
    want = {name: o[0] for name, o in opts.items()}
    try:
        t = Timer(want)
        got = tuning.tune(model, tmp_path / "t.json", timer=t)
        assert {n: g["choice"] for n, g in got.items()} == want
        assert all(not g["cached"] for g in got.values())
        assert t.calls == sum(len(o) for o in opts.values())
        for name, v in want.items():
            assert kernels.tuning(name) == v  # applied to the kernels
        # another cheapest option, another file: the other one is chosen
        want2 = {name: o[-1] for name, o in opts.items()}
        got2 = tuning.tune(model, tmp_path / "t2.json", timer=Timer(want2))
        assert {n: g["choice"] for n, g in got2.items()} == want2
        assert kernels.tuning("grain_macs") == want2["grain_macs"]
    finally:
        _restore()


def test_a_cached_choice_is_reused_without_timing(model, tmp_path, two_threads):
    path = tmp_path / "t.json"
    try:
        tuning.tune(model, path, timer=Timer({"grain_macs": 1048576}))
        kernels.tuning("grain_macs", 262144)
        t = Timer({"grain_macs": 65536})  # would choose another option if it were asked
        got = tuning.tune(model, path, timer=t)
        assert t.calls == 0 and got["grain_macs"] == {**got["grain_macs"], "choice": 1048576, "cached": True}
        assert kernels.tuning("grain_macs") == 1048576
        # one thread: no choice of thread split exists; only the other choices of this build (the
        # AVX-512 VNNI build's tile pairing), keyed by the thread count too, are timed
        torch.set_num_threads(1)
        others = tuning.choices(model)
        assert "grain_macs" not in others
        assert "grain_macs" not in tuning.tune(model, path, timer=t)
        assert t.calls == sum(len(o) for o in others.values())
    finally:
        _restore()


def _tamper(path, fn):
    data = json.loads(path.read_text())
    for e in data["entries"].values():
        fn(e)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage", ["garbage", "choice_not_fastest", "choice_not_an_option", "timing_changed",
                                    "other_build"])
def test_a_wrong_or_corrupt_entry_is_timed_again(model, tmp_path, two_threads, damage):
    path = tmp_path / "t.json"
    try:
        tuning.tune(model, path, timer=Timer({"grain_macs": 65536}))
        if damage == "garbage":
            path.write_text('{"version": 1, "entries": {"x": [')
        elif damage == "choice_not_fastest":  # consistent checksum, but the choice is not its own fastest
            def f(e):
                e["choice"] = 1048576
                e["check"] = tuning._check(e["key"], e["choice"], e["ms"])
            _tamper(path, f)
        elif damage == "choice_not_an_option":
            def f(e):
                e["choice"] = 12345
                e["ms"] = {k: 5.0 for k in e["ms"]} | {"12345": 0.1}
                e["check"] = tuning._check(e["key"], e["choice"], e["ms"])
            _tamper(path, f)
        elif damage == "timing_changed":  # edited without updating the checksum
            _tamper(path, lambda e: e["ms"].update({"1048576": 0.01}))
        else:  # an entry made for another build of the kernels, moved under this key
            def f(e):
                e["key"] = dict(e["key"], build="avx2-0000000000000000")
                e["check"] = tuning._check(e["key"], e["choice"], e["ms"])
            _tamper(path, f)
        t = Timer({"grain_macs": 262144})
        got = tuning.tune(model, path, timer=t)
        assert t.calls > 0 and got["grain_macs"]["choice"] == 262144 and not got["grain_macs"]["cached"]
        # rewritten: the next load uses it
        t2 = Timer({"grain_macs": 65536})
        assert tuning.tune(model, path, timer=t2)["grain_macs"]["cached"] and t2.calls == 0
    finally:
        _restore()


def test_every_option_gives_the_same_bits(model, two_threads):
    """Decoding and verification rows (one sequence's, and several sequences' in one step: 6 and 8
    rows) with each option of each choice that exists here: identical."""
    ids = [3, 17, 99, 5, 42, 7, 250, 11]
    x = {r: torch.tensor(ids[:r]) for r in (1, 4, 6, 8)}
    prompt = torch.arange(20, 60)

    def run():
        cache = model.make_cache(64)
        with torch.inference_mode():
            model(prompt, cache)
            out = [model(x[r], cache).clone() for r in (1, 4, 6, 8)]
        return out

    try:
        ref = None
        for name, options in tuning.choices(model).items():
            for o in options:
                kernels.tuning(name, o)
                got = run()
                if ref is None:
                    ref = got
                assert all(torch.equal(a, b) for a, b in zip(ref, got)), (name, o)
            _restore()
    finally:
        _restore()


def test_real_timing_at_load_writes_the_cache(tiny_dir, tmp_path, monkeypatch, two_threads, capsys):
    """Engine.load times the choices (really) and caches them, saying so on stderr when it takes a
    while (here: at once); a second load reads the cache."""
    from mtpllm.runtime import kernels
    from mtpllm.runtime.engine import Engine
    path = tmp_path / "load.json"
    monkeypatch.setenv("MTPLLM_TUNING_CACHE", str(path))
    monkeypatch.delenv("MTPLLM_TUNE", raising=False)
    src = make_tiny(tiny_dir / "tune2.gguf", "qwen2", seed=9)
    try:
        notice_after = kernels._NOTICE_AFTER_S
        monkeypatch.setattr(kernels, "_NOTICE_AFTER_S", 0.0)
        capsys.readouterr()
        eng = Engine.load(str(src), n_ctx=64)
        err = capsys.readouterr().err
        assert f"timing the kernels' alternative paths on this CPU (first load only; cached in {path})" in err
        assert " done in " in err
        monkeypatch.setattr(kernels, "_NOTICE_AFTER_S", notice_after)
        entries = json.loads(path.read_text())["entries"]
        assert {e["key"]["choice"] for e in entries.values()} >= {"grain_macs", "attn_prefetch"}
        attn = [e for e in entries.values() if e["key"]["choice"] == "attn_prefetch"]
        assert attn[0]["key"]["attention"] == list(tuning.attention_shape(eng.model)) \
            + [tuning.ATTN_DEPTH, tuning.ATTN_BYTES]  # what the timer saw
        for e in entries.values():
            assert tuning.valid_entry(e, e["key"], e["key"]["options"])
        before = path.read_text()
        Engine.load(str(src), n_ctx=64)
        assert path.read_text() == before  # nothing timed again
        monkeypatch.setenv("MTPLLM_TUNE", "0")
        path.unlink()
        Engine.load(str(src), n_ctx=64)
        assert not path.exists()
    finally:
        _restore()


def test_attention_is_a_choice_only_where_its_cache_can_outgrow_the_cpus_caches(model, monkeypatch):
    """Attention's prefetch is timed only for a model whose float32 cache (every attention layer, its
    whole context) can reach ATTN_BYTES: a smaller one is read from the CPU's caches, as the timing
    would be."""
    cfg = model.cfg
    size = 2 * cfg.n_kv_heads * cfg.head_dim * 4 * cfg.n_layers * cfg.ctx_len
    monkeypatch.setattr(tuning, "ATTN_BYTES", size)
    assert tuning.choices(model)["attn_prefetch"] == [0, 1]
    monkeypatch.setattr(tuning, "ATTN_BYTES", size + 1)
    assert "attn_prefetch" not in tuning.choices(model)
    # a hybrid's recurrent layers keep no keys or values: only its attention layers count
    from types import SimpleNamespace
    hybrid = SimpleNamespace(cfg=SimpleNamespace(n_heads=8, n_kv_heads=2, head_dim=64, n_layers=8, ctx_len=1024,
                                                 recurrent=(True, True, True, False) * 2))
    monkeypatch.setattr(tuning, "ATTN_BYTES", 2 * 2 * 64 * 4 * 2 * 1024)  # its 2 attention layers' cache
    assert tuning.attention_shape(hybrid) == (8, 2, 64)
    monkeypatch.setattr(tuning, "ATTN_BYTES", 2 * 2 * 64 * 4 * 2 * 1024 + 1)
    assert tuning.attention_shape(hybrid) is None


def test_prefetch_choices_are_checked():
    """The kernels refuse prefetch values they do not implement: an odd (into L2) distance for the
    products' `prefetch`, distances past 64 KiB, an attention prefetch other than 0 or 1; the Q6_K
    tiles take an L2 distance."""
    try:
        for name, bad in (("prefetch", 1025), ("prefetch", 70000), ("q6_prefetch", 70001), ("attn_prefetch", 2)):
            with pytest.raises(RuntimeError, match="prefetch"):
                kernels.tuning(name, bad)
        kernels.tuning("q6_prefetch", 8193)
        assert kernels.tuning("q6_prefetch") == 8193
        assert set(tuning.Q6_PREFETCH_OPTIONS) >= {0, 2048} and all(v <= (1 << 16) + 1 for v in tuning.Q6_PREFETCH_OPTIONS)
    finally:
        _restore()
