"""Training text for MTP heads: documents (text files, .jsonl records with their token ids and
kept trunk states) and the token windows cut from them (`mtpllm train-mtp --data`)."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import MtpllmError


@dataclass(frozen=True)
class Doc:
    """One training document: its text, and for a record written with its tokens (`ids`) and
    possibly their trunk states (a file in the .jsonl's `.states` folder) those too."""
    source: str
    text: str
    ids: list[int] | None = None
    states: Path | None = None
    n_prompt: int = 0  # leading ids that are the prompt (a record's "n_prompt"): not answer tokens


def _ids_digest(ids: list[int]) -> str:
    import hashlib
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32]


class RecordStates:
    """The trunk's final-normed hidden states of whole training records, kept by the program that
    generated them (`scripts/self_answers.py --states`: the states come from the same decoding
    that wrote the answer, so they cost nothing more) in a folder beside the .jsonl file
    (`answers.jsonl.states/`): one float16 file [len(ids), D] per record, named by the digest of
    its token ids, and `trunk.json` naming the model. `train-mtp` uses them for every window cut
    from such a record when its trunk is that model, instead of running the trunk over the window;
    they are the states of the whole conversation, as the head sees them when it drafts."""

    def __init__(self, root: Path):
        self.dir = Path(root)

    @staticmethod
    def _key(model) -> dict:
        src = Path(model.source)
        return {"trunk": src.name, "size": src.stat().st_size, "d_model": model.cfg.d_model}

    @classmethod
    def create(cls, jsonl: Path | str, model) -> "RecordStates":
        d = Path(str(jsonl) + ".states")
        key = cls._key(model)
        try:
            d.mkdir(parents=True, exist_ok=True)
            meta = d / "trunk.json"
            if meta.exists() and json.loads(meta.read_text()) != key:
                raise MtpllmError(f"{d}: holds states of another model ({meta.read_text().strip()}); "
                                  f"write to another output file")
            meta.write_text(json.dumps(key))
        except OSError as exc:
            raise MtpllmError(f"{d}: cannot write there ({exc})") from None
        return cls(d)

    def write(self, ids: list[int], hidden: torch.Tensor) -> Path:
        f = self.dir / (_ids_digest(ids) + ".npy")
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, hidden.float().cpu().numpy().astype(np.float16))
        os.replace(tmp, f)
        return f

    @classmethod
    def matches(cls, d: Path, model) -> bool:
        try:
            return json.loads((Path(d) / "trunk.json").read_text()) == cls._key(model)
        except (OSError, ValueError):
            return False


def read_texts(paths: list[str], exclude: set[str] = frozenset()) -> list[Doc]:
    """A Doc for every file under `paths` (.py .txt .md .jsonl; a directory is walked)."""
    out = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise MtpllmError(f"--data {p}: no such file or directory")
        files = sorted(f for f in path.rglob("*") if f.suffix in (".py", ".txt", ".md", ".jsonl")
                       or f.name.endswith(".jsonl.gz")) \
            if path.is_dir() else [path]
        for f in files:
            if any(x in str(f) for x in exclude):
                continue
            try:
                if f.name.endswith(".jsonl.gz"):  # records as shipped in the repository
                    import gzip
                    with gzip.open(f, "rt", encoding="utf-8") as fh:
                        text = fh.read()
                else:
                    text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError, EOFError):
                continue
            if f.suffix == ".jsonl" or f.name.endswith(".jsonl.gz"):  # one document per record (a conversation, a chapter)
                n0 = len(out)
                sdir = Path(str(f) + ".states")
                sdir = sdir if sdir.is_dir() else None
                for line in text.splitlines():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                        vals = [obj["text"]]  # a record with a text field: the rest is metadata (book, id)
                    elif isinstance(obj, dict):
                        vals = [v for v in obj.values() if isinstance(v, str)]
                    else:
                        vals = [obj] if isinstance(obj, str) else []
                    rec = " ".join(vals)
                    if rec.strip():
                        ids = obj.get("ids") if isinstance(obj, dict) else None
                        if not (isinstance(ids, list) and ids and all(type(x) is int and x >= 0 for x in ids)):
                            ids = None
                        states = sdir / (_ids_digest(ids) + ".npy") if ids and sdir else None
                        n_prompt = obj.get("n_prompt", 0) if ids else 0
                        n_prompt = n_prompt if type(n_prompt) is int and 0 <= n_prompt <= len(ids or []) else 0
                        out.append(Doc(f"{f}#{len(out) - n0}", rec, ids,
                                       states if states is not None and states.exists() else None, n_prompt))
                continue
            if text.strip():
                out.append(Doc(str(f), text))
    if not out:
        raise MtpllmError(f"--data: no readable text found in {', '.join(paths)}")
    return out


MIN_WINDOW = 16  # shorter documents are not trained on


def token_windows(tokenizer, texts: list[Doc], seq_len: int, max_tokens: int, seed: int,
                  origins: list | None = None) -> list[list[int]]:
    """Shuffle documents, tokenize, cut into windows of seq_len tokens (up to max_tokens in all); a
    document shorter than seq_len (but at least MIN_WINDOW tokens) is one shorter window.

    A record that carries its token ids uses them when they decode to its text with this
    tokenizer (the exact tokens the model wrote), else its text is tokenized. With `origins` (a
    list), (document, offset) of every window is appended to it.

    One document gives at most 2% of the budget (and at least one window), so a single large file
    (a whole Bible, a corpus dump) cannot crowd out the rest; each document's windows start at a
    random window-aligned offset so long files are sampled throughout, not only from their beginning."""
    rng = random.Random(seed)
    docs = list(texts)
    rng.shuffle(docs)
    per_doc = max(seq_len, max_tokens // 50)
    windows, total = [], 0
    for doc in docs:
        ids = doc.ids if doc.ids and _decodes_to(tokenizer, doc.ids, doc.text) else \
            tokenizer.encode(doc.text, add_special=False)
        starts = list(range(0, len(ids) - seq_len + 1, seq_len))
        if starts and starts[-1] + seq_len < len(ids):
            starts.append(len(ids) - seq_len)  # the tail (e.g. the end of an answer), overlapping
        if not starts and len(ids) >= MIN_WINDOW:
            starts = [0]  # a short document (a short answer) is one window of its own length, padded in batches
        n_win = len(starts)
        take = min(n_win, max(1, per_doc // seq_len))
        first = rng.randrange(n_win - take + 1) if n_win else 0
        for s in starts[first:first + take]:
            windows.append(ids[s:s + seq_len])
            if origins is not None:
                origins.append((doc if ids is doc.ids else None, s))
            total += len(windows[-1])
            if total >= max_tokens:
                return windows
    return windows


def _decodes_to(tokenizer, ids: list[int], text: str) -> bool:
    try:
        return tokenizer.decode(ids) == text
    except Exception:  # ids out of this tokenizer's vocabulary: another model's record
        return False
