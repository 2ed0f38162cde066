"""`mtpllm bench`: the report validates against its schema, has one row per matrix cell with the
conditions recorded, and bad input is a clear error. A short run on the real model is slow-marked."""
import csv
import io
import json

import pytest

from mtpllm.bench.report import REPORT_SCHEMA
from mtpllm.bench.runner import compare_to_llama, merge_llama_rounds, parse_llama_bench_json, parse_spec
from mtpllm.cli import main
from mtpllm.errors import MtpllmError
from tiny import make_tiny


@pytest.fixture(scope="module")
def bench_model(tiny_dir):
    return make_tiny(tiny_dir / "bench.gguf", "qwen2", seed=41, nextn=1, ctx=512)


def _validate(rep):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(rep, REPORT_SCHEMA)


def test_bench_json_report(bench_model, tmp_path, capsys):
    png = tmp_path / "bench.png"
    saved = tmp_path / "bench.json"
    rc = main(["bench", "-m", str(bench_model), "-p", "16", "-n", "4", "-d", "0,8", "-r", "2", "--warmup", "0",
               "--spec", "none,mtp:1~fixed,mtp:2~fixed,ngram:2,ngram:3+mtp:1", "-o", "json", "--save", str(saved),
               "--plot", str(png)])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    _validate(rep)
    assert json.loads(saved.read_text()) == rep
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = rep["rows"]
    assert len(rows) == 2 * 5  # depths x spec methods
    assert [r["spec"] for r in rows[:5]] == ["none", "mtp:1~fixed", "mtp:2~fixed", "ngram:2", "ngram:3+mtp:1"]
    c = rep["conditions"]
    assert c["models"][0]["path"] == str(bench_model) and len(c["models"][0]["sha256"]) == 64
    assert c["sampling"] == "greedy" and c["torch"] and c["cpu"]
    for r in rows:
        # synthetic prompts ignore EOS; after a depth prefix MTP re-evaluates the prefix's last token
        # (the head's entry there needs the next token, which the prefix did not have)
        mtp_extra = 1 if r["depth"] and "mtp" in r["spec"] else 0
        assert r["gen_tokens"] == 4 and r["prompt_tokens"] == 16 + mtp_extra
        assert r["decode_tps"]["mean"] > 0 and r["prefill_tps"]["mean"] > 0 and r["peak_rss_mib"] > 0
        if r["spec"] == "none":
            assert r["acceptance_rate"] is None and r["per_position_acceptance"] == []
        else:
            # MTP drafts every step; n-gram lookup drafts only where the text repeats
            n_pos = len(r["per_position_acceptance"])
            assert 0 <= r["acceptance_rate"] <= 1 and (n_pos == r["k"] if r["spec"].startswith("mtp") else n_pos <= r["k"])
            # steps by drafts verified: a fixed k verifies k drafts on every step but those whose
            # drafts are cut to the tokens max_tokens still allows
            h = r["draft_length_histogram"]
            assert sum(h) > 0 and (len(h) == r["k"] + 1 and h[-1] > 0 if r["spec"].startswith("mtp") else True)
            assert 1 <= r["mean_acceptance_length"] <= 1 + r["k"]
    # with llama.cpp's rows of the same run, every row shows its decode speed over llama.cpp's
    from mtpllm.bench.report import to_markdown
    llama = merge_llama_rounds([[{"model": bench_model.name, "threads": rows[0]["threads"], "test": "tg4",
                                  "ts": {"mean": 10.0, "sd": 0.5}}]])
    compare_to_llama(rows, llama)
    rep["llama_cpp"] = llama
    _validate(rep)
    md = to_markdown(rep)
    assert "decode vs llama.cpp |" in md and f" {rows[1]['decode_tps']['mean'] / 10:.2f}x |" in md
    assert "| llama.cpp bench.gguf |" in md or f"| llama.cpp {bench_model.name} |" in md


