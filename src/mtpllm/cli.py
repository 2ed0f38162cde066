"""`mtpllm` command line: one console script, one subcommand per tool, each with main(argv)."""
from __future__ import annotations

import argparse
import os
import sys
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
    if stats is not None and getattr(stats, "num_steps", 0):  # also when the policy chose plain steps only
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
    add_spec_args(ap, default_mtp=True)
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
    spec_cfg = spec_from_args(a, default_mtp=True)  # validate before the (slow) model load
    eng = load_engine(a)
    ids = eng.encode_prompt(prompt, chat=a.chat)
    spec = spec_cfg.build(eng) if spec_cfg and spec_cfg.usable(eng) else None  # by default: where there is a head
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
    add_spec_args(ap, default_mtp=True)
    a = ap.parse_args(argv)
    params = sampling_from_args(a)
    spec_cfg = spec_from_args(a, default_mtp=True)
    eng = load_engine(a)
    if not eng.tokenizer.chat_template:
        raise MtpllmError("this model has no chat template; use `mtpllm run --no-chat` for text completion")
    spec = spec_cfg.build(eng) if spec_cfg and spec_cfg.usable(eng) else None
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
    from .train.command import main as train_main
    return train_main(argv)


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
    from .runtime.engine import PREFILL_CHUNK

    ap = argparse.ArgumentParser(
        prog="mtpllm serve",
        description="HTTP server with OpenAI-compatible (/v1/completions, /v1/chat/completions, /v1/models) and "
                    "llama.cpp-compatible (/completion, /tokenize, /detokenize, /apply-template, /health, /props, "
                    "/slots) endpoints, and Prometheus metrics (/metrics). Sampling options set the defaults of "
                    "requests that leave them out. User guide: docs/server.md.")
    add_model_args(ap)
    add_sampling_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                    "only; 0.0.0.0 to serve the network, with --api-key)")
    ap.add_argument("--port", type=_positive_int, default=8080, help="port (default 8080)")
    g = ap.add_argument_group("HTTP")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but "
                   "/health (default: the MTPLLM_API_KEY environment variable; none: no key)")
    g.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser pages from ORIGIN (e.g. http://localhost:3000; '*' for any) to call the "
                        "API (repeatable; default: none)")
    g.add_argument("--max-body-bytes", type=_positive_int, default=None,
                   help="largest request body accepted, in bytes (default 8 MiB); larger: 413")
    g.add_argument("-np", "--parallel", type=_positive_int, default=1,
                   help="sequences generated at once, each with its own cache and speculation (default 1); "
                        "above 1 they are batched: one forward per step for all of them")
    g.add_argument("-ub", "--ubatch-size", type=_positive_int, default=None, metavar="N",
                   help=f"prompt tokens per prefill forward (default {PREFILL_CHUNK}): a long prompt is evaluated N tokens at "
                        "a time between the decoding steps of the other sequences, so they wait at most one such "
                        "forward for their next token")
    g.add_argument("--max-queue", type=_nonneg_int, default=64,
                   help="generation requests that may wait for a slot (default 64); more: 429 with Retry-After")
    g.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="on SIGTERM / Ctrl-C, seconds running requests get to finish before they are cancelled "
                        "(default 20)")
    g.add_argument("--no-access-log", action="store_true", help="no JSON access-log line per request on stderr")
    ap.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    from .speculative.config import add_spec_args, spec_from_args
    add_spec_args(ap, default_mtp=True)
    a = ap.parse_args(argv)
    if a.port > 65535:
        raise MtpllmError(f"--port must be at most 65535, got {a.port}")
    if not a.shutdown_timeout >= 0:
        raise MtpllmError(f"--shutdown-timeout must be >= 0 seconds, got {a.shutdown_timeout}")
    api_key = a.api_key if a.api_key is not None else os.environ.get("MTPLLM_API_KEY") or None
    if api_key is not None and (not api_key.strip() or not api_key.isascii() or any(c.isspace() for c in api_key)):
        raise MtpllmError("--api-key must be non-empty printable ASCII without spaces")
    try:
        from .server import DEFAULT_MAX_BODY, Server, serve
    except ImportError as exc:
        raise MtpllmError(f"the server needs FastAPI, uvicorn and prometheus-client: pip install 'mtpllm[server]' "
                          f"({exc})") from None
    params = sampling_from_args(a)
    spec_cfg = spec_from_args(a, default_mtp=True)
    eng = load_engine(a)
    if a.ubatch_size is not None:
        eng.prefill_chunk = a.ubatch_size
    if spec_cfg is not None and not spec_cfg.usable(eng):
        spec_cfg = None  # speculation by default only where the model has an MTP head
    from .registry import resolve_model
    server = Server(eng, resolve_model(a.model).name, spec_cfg, params, parallel=a.parallel, max_queue=a.max_queue,
                    scheduler_thread=False)  # `serve` runs it on this thread, the one that loaded the model
    print(f"mtpllm serve: {server.model_id} on http://{a.host}:{a.port} (context {eng.n_ctx}"
          f"{', speculative ' + server.spec_label if server.spec_label else ''}"
          f"{', API key required' if api_key else ''})", file=sys.stderr)
    if not a.no_webui:
        print(f"mtpllm serve: chat page at http://{a.host}:{a.port}/", file=sys.stderr)
    if not api_key and a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving {a.host} without an API key: anyone who reaches this port can use the model "
              f"(set --api-key or MTPLLM_API_KEY)", file=sys.stderr)
    serve(server, a.host, a.port, api_key=api_key, cors_origins=a.cors_origin,
          max_body_bytes=a.max_body_bytes or DEFAULT_MAX_BODY, shutdown_timeout=a.shutdown_timeout,
          access_log=not a.no_access_log, webui=not a.no_webui)
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
