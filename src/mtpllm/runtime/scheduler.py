"""Continuous batching: many sequences, one forward per step.

The scheduler owns `n_slots` lanes (`Slot`: a cache and draft states each). Requests wait in a
bounded queue; between steps a waiting request takes a free slot (the one whose cached tokens share
the longest prefix with its prompt, so a conversation's next turn reuses its own cache). Its prompt
is evaluated in chunks (chunked prefill): each step runs at most `prefill_budget` prompt tokens
(one prefill forward of the engine), so a long prompt never stalls the other sequences for more
than one such forward; the chunks are the ones a prefill at once runs (`Engine.prefill_steps`),
so the results are the same bits. Each step then asks every decoding sequence's decoder for its
rows (1 for plain decoding, 1 + k for a verification), runs all rows through the model in ONE
forward (`forward_batch`: the weights are read once for all sequences, attention runs per sequence
in its own cache), and lets each decoder commit its rows: acceptance, rollback, its own proposer
state. Sequences leave when they finish or their client cancels; a cancelled sequence stops within
one step.

Every sequence keeps its own speculation (draft state on its slot, statistics, samplers), so a
sequence's tokens are exactly what it gets alone: greedy identical, sampled with the same seed
identical (tested), whatever else runs beside it.

A request's responses arrive on its own queue (`Request.__iter__`), so a server thread or an
asyncio task can wait on them; the scheduler runs in one background thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import MtpllmError
from .sampling import SamplingParams
from ..models.base import step_logits
from ..speculative.policy import step_costs
from .sequence import OutputText, PlainDecoder, Response, Sequence, Timings, common_prefix


log = logging.getLogger("mtpllm.scheduler")


SLOT_SIMILARITY = 0.5  # a slot is taken by prefix only when the prefix is over this share of what it caches


def choose_slot(free: list, prompt: list[int]):
    """The free slot a prompt takes: the one sharing the longest prefix with it, provided that
    prefix is over SLOT_SIMILARITY of what the slot caches, else the least recently released one
    (never used ones first). As llama-server, by shared prefix then least recently used; unlike it,
    which measures the prefix against the prompt and keeps an evicted slot's state in a host-memory
    prompt cache, the prefix is measured against the slot's cache, so a new conversation that
    shares only a system prompt does not take the slot (and the whole cache) of another."""
    best, best_n = None, 0
    for s in free:
        n = common_prefix(s.tokens, prompt)
        if n > best_n and n > SLOT_SIMILARITY * len(s.tokens):
            best, best_n = s, n
    return best if best is not None else min(free, key=lambda s: (s.last_used, s.index))


class QueueFull(MtpllmError):
    """The waiting queue is at its limit: try again later."""


class ShuttingDown(MtpllmError):
    """The scheduler has stopped accepting requests."""


class Request:
    """A submitted generation. Iterate it for its `Response`s (the last has a finish_reason);
    `cancel()` stops it within one step and frees its slot."""
    _ids = iter(range(1, 1 << 62))

    def __init__(self, prompt: list[int], params: SamplingParams, decoder=...):
        self.id = next(Request._ids)
        self.decoder = decoder  # ... = the scheduler's; None = plain decoding
        self.prompt = list(prompt)
        self.params = params
        self.queue: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.slot: int | None = None  # the slot it runs on, once admitted
        self.submitted = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self):
        while True:
            item = self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


@dataclass
class _Active:
    req: Request
    seq: Sequence
    out: OutputText
    timings: Timings
    t_gen: float = 0.0  # when its generation (after the prefill) started
    prefill: object = None  # while its prompt is evaluated: the decoder's start_steps generator
    next_rows: int = 0  # prompt tokens of its next prefill forward


class Scheduler:
    def __init__(self, engine, speculative=None, n_slots: int = 1, max_queue: int = 64, start: bool = True):
        """`start=False`: no background thread; the caller runs `step()` itself."""
        if not isinstance(n_slots, int) or n_slots < 1:
            raise MtpllmError(f"parallel slots must be a positive integer, got {n_slots!r}")
        if n_slots > 1:
            from .engine import check_kv_memory
            check_kv_memory(engine.model.cfg, engine.n_ctx * n_slots)
        self.engine = engine
        self.decoder = speculative or PlainDecoder()
        self.slots = [engine.slot] + [engine.new_slot(i) for i in range(1, n_slots)]
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: dict[int, _Active] = {}  # slot index -> active sequence
        self.cv = threading.Condition()
        self.accepting = True
        self._uses = 0  # slots released so far: each slot records when it was last released (Slot.last_used)
        self._stop = False
        self.steps = 0  # decoding forwards run (observability)
        self.prefill_rows = 0  # prompt tokens evaluated
        self.listeners: list = []  # callables(req, response) called on every finished request
        self.thread = threading.Thread(target=self._loop, name="mtpllm-scheduler", daemon=True) if start else None
        if self.thread is not None:
            self.thread.start()

    # ------------------------------------------------------------------ client side
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, decoder=...) -> Request:
        """Queue a generation; `decoder`: this request's speculative decoder (... = the scheduler's,
        None = plain decoding; one built on the same proposer shares its draft state on the slot)."""
        params = params or SamplingParams()
        self.engine._check_prompt(prompt_ids)
        req = Request(prompt_ids, params, decoder)
        with self.cv:
            if not self.accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the queue's limit): try again later")
            self.waiting.append(req)
            self.cv.notify()
        return req

    def queue_depth(self) -> int:
        return len(self.waiting)

    def busy(self) -> int:
        return len(self.running)

    def slots_info(self) -> list[dict]:
        """Per slot (llama.cpp's /slots shape, trimmed): id, busy, context size, cached tokens, the request."""
        with self.cv:
            info = []
            for s in self.slots:
                a = self.running.get(s.index)
                d = {"id": s.index, "is_processing": a is not None, "n_ctx": s.cache.max_len,
                     "n_cached": len(s.tokens), "id_task": a.req.id if a else None}
                if a is not None:
                    d["n_decoded"] = len(a.out.generated)
                    d["n_prompt_tokens"] = len(a.req.prompt)
                    d["is_prefilling"] = a.prefill is not None
                    if a.seq.stats is not None:
                        d["speculative"] = a.seq.stats.to_dict()
                info.append(d)
            return info

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting, let running and waiting requests finish for up to `timeout` seconds,
        then cancel what is left and stop the thread."""
        with self.cv:
            self.accepting = False
        self._wait_idle(timeout)
        with self.cv:
            for r in list(self.waiting) + [a.req for a in self.running.values() if a is not None]:
                r.cancel()
            self.cv.notify()
        self._wait_idle(5.0)  # cancelled sequences leave within a step
        with self.cv:
            self._stop = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=5.0)

    def _wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + max(0.0, seconds)
        while time.monotonic() < deadline:
            with self.cv:
                if not self.running and not self.waiting:
                    return
            time.sleep(0.02)

    # ------------------------------------------------------------------ the loop
    def run(self, stop=None) -> None:
        """The scheduling loop on the calling thread (a Scheduler made with `start=False`), until
        `shutdown()` or, polled while idle, `stop()` returns true; then whatever still runs or waits
        is cancelled and leaves within a step.

        Why a caller may want it on its own thread: the kernels' OpenMP threads belong to the thread
        that starts a parallel region. A model loaded (and its kernels tuned) on one thread and run
        on another has two teams of worker threads, more than a small machine's cores, and OpenMP
        then stops its workers' spin-waits between parallel regions: a decoding step is ~15% slower
        (measured on a 2-core VM). `mtpllm serve` runs this loop on the main thread, the one that
        loaded the model, and the HTTP server on another."""
        while True:
            with self.cv:
                while True:
                    if stop is not None and not self._stop and stop():
                        self._stop = True
                    if self._stop or self.running or self.waiting:
                        break
                    self.cv.wait(0.1 if stop is not None else None)
                if self._stop and not self.running and not self.waiting:
                    return
                if self._stop:  # asked to stop with work left: cancel it (it leaves within a step)
                    self.accepting = False
                    for r in list(self.waiting) + [a.req for a in self.running.values() if a is not None]:
                        r.cancel()
            try:
                self.step()
            except Exception as e:  # a bug in the loop itself: fail what runs, keep serving
                log.error("internal error in the scheduler:\n%s", traceback.format_exc())
                for idx in list(self.running):
                    self._fail(idx, e)

    def _loop(self) -> None:
        self.run()

    def step(self) -> None:
        """One scheduling step: drop cancelled, admit waiting, at most `prefill_budget` prompt
        tokens of the sequences still prefilling, then one forward over all decoding ones."""
        with self.cv:
            for r in [r for r in self.waiting if r.cancelled.is_set()]:
                self.waiting.remove(r)
                self._send(r, Response(None, "", "cancelled", Timings(load_ms=self.engine.load_ms)))
            admit = []
            free = [s for s in self.slots if s.index not in self.running]
            while self.waiting and free:
                req = self.waiting.popleft()
                slot = choose_slot(free, req.prompt)
                free.remove(slot)
                admit.append((req, slot))
                self.running[slot.index] = None  # reserved
        for idx, a in list(self.running.items()):
            if a is not None and a.req.cancelled.is_set():
                if a.prefill is not None:  # the cache keeps the chunks done so far, as a reusable prefix
                    a.prefill.close()
                    a.prefill = None
                self._finish(idx, Response(None, a.out.flush(), "cancelled", a.timings, a.seq.stats))
        for req, slot in admit:
            self._admit(req, slot)
        self._prefill()
        live = [(i, a) for i, a in self.running.items() if a is not None and a.prefill is None]
        t_plan = time.perf_counter()
        table = step_costs(self.engine)
        timings = table.timings
        plans = []
        groups: dict[int, list] = {}  # the sequences of one decoder plan together (one drafting pass)
        for idx, a in live:
            groups.setdefault(id(a.seq.decoder), []).append((idx, a))
        planned = []
        for members in groups.values():
            dec = members[0][1].seq.decoder
            if hasattr(dec, "plan_batch"):
                planned += zip(members, dec.plan_batch([a.seq for _, a in members], self.engine, len(live)))
                continue
            for idx, a in members:
                try:
                    planned.append(((idx, a), dec.plan(a.seq, self.engine, len(live))))
                except Exception as e:  # noqa: BLE001
                    planned.append(((idx, a), e))
        for (idx, a), rows in planned:
            if isinstance(rows, BaseException):  # one request's failure fails that request only
                self._fail(idx, rows)
                continue
            if rows is None:  # its context is full
                a.out.finish = "context"
                self._finish(idx, Response(None, a.out.flush(), "context", a.timings, a.seq.stats))
                continue
            plans.append((idx, a, rows))
        if not plans:
            return
        dev = self.engine.device
        t0 = time.perf_counter()
        try:
            hidden = self.engine.model.forward_batch(
                [torch.tensor(r, dtype=torch.long, device=dev) for _, _, r in plans], [a.seq.slot.cache for _, a, _ in plans])
        except Exception:  # noqa: BLE001 - find the sequence that fails: run them one by one
            hidden = []
            for idx, a, r in plans:
                try:
                    hidden.append(self.engine.model(torch.tensor(r, dtype=torch.long, device=dev), a.seq.slot.cache))
                except Exception as e:  # noqa: BLE001
                    self._fail(idx, e)
                    hidden.append(None)
        # the logits of every sequence's rows in one pass of the output matrix (per sequence, that
        # matrix would be read once per sequence: at a few sequences, a large part of the step)
        done = [h for h in hidden if h is not None]
        logits = step_logits(self.engine.model, torch.cat(done)).split([h.shape[0] for h in done]) if done else []
        logits = iter(logits)
        ms = (time.perf_counter() - t0) * 1e3
        self.steps += 1
        depths = [a.seq.slot.cache.length for _, a, _ in plans]
        ok = len(done) == len(plans)
        for (idx, a, _), h in zip(plans, hidden):
            if h is None:
                continue
            try:
                block = a.seq.decoder.commit(self.engine, a.seq, h, ms, logits=next(logits))
            except Exception as e:  # noqa: BLE001
                self._fail(idx, e)
                ok = False
                continue
            self._emit(idx, a, block)
        if ok and table.timings == timings:  # a step without a cost measurement in it: what it cost
            drafting = sum(a.seq.step_draft_ms for _, a, _ in plans) / 1e3
            n_rows = sum(len(r) for _, _, r in plans)
            if len(plans) == 1:  # one sequence: its forward and logits against their timed cost
                if plans[0][1].seq.costs is not None:  # the cost policy's own steps only
                    table.observe_pace(depths[0] - n_rows, n_rows, ms / 1e3)
            else:
                table.observe_step(depths, n_rows, time.perf_counter() - t_plan - drafting)

    def _admit(self, req: Request, slot) -> None:
        """A request takes its slot: its sequence, and its prefill ready to run chunk by chunk."""
        eng = self.engine
        try:
            dec = self.decoder if req.decoder is ... else req.decoder
            seq = eng.new_sequence(req.prompt, req.params, dec if dec is not None and dec.speculative else None, slot)
            gen = seq.decoder.start_steps(eng, seq)
            rows = next(gen)  # finds the reusable prefix; the size of the first prefill forward
        except Exception as e:  # noqa: BLE001
            slot.reset()  # its cache may be out of step with its tokens
            with self.cv:
                self.running.pop(slot.index, None)
            self._send(req, e)
            return
        timings = Timings(load_ms=eng.load_ms, cached_n=seq.cached_n, prompt_n=len(req.prompt) - seq.cached_n)
        req.slot = slot.index
        a = _Active(req, seq, OutputText(eng.tokenizer, req.params), timings, prefill=gen, next_rows=rows)
        with self.cv:
            self.running[slot.index] = a

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens evaluated per step, all prefilling sequences together: one prefill forward
        of the engine (`Engine.prefill_chunk`), so that the decoding sequences wait for at most
        that between two of their tokens."""
        return self.engine.prefill_chunk

    def _prefill(self) -> None:
        """Run prefill forwards, oldest request first, while they fit this step's budget (the
        first always runs: every step makes progress). A sequence whose prefill ends emits its
        first token and decodes from this step on."""
        budget, spent = self.prefill_budget, 0
        for idx, a in sorted(((i, a) for i, a in self.running.items() if a is not None and a.prefill is not None),
                             key=lambda ia: ia[1].req.id):
            while a.prefill is not None and (spent == 0 or spent + a.next_rows <= budget):
                t0 = time.perf_counter()
                block = None
                try:
                    rows = a.prefill.send(None)  # runs a.next_rows tokens; the size of the next forward
                except StopIteration as stop:  # the prompt is in; its first token sampled
                    block = stop.value
                except Exception as e:  # noqa: BLE001 - fails this request only
                    self._fail(idx, e)
                    break
                t1 = time.perf_counter()
                spent += a.next_rows
                self.prefill_rows += a.next_rows
                a.timings.prompt_ms += (t1 - t0) * 1e3
                if block is None:
                    a.next_rows = rows
                    continue
                a.prefill, a.t_gen = None, t1
                if a.out.finish is not None:  # max_tokens == 0
                    self._finish(idx, Response(None, "", a.out.finish, a.timings, a.seq.stats))
                else:
                    self._emit(idx, a, block)
            if spent >= budget:
                return

    def _emit(self, idx: int, a: _Active, block: list[int]) -> None:
        tm = a.timings
        for t, piece, finish, i in a.out.add(block):
            tm.predicted_n = len(a.out.generated)
            tm.predicted_ms = (time.perf_counter() - a.t_gen) * 1e3
            r = a.out.response(block, i, t, piece, finish, tm, a.seq.stats)
            if finish is not None:
                self._finish(idx, r)
                return
            self._send(a.req, r)
        if a.out.finish is not None:  # EOS
            tm.predicted_n = len(a.out.generated)
            tm.predicted_ms = (time.perf_counter() - a.t_gen) * 1e3
            self._finish(idx, Response(None, a.out.flush(), a.out.finish, tm, a.seq.stats))

    def _release(self, idx: int):
        """The active sequence of slot `idx`, taken off the running set; the slot's release time noted
        (the least recently released free slot is taken first)."""
        with self.cv:
            self._uses += 1
            self.slots[idx].last_used = self._uses
            return self.running.pop(idx, None)

    def _finish(self, idx: int, r: Response) -> None:
        a = self._release(idx)
        if a is not None:
            self._send(a.req, r)
            for fn in self.listeners:
                try:
                    fn(a.req, r)
                except Exception:  # noqa: BLE001 - observability must not break serving
                    pass

    def _fail(self, idx: int, err: BaseException) -> None:
        a = self._release(idx)
        if a is None:
            return
        if a.prefill is not None:
            a.prefill.close()
        a.seq.slot.reset()  # its cache may be out of step with its tokens
        self._send(a.req, err)  # as raised: an MtpllmError is the request's fault, anything else a bug

    @staticmethod
    def _send(req: Request, item) -> None:
        req.queue.put(item)