def test_bench_real_prompt_sets_and_formats(bench_model, capsys):
    assert main(["bench", "-m", str(bench_model), "-n", "4", "-r", "1", "--warmup", "0", "-p", "24",
                 "--prompts", "code,prose,long", "--n-prompts", "2", "-o", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["prompt_set"] for r in rows] == ["code", "prose", "long"]
    assert main(["bench", "-m", str(bench_model), "-n", "2", "-p", "8", "-r", "1", "--warmup", "0"]) == 0
    md = capsys.readouterr().out
    assert "| pp8+tg2 | none |" in md and "torch" in md and "sha256" in md


@pytest.mark.parametrize("n_prompt", [200, 700])
def test_edit_prompt_is_whole_lines_of_stdlib_source_within_p(bench_model, n_prompt):
    """The edit set's request: the instruction and the longest run of whole lines of the stdlib
    source whose chat-templated prompt fits -p (one more line would not)."""
    from mtpllm.bench.workloads import EDIT_INSTRUCTION, build_requests, stdlib_source
    from mtpllm.runtime.engine import Engine
    engine = Engine.load(str(bench_model), n_ctx=1024)
    (req,) = build_requests(engine, "edit", n_prompt, 3, 0)
    assert req.label == "edit" and n_prompt - 40 < len(req.ids) <= n_prompt
    text = engine.tokenizer.decode(req.ids)
    assert EDIT_INSTRUCTION in text
    code = text.split("```python\n", 1)[1].rsplit("```", 1)[0]
    lines = stdlib_source().splitlines(keepends=True)
    n = code.count("\n")
    assert n >= 1 and code == "".join(lines[:n])  # cut at a line boundary
    longer = engine.encode_prompt(f"{EDIT_INSTRUCTION}\n\n```python\n{''.join(lines[:n + 1])}```")
    assert len(longer) > n_prompt
    with pytest.raises(MtpllmError, match="too short for the edit prompt"):
        build_requests(engine, "edit", 20, 3, 0)


def test_documents_begin_with_other_modules(bench_model):
    """--documents N: the long and edit sets ask about N documents, document i beginning with the
    i-th standard-library module of the list (document 0 as with one document); each edit
    prompt fits -p; a count the list cannot give is a clear error."""
    from mtpllm.bench.workloads import DOCUMENT_MODULES, build_requests, stdlib_source
    from mtpllm.runtime.engine import Engine
    engine = Engine.load(str(bench_model), n_ctx=1024)
    reqs = build_requests(engine, "edit", 300, 3, 0, documents=3)
    assert len(reqs) == 3 and len({tuple(r.ids) for r in reqs}) == 3 and all(len(r.ids) <= 300 for r in reqs)
    import argparse
    import importlib
    import inspect
    import textwrap
    import typing
    # document 0 is the one every earlier run used
    assert stdlib_source(0).startswith("".join(inspect.getsource(m) for m in (textwrap, argparse, typing)))
    assert reqs[0].ids == build_requests(engine, "edit", 300, 3, 0)[0].ids
    for i in range(3):
        assert stdlib_source(i).startswith(inspect.getsource(importlib.import_module(DOCUMENT_MODULES[i])))
        code = engine.tokenizer.decode(reqs[i].ids).split("```python\n", 1)[1]
        assert stdlib_source(i).startswith(code.rsplit("```", 1)[0])
    longs = build_requests(engine, "long", 200, 3, 0, documents=2)
    assert len(longs) == 2 and longs[0].ids != longs[1].ids
    with pytest.raises(MtpllmError, match="does not exist"):
        stdlib_source(len(DOCUMENT_MODULES))
    with pytest.raises(MtpllmError, match="documents must be 1 to"):
        build_requests(engine, "long", 200, 3, 0, documents=0)


@pytest.mark.parametrize("args,err", [(["--prompts", "edit", "--documents", "0"], "--documents must be 1 to 6"),
                                      (["--prompts", "edit", "--documents", "7"], "--documents must be 1 to 6"),
                                      (["--prompts", "code", "--documents", "2"], "applies to the long and edit")])
def test_bad_document_count_is_a_clear_error(bench_model, args, err, capsys):
    assert main(["bench", "-m", str(bench_model)] + args) != 0
    assert err in capsys.readouterr().err


def test_bench_edit_rows(bench_model, capsys):
    assert main(["bench", "-m", str(bench_model), "-n", "3", "-r", "1", "--warmup", "0", "-p", "250", "-c", "300",
                 "--prompts", "edit", "--documents", "2", "--spec", "none,ngram:3+mtp:1", "-o", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    _validate(rep)
    assert [(r["prompt_set"], r["n_prompt"], r["requests"]) for r in rep["rows"]] == [("edit", 250, 2)] * 2
    from mtpllm.bench.report import to_markdown
    assert "| edit x2+tg3 | none |" in to_markdown(rep)
    assert all(2 * 200 < r["prompt_tokens"] <= 2 * 250 and r["gen_tokens"] <= 2 * 3 for r in rep["rows"])
    plain, chain = rep["rows"]
    assert plain["members"] == {} and set(chain["members"]) <= {"ngram", "mtp"}
    assert sum(m["drafts"] for m in chain["members"].values()) == sum(chain["draft_length_histogram"][1:])


@pytest.mark.parametrize("spec,err", [("mtp:0", "1..16"), ("mtp:x", "not an integer"), ("eagle", "unknown method"),
                                      ("draft:", "expected draft:MODEL"), ("ngram:2+none", "a chain is two"),
                                      ("ngram+mtp+ngram", "a chain is two"), ("mtp:2@x", "not a number"),
                                      ("mtp:2@1.5", "between 0 and 1"), ("mtp:2@0", "between 0 and 1")])
def test_bad_spec_is_a_clear_error(spec, err):
    with pytest.raises(MtpllmError, match=err):
        parse_spec(spec)


def test_spec_parsing():
    assert parse_spec("none") == ("none", "none", 0, None)
    assert parse_spec("mtp") == ("mtp:3", "mtp", 3, None)
    assert parse_spec("ngram:2") == ("ngram:2", "ngram", 2, None)
    assert parse_spec("ngram:4+mtp:1") == ("ngram:4+mtp:1", "chain", 4, None)
    assert parse_spec("draft:/x/y.gguf:4") == ("draft:y.gguf:4", "draft_model", 4, "/x/y.gguf")
    assert parse_spec("draft:qwen2.5-coder-0.5b") == ("draft:qwen2.5-coder-0.5b:3", "draft_model", 3,
                                                       "qwen2.5-coder-0.5b")
    assert parse_spec("mtp:3@0.5") == ("mtp:3@0.5", "mtp", 3, None)
    assert parse_spec("ngram:4+mtp:2@0.25") == ("ngram:4+mtp:2@0.25", "chain", 4, None)
    assert parse_spec("mtp:3@c0.3") == ("mtp:3@c0.3", "mtp", 3, None)
    assert parse_spec("ngram:4+mtp:3@c0.25") == ("ngram:4+mtp:3@c0.25", "chain", 4, None)
    for bad, msg in (("mtp:3@c1.5", "between 0 and 1"), ("mtp:3@cx", "not a number")):
        with pytest.raises(MtpllmError, match=msg):
            parse_spec(bad)
    # an '@' in a draft model's path is not a cut-off; one after the path still is
    assert parse_spec("draft:/srv/u@h/m.gguf:4") == ("draft:m.gguf:4", "draft_model", 4, "/srv/u@h/m.gguf")
    assert parse_spec("draft:/x/m@v2.gguf") == ("draft:m@v2.gguf:3", "draft_model", 3, "/x/m@v2.gguf")
    assert parse_spec("draft:/srv/u@h/m.gguf:4@0.5") == ("draft:m.gguf:4@0.5", "draft_model", 4, "/srv/u@h/m.gguf")


def test_bench_p_min_rows_count_undrafted_steps(bench_model, capsys):
    """'@P' reaches the verifier: with a cut-off no draft of the tiny random head passes (its top
    probability is far below 0.99), every step is a plain one, the output is the same tokens, and the
    tokens per step (1.0) tell it where the mean acceptance length over drafted steps cannot."""
    assert main(["bench", "-m", str(bench_model), "-p", "16", "-n", "6", "-r", "1", "--warmup", "0",
                 "--spec", "mtp:2,mtp:2@0.99,mtp:2@c0.99", "-o", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    _validate(rep)
    plain, cut, cum = rep["rows"]
    assert cut["spec"] == "mtp:2@0.99" and cut["k"] == 2 and cum["spec"] == "mtp:2@c0.99"
    assert plain["tokens_per_step"] == plain["mean_acceptance_length"] >= 1
    for r in (cut, cum):
        assert r["tokens_per_step"] == 1.0 and r["per_position_acceptance"] == [] and r["gen_tokens"] == 6
    assert main(["bench", "-m", str(bench_model), "-p", "16", "-n", "6", "-r", "1", "--warmup", "0",
                 "--spec", "mtp:2@0.99"]) == 0
    assert "| mtp:2@0.99 |" in capsys.readouterr().out


def test_bench_bad_input(bench_model, tmp_path, capsys):
    assert main(["bench", "-m", str(bench_model), "--prompts", "poems"]) == 1
    assert "unknown prompt set 'poems'" in capsys.readouterr().err
    assert main(["bench", "-m", str(bench_model), "--vs-llama-cpp", str(tmp_path / "nope")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert main(["bench", "-m", str(bench_model), "-p", "8", "-n", "2", "-r", "1", "--warmup", "0",
                 "--vs-llama-cpp", str(tmp_path)]) == 1
    assert "no llama-bench binary" in capsys.readouterr().err
    assert main(["bench", "-m", str(tmp_path / "missing.gguf")]) == 1
    assert main(["bench", "-m", str(bench_model), "-n", "0"]) == 1
    with pytest.raises(SystemExit):
        main(["bench", "-p", "abc"])
    # MTP on a model without MTP layers fails before any measurement, saying how to get a head
    plain = make_tiny(tmp_path / "plain.gguf", "qwen2", seed=2)
    assert main(["bench", "-m", str(plain), "--spec", "mtp:2"]) == 1
    assert "train-mtp" in capsys.readouterr().err


def test_llama_bench_json_is_parsed():
    # the shape `llama-bench -o json` prints (fields trimmed to the ones used)
    text = json.dumps([
        {"model_filename": "/m/qwen.gguf", "n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ts": 101.5,
         "stddev_ts": 1.25},
        {"model_filename": "/m/qwen.gguf", "n_threads": 2, "n_prompt": 0, "n_gen": 128, "avg_ts": 26.8,
         "stddev_ts": 0.3}])
    rows = parse_llama_bench_json(text)
    assert rows == [{"model": "qwen.gguf", "threads": 2, "test": "pp512", "ts": {"mean": 101.5, "sd": 1.25}},
                    {"model": "qwen.gguf", "threads": 2, "test": "tg128", "ts": {"mean": 26.8, "sd": 0.3}}]
    with pytest.raises(MtpllmError, match="not JSON"):
        parse_llama_bench_json("error: model not found")


def test_llama_rounds_are_merged_and_compared():
    """llama-bench runs once per round: its figures are the mean and sd over rounds (one round keeps its
    own sd), and every row of the same file, threads and new-token count gets its decode ratio."""
    def one(pp, tg):
        return parse_llama_bench_json(json.dumps([
            {"model_filename": "/m/q.gguf", "n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ts": pp, "stddev_ts": 1},
            {"model_filename": "/m/q.gguf", "n_threads": 2, "n_prompt": 0, "n_gen": 128, "avg_ts": tg, "stddev_ts": 2}]))
    merged = merge_llama_rounds([one(100.0, 30.0), one(110.0, 26.0)])
    by = {r["test"]: r for r in merged}
    assert by["pp512"]["prefill_tps"] == "105.00 ± 7.07" and by["pp512"]["decode_tps"] == "-"
    assert by["tg128"]["ts"] == {"mean": 28.0, "sd": pytest.approx(2.828, abs=1e-3)} and by["tg128"]["rounds"] == 2
    assert merge_llama_rounds([one(100.0, 30.0)])[1]["decode_tps"] == "30.00 ± 2.00"
    rows = [{"model": "/x/q.gguf", "threads": 2, "n_gen": 128, "decode_tps": {"mean": 56.0, "sd": 1.0}},
            {"model": "/x/q.gguf", "threads": 1, "n_gen": 128, "decode_tps": {"mean": 20.0, "sd": 1.0}},
            {"model": "/x/q.gguf", "threads": 2, "n_gen": 64, "decode_tps": {"mean": 20.0, "sd": 1.0}}]
    compare_to_llama(rows, merged)
    assert rows[0]["decode_vs_llama_cpp"] == pytest.approx(2.0)
    assert "decode_vs_llama_cpp" not in rows[1] and "decode_vs_llama_cpp" not in rows[2]


@pytest.mark.slow
def test_short_bench_on_the_real_model(capsys, tmp_path):
    rc = main(["bench", "-m", "qwen2.5-coder-0.5b", "-p", "64", "-n", "16", "-r", "2", "--spec", "none,ngram:2",
               "--prompts", "synthetic,code", "--n-prompts", "1", "-o", "json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    _validate(rep)
    assert len(rep["rows"]) == 4
    assert rep["conditions"]["models"][0]["sha256"] == \
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert "Q4_K" in rep["conditions"]["models"][0]["quant_types"]
    for r in rep["rows"]:
        assert r["decode_tps"]["mean"] > 0 and r["load_ms"] > 0


def test_cpu_named_by_family_and_model():
    """Figures name the CPU by family and model (one model name covers Zen 3, 4 and 5 in these VMs)
    and by the vector extensions the kernels depend on; only the first processor's block is read."""
    from mtpllm.bench.report import cpu_model
    zen4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_vnni\n\n"
            "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: other\n")
    assert cpu_model(zen4) == "AMD EPYC (family 25 model 17; avx512_vnni)"
    intel = "cpu family\t: 6\nmodel\t\t: 167\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t: avx2 avx512_vnni amx_int8\n"
    assert cpu_model(intel) == "Intel(R) Xeon(R) Processor (family 6 model 167; avx512_vnni, amx_int8)"
    assert cpu_model("cpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t: avx2 fma\n") == \
        "AMD EPYC (family 25 model 1; avx2)"
    assert cpu_model("") != ""  # no /proc/cpuinfo: the platform's name
