"""`mtpllm` command line: one console script, one subcommand per tool, each with main(argv)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from .errors import MtpllmError
from .registry import DEFAULT_MODEL, REGISTRY


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{s}'") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{s}'") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def add_model_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model")
    g.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"registry name ({', '.join(REGISTRY)}) or path to a GGUF file (default: {DEFAULT_MODEL})")
    g.add_argument("-c", "--ctx-size", type=_positive_int, default=None,
                   help="context size in tokens (default: min(4096, model's training context))")
    g.add_argument("-t", "--threads", type=_positive_int, default=None, help="CPU threads (default: all cores)")
    g.add_argument("--dequantize", action="store_true",
                   help="run every weight dequantized to float32 (exact reference path, slower)")
    g.add_argument("--device", default="cpu",
                   help="cpu (the compressed kernels), cuda, cuda:N or auto (a CUDA GPU when present); "
                        "a GPU runs the weights dequantized")
    g.add_argument("--rope-freq-base", type=float, default=None, help="override the RoPE base frequency")
    g.add_argument("--rope-scaling", choices=["none", "linear", "yarn"], default=None, help="RoPE scaling type")
    g.add_argument("--rope-scale", type=float, default=None, help="RoPE scaling factor (target / original context)")
    g.add_argument("--yarn-orig-ctx", type=_positive_int, default=None, help="original context for YaRN")


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("sampling")
    g.add_argument("-n", "--n-predict", type=_nonneg_int, default=256, help="tokens to generate (default 256)")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=_nonneg_int, default=40, help="top-k, 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p, 1 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty, 1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="RNG seed (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def sampling_from_args(a):
    from .runtime.sampling import SamplingParams
    return SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          repetition_penalty=a.repeat_penalty, presence_penalty=a.presence_penalty,
                          frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.n_predict,
                          stop=list(a.stop), ignore_eos=a.ignore_eos)


def overrides_from_args(a) -> dict:
    o = {}
    if a.rope_freq_base is not None:
        o["rope.base"] = a.rope_freq_base
    if a.rope_scaling is not None:
        o["rope.scaling"] = a.rope_scaling
    if a.rope_scale is not None:
        o["rope.factor"] = a.rope_scale
    if a.yarn_orig_ctx is not None:
        o["rope.orig_ctx"] = a.yarn_orig_ctx
    return o


def load_engine(a):
    from .runtime.engine import Engine
    eng = Engine.load(a.model, n_ctx=a.ctx_size, mode="f32" if a.dequantize else "fast", threads=a.threads,
                      cfg_overrides=overrides_from_args(a), device=a.device)
    rope, train = eng.model.cfg.rope, eng.model.cfg.ctx_len
    reach = train if rope.scaling == "none" else (rope.orig_ctx or train) * rope.factor
    if eng.n_ctx > reach:
        factor = eng.n_ctx / (rope.orig_ctx or train)
        print(f"warning: context {eng.n_ctx} is beyond what this model's RoPE covers ({reach:g} tokens); text past "
              f"that point degrades. Use --rope-scaling yarn --rope-scale {factor:g} --yarn-orig-ctx "
              f"{rope.orig_ctx or train} (see `mtpllm doctor`)", file=sys.stderr)
    return eng


def print_timings(t, stats=None, file=None) -> None:
    """llama.cpp-like timing lines (on stderr unless `file` is given)."""
    file = file or sys.stderr
    def line(label, ms, n):
        per_tok = ms / n if n else 0.0
        tps = n / (ms / 1e3) if ms > 0 else 0.0
        return (f"{label:>16} = {ms:10.2f} ms / {n:5d} tokens ({per_tok:8.2f} ms per token, "
                f"{tps:8.2f} tokens per second)")
    print(f"\n{'load time':>16} = {t.load_ms:10.2f} ms", file=file)
    print(line("prompt eval time", t.prompt_ms, t.prompt_n), file=file)
    print(line("eval time", t.predicted_ms, t.predicted_n), file=file)
    if t.cached_n:
        print(f"{'cached prompt':>16} = {t.cached_n} tokens", file=file)
    if stats is not None and getattr(stats, "num_drafts", 0):
        print(stats.summary(), file=file)


# ---------------------------------------------------------------------------- run
def cmd_run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mtpllm run", description="Generate text from a prompt.")
    add_model_args(ap)
    add_sampling_args(ap)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file")
    chat = ap.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="raw text completion")
    from .speculative.config import add_spec_args, spec_from_args
    add_spec_args(ap)
    a = ap.parse_args(argv)
    if a.file is not None:
        try:
            with open(a.file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise MtpllmError(f"cannot read prompt file {a.file}: {exc}") from None
    else:
        prompt = a.prompt
    if not prompt:
        raise MtpllmError("empty prompt: give some text with -p or -f")
    params = sampling_from_args(a)
    spec_cfg = spec_from_args(a)  # validate before the (slow) model load
    eng = load_engine(a)
    ids = eng.encode_prompt(prompt, chat=a.chat)
    spec = spec_cfg.build(eng) if spec_cfg else None
    out = sys.stdout
    last = None
    for r in eng.stream(ids, params, spec):
        if r.text:
            out.write(r.text)
            out.flush()
        last = r
    out.write("\n")
    if last.finish_reason == "context":
        print(f"[context full: {eng.n_ctx} tokens; raise -c]", file=sys.stderr)
    print_timings(last.timings, last.stats)
    return 0


# ---------------------------------------------------------------------------- chat
def cmd_chat(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mtpllm chat", description="Interactive multi-turn chat with the model's template.")
    add_model_args(ap)
    add_sampling_args(ap)
    ap.add_argument("-sys", "--system", default=None, help="system prompt")
    ap.add_argument("--timings", action="store_true", help="print timings after each answer")
    from .speculative.config import add_spec_args, spec_from_args
    add_spec_args(ap)
    a = ap.parse_args(argv)
    params = sampling_from_args(a)
    spec_cfg = spec_from_args(a)
    eng = load_engine(a)
    if not eng.tokenizer.chat_template:
        raise MtpllmError("this model has no chat template; use `mtpllm run --no-chat` for text completion")
    spec = spec_cfg.build(eng) if spec_cfg else None
    messages = [{"role": "system", "content": a.system}] if a.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat with the model; /exit or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = eng.encode_prompt(messages=messages)
        parts, last = [], None
        try:
            for r in eng.stream(ids, params, spec):
                parts.append(r.text)
                sys.stdout.write(r.text)
                sys.stdout.flush()
                last = r
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(parts)})
        if last is not None and last.finish_reason == "context":
            print(f"[context full: {eng.n_ctx} tokens; /reset or raise -c]", file=sys.stderr)
            messages.pop()
            messages.pop()
        if a.timings and last is not None:
            print_timings(last.timings, last.stats)
    return 0


# ---------------------------------------------------------------------------- train-mtp
def cmd_train_mtp(argv: list[str]) -> int:
    from .train import HEAD_TYPES
    ap = argparse.ArgumentParser(prog="mtpllm train-mtp",
                                 description="Retrofit an MTP head onto a model by self-distillation; "
                                             "writes a llama.cpp-style head-only mtp-*.gguf.")
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="registry name or GGUF path (the frozen trunk)")
    ap.add_argument("--data", nargs="+", required=True, help="text files or directories (.py .txt .md .jsonl)")
    ap.add_argument("--exclude", action="append", default=[], help="skip files whose path contains this")
    ap.add_argument("-o", "--output", required=True, help="output head file, e.g. mtp-MODEL.gguf")
    ap.add_argument("--steps", type=_positive_int, default=400)
    ap.add_argument("--seq-len", type=_positive_int, default=256)
    ap.add_argument("--batch", type=_positive_int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ffn", type=_nonneg_int, default=0, help="head FFN width (default: the trunk's)")
    ap.add_argument("--draft-vocab", type=_nonneg_int, default=0,
                    help="restrict drafts to the N most frequent tokens of the training text (0 = all)")
    ap.add_argument("--depth", type=_positive_int, default=1,
                    help="draft positions to train: 2 or 3 also trains the head on its own outputs, as it "
                         "runs for k > 1 (each step costs about `depth` times as much)")
    ap.add_argument("--depth-weight", type=float, default=0.5,
                    help="weight of each further position's loss relative to the previous one")
    ap.add_argument("--feature-weight", type=float, default=1.0,
                    help="weight of the hidden-state regression that keeps k > 1 drafts on track (0 = KL only)")
    ap.add_argument("--hard-weight", type=float, default=0.0,
                    help="weight of a cross-entropy term on the trunk's argmax token, added to the KL (default 0)")
    ap.add_argument("--answer-only", action="store_true",
                    help="in records that mark their prompt (self_answers.py's n_prompt) train only on predicting "
                         "answer tokens, what the head drafts; other text is scored everywhere")
    ap.add_argument("--no-context-tokens", dest="context_tokens", action="store_false",
                    help="with a draft vocabulary, do not train on the conversation's own tokens outside it (by "
                         "default they join the softmax from their first appearance on, as the proposer drafts them)")
    ap.add_argument("--describe", default=None, metavar="TEXT",
                    help="what the training text is, recorded in the head's metadata "
                         "(default: the data files' names)")
    ap.add_argument("--init", default=None, metavar="HEAD.gguf",
                    help="fine-tune an existing head for this model (keeps its FFN width, and its draft vocabulary "
                         "unless --draft-vocab is given)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=_positive_int, default=50)
    ap.add_argument("--max-tokens", type=_positive_int, default=2_000_000, help="training text cap, in tokens")
    ap.add_argument("--fast-trunk", action="store_true",
                    help="compute the trunk's hidden states with the compressed kernels decoding uses (about 2x "
                         "faster on CPU) instead of float32; the teacher's logits still use the file's exact "
                         "lm_head weights")
    ap.add_argument("--hidden-cache", metavar="DIR",
                    help="folder for the trunk's hidden states, one file per training window (default: "
                         "OUTPUT.hidden next to the head); runs that share it compute each window once, "
                         "whatever mixture of texts the window came from")
    ap.add_argument("--device", default="auto",
                    help="where the trunk and the head run: auto (a CUDA GPU when present, else cpu), cpu, cuda, cuda:N")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="the head's products: bf16 (autocast; norms, losses and the teacher stay float32) or fp32; "
                         "auto: bf16 on a GPU, fp32 on the CPU (on CPUs with AVX-512 BF16 a bf16 step is ~1.5x "
                         "faster)")
    ap.add_argument("--head-type", type=str.lower, choices=HEAD_TYPES, default="q8_0",
                    help="storage of the head's matrices in the written file: every draft step reads them once, so "
                         "q5_0 / q4_0 draft faster for a little acceptance (default: q8_0)")
    ap.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint")
    ap.add_argument("--eval-prompts", default=None,
                    help="held-out prompts (.jsonl with 'prompt', or text lines); default: HumanEval if installed")
    ap.add_argument("--eval-n", type=_nonneg_int, default=10, help="held-out prompts to evaluate (0 = skip)")
    ap.add_argument("--eval-tokens", type=_positive_int, default=128)
    ap.add_argument("-t", "--threads", type=_positive_int, default=None)
    a = ap.parse_args(argv)
    from pathlib import Path

    from .registry import sha256_cached
    from .runtime.engine import Engine, resolve_device
    from .train.mtp import (TrainConfig, Trainer, evaluate_head, humaneval_prompts, load_prompts, read_texts,
                            token_windows)
    device = resolve_device(a.device)
    precision = a.precision if a.precision != "auto" else ("bf16" if device.startswith("cuda") else "fp32")
    cfg = TrainConfig(steps=a.steps, seq_len=a.seq_len, batch=a.batch, lr=a.lr, ffn=a.ffn,
                      draft_vocab=a.draft_vocab, feature_weight=a.feature_weight, hard_weight=a.hard_weight, depth=a.depth,
                      depth_weight=a.depth_weight, answer_only=a.answer_only,
                      context_tokens=a.context_tokens, seed=a.seed,
                      checkpoint_every=a.checkpoint_every,
                      max_tokens=a.max_tokens, precision=precision, head_type=a.head_type)
    out = Path(a.output)
    if out.parent and not out.parent.exists():
        raise MtpllmError(f"-o {a.output}: directory {out.parent} does not exist")
    prompts = load_prompts(a.eval_prompts) if a.eval_prompts else humaneval_prompts()
    texts = read_texts(a.data, set(a.exclude))
    # the frozen trunk runs in float32 (its exact distribution is the target, and prompt-sized
    # batches need no per-call dequantization), or with --fast-trunk on the compressed kernels: the
    # hidden states the head sees when it drafts, at about twice the speed
    eng = Engine.load(a.model, n_ctx=max(1024, a.seq_len + a.eval_tokens + 512), threads=a.threads,
                      mode="fast" if a.fast_trunk else "f32", device=device)
    if eng.model.cfg.n_nextn:
        print(f"note: {a.model} already has {eng.model.cfg.n_nextn} MTP layer(s); training a separate head",
              file=sys.stderr)
    origins: list = []
    windows = token_windows(eng.tokenizer, texts, cfg.seq_len, cfg.max_tokens, cfg.seed, origins)
    n_tok = sum(len(w) for w in windows)
    n_short = sum(len(w) < cfg.seq_len for w in windows)
    print(f"training data: {len(texts)} documents, {n_tok} tokens in {len(windows)} windows of {cfg.seq_len}"
          f"{f' ({n_short} shorter: short documents)' if n_short else ''}; "
          f"{cfg.steps} steps x {cfg.batch} windows on {device} ({precision})", file=sys.stderr)
    # names only: no local paths
    desc = (a.describe or ", ".join(Path(p).name for p in a.data)) + f" ({n_tok} tokens" + \
        ("; trunk states from the compressed kernels)" if a.fast_trunk else ")")
    tr = Trainer(eng, windows, cfg, out, desc, init=a.init, hidden_dir=a.hidden_cache, origins=origins)
    if not a.no_resume and tr.load_checkpoint():
        print(f"resuming from {tr.ckpt_path} at step {tr.step}", file=sys.stderr)
    t0 = time.time()
    tr.train()
    trunk_sha = sha256_cached(eng.model.source)
    tr.write_gguf(trunk_sha)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) after {time.time() - t0:.0f} s", file=sys.stderr)
    if prompts and a.eval_n:
        held = prompts[: a.eval_n]
        # evaluate on the compressed path users decode with (the float32 path verifies row by row)
        n_ctx, source = eng.n_ctx, str(eng.model.source)
        del eng, tr.head_w
        eng = Engine.load(source, n_ctx=n_ctx, threads=a.threads, device=device)
        stats = evaluate_head(eng, str(out), held, k=3, max_tokens=a.eval_tokens)
        print(f"held-out evaluation ({len(held)} prompts, k=3, greedy):\n{stats.summary()}", file=sys.stderr)
        tr.write_gguf(trunk_sha, {"mtpllm.eval.mean_acceptance_length": stats.mean_acceptance_length,
                                  "mtpllm.eval.per_position": json.dumps(stats.per_position_acceptance),
                                  "mtpllm.eval.prompts": len(held)})
    return 0


def cmd_inspect(argv: list[str]) -> int:
    from .tools.inspect import main as inspect_main
    return inspect_main(argv)


def cmd_doctor(argv: list[str]) -> int:
    from .tools.doctor import main as doctor_main
    return doctor_main(argv)


def cmd_perplexity(argv: list[str]) -> int:
    from .tools.perplexity import main as perplexity_main
    return perplexity_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from .bench.runner import main as bench_main
    return bench_main(argv)


# ---------------------------------------------------------------------------- serve
def cmd_serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="mtpllm serve",
        description="HTTP server with OpenAI-compatible (/v1/completions, /v1/chat/completions, /v1/models) and "
                    "llama.cpp-compatible (/completion, /tokenize, /detokenize, /health, /props) endpoints. "
                    "Sampling options set the defaults of requests that leave them out.")
    add_model_args(ap)
    add_sampling_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=_positive_int, default=8080, help="port (default 8080)")
    ap.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    ap.add_argument("--api-key", default=os.environ.get("MTPLLM_API_KEY") or None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on the API (default: $MTPLLM_API_KEY; none: open)")
    from .speculative.config import add_spec_args, spec_from_args
    add_spec_args(ap)
    a = ap.parse_args(argv)
    if a.port > 65535:
        raise MtpllmError(f"--port must be at most 65535, got {a.port}")
    if a.api_key is not None and not a.api_key.strip():
        raise MtpllmError("--api-key is empty")
    try:
        from .server import Server, serve
    except ImportError as exc:
        raise MtpllmError(f"the server needs FastAPI and uvicorn: pip install 'mtpllm[server]' ({exc})") from None
    params = sampling_from_args(a)
    spec_cfg = spec_from_args(a)
    eng = load_engine(a)
    from .registry import resolve_model
    server = Server(eng, resolve_model(a.model).name, spec_cfg, params)
    print(f"mtpllm serve: {server.model_id} on http://{a.host}:{a.port} (context {eng.n_ctx}"
          f"{', speculative ' + server.spec_label if server.spec_label else ''})", file=sys.stderr)
    if not a.no_webui:
        print(f"mtpllm serve: chat page at http://{a.host}:{a.port}/", file=sys.stderr)
    serve(server, a.host, a.port, webui=not a.no_webui, api_key=a.api_key.strip() if a.api_key else None)
    return 0


COMMANDS = {
    "run": (cmd_run, "generate text from a prompt"),
    "chat": (cmd_chat, "interactive chat"),
    "serve": (cmd_serve, "HTTP server: OpenAI- and llama.cpp-compatible endpoints"),
    "bench": (cmd_bench, "benchmark prefill, decode, end-to-end and speculative decoding"),
    "perplexity": (cmd_perplexity, "perplexity of a model on a text file (compressed vs --dequantize)"),
    "inspect": (cmd_inspect, "show a GGUF file's metadata, tensors, tokenizer, RoPE and MTP layers"),
    "doctor": (cmd_doctor, "check a GGUF file: integrity, SHA-256, MTP, RoPE/YaRN, memory; recommend flags"),
    "train-mtp": (cmd_train_mtp, "train (retrofit) an MTP head by self-distillation"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mtpllm <command> [options]\n\ncommands:", file=sys.stderr if argv else sys.stdout)
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<10} {help_}", file=sys.stderr if argv else sys.stdout)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"mtpllm {__version__}")
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        print(f"mtpllm: unknown command '{argv[0]}' (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    try:
        return cmd[0](argv[1:])
    except MtpllmError as exc:
        print(f"mtpllm {argv[0]}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
