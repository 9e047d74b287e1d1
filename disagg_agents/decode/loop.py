"""Continuous batching: one mlx thread decodes every active request together.

Requests join between steps with their prompt already in their caches and their
first token already sampled (from the prefill side's logits or a local prefill),
and leave when they finish, so a new request never waits for others to end.
Everything mlx runs on this one thread (mlx evaluation is not safe across
threads); other threads hand it work with `call` / `post` and read tokens back
from each request's queue, so a slow client never stalls the batch.

A lone request decodes with its own plain caches, exactly as mlx-lm's
generate_step would; a second one starts a batch: preallocated rows for the
full-attention layers (disagg_agents/decode/rows.py: a join writes one row, a departure
moves one) and mlx-lm's batch caches for the others (left-padded, with per-row
offsets). The plain caches come back when the batch shrinks to one again.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from disagg_agents.decode.chunksizer import ChunkSizer
from disagg_agents.decode.draft import Drafter
from disagg_agents.decode.grammar import Grammars, Matcher
from disagg_agents.decode.rewind import can_rewind, rewind_batch, rewind_plain
from disagg_agents.decode.rows import RowBatch
from disagg_agents.decode.sampling import Sampler, sample_rows
from disagg_agents.decode.sampling import make_sampler as make_sampler  # re-exported
from disagg_agents.decode.sampling import top_p_rows as top_p_rows  # re-exported
from disagg_agents.decode.speculate import judge, verify
from disagg_agents.prefix.store import prom_series

log = logging.getLogger("disagg.decode")


try:
    _malloc_trim: Callable[[int], int] | None = ctypes.CDLL(None).malloc_trim  # glibc only
except (OSError, AttributeError):
    _malloc_trim = None


def release_memory() -> None:
    """When the batch goes idle: a batch's merged caches are large, and freed
    memory would otherwise stay with mlx's cache and the C heap (RSS stays at
    the burst's peak)."""
    mx.clear_cache()
    if _malloc_trim is not None:
        _malloc_trim(0)


@dataclass
class Seq:
    """One request while it decodes. The loop puts (token id, logprobs or None)
    on `out` for each new token, then None when it ends (or an Exception)."""

    caches: list[Any]  # plain mlx-lm caches holding the prompt
    first: int  # already sampled and sent by the request's own thread
    sampler: Sampler | None
    max_tokens: int  # counting the first token
    eos: frozenset[int]
    want_logprobs: bool = False
    out: queue.Queue[tuple[int, np.ndarray | None] | Exception | None] = field(
        default_factory=queue.Queue
    )
    # Ended: finished here (EOS, max_tokens), or stopped by its own thread (client gone).
    done: bool = False
    produced: int = 1
    fresh: bool = True  # its next step input is `first`, which was already sent
    # Structured output: the grammar its tokens must follow (it has consumed `first`).
    matcher: Matcher | None = None
    # perf_counter: handed to the loop, and admitted to the batch (after a wait for a slot)
    posted_at: float = 0.0
    joined_at: float | None = None
    # -- prefix save hook (disagg_agents.decode.prefixsave) --
    # Set by a save that waits for them: its plain caches, once the loop stops
    # writing them (merged into the batch, or the request ended); never if it failed.
    released: Future[list[Any]] | None = None
    # Whose request (its cache salt: one per API key): a full batch's next free row
    # goes to the waiting request of the tenant holding the fewest rows.
    tenant: str | None = None
    # -- prompt-lookup drafts (disagg_agents/decode/draft.py) --
    # The ids the model saw before `first` (prompt, a migrated answer so far): the
    # context drafts are looked up in. None: this request does not draft.
    context: list[int] | None = None
    drafter: Drafter | None = None  # set when it joins a loop that drafts


@dataclass
class PrefillJob:
    """A local prefill of prompt positions [pos, end), computed a chunk at a time."""

    run: Callable[[int, int], None]  # computes positions [a, b) into the request's caches
    pos: int
    end: int
    fut: Future[None]


# Drafts pay where decode is latency-bound (one or two agent-CLI sessions); in a
# wider batch a partial acceptance moves whole rows' K/V (rewind.py), measured
# 0.5-0.9x at batch 8 (docs/performance.md): there the plain step runs.
DRAFT_ROWS = 2


class DecodeLoop:
    """Owns the model's mlx work: tasks from other threads, one chunk of a local
    prefill, then one decode step."""

    def __init__(
        self,
        model: Any,
        max_batch: int = 32,
        grammars: Grammars | None = None,
        prefill_step: int = 2048,
        rows: bool = True,
        draft_rows: int = DRAFT_ROWS,
    ) -> None:
        self.model = model
        # Prompt-lookup drafts, verified in the batch's forward (where the
        # caches can drop rejected positions: disagg_agents/decode/rewind.py),
        # while the batch has at most `draft_rows` rows (0: never).
        self.speculate = draft_rows > 0
        self.draft_rows = draft_rows
        self.drafted = self.accepted = self.verify_steps = 0
        self.grammars = grammars  # masks rows whose Seq carries a matcher
        self.max_batch = max_batch
        self.tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.waiting: list[Seq] = []  # joined while the batch was full
        self.seqs: list[Seq] = []
        self.caches: list[Any] = []  # plain caches for one sequence, batch caches for more
        self.batched = False
        # Preallocated rows for the full-attention layers (disagg_agents/decode/rows.py);
        # False: mlx-lm's batch caches throughout (merge/extend/filter).
        self.use_rows = rows
        self.rows: RowBatch | None = None
        self.next_tokens: mx.array | None = None  # [B] inputs of the next step
        self.next_logprobs: mx.array | None = None  # [B, vocab] they were sampled from
        self.steps = 0
        self.peak_batch = 0
        # Local prefills, served in turn: one chunk per turn, sized to the batch.
        self.prefills: deque[PrefillJob] = deque()
        self.chunks = ChunkSizer(prefill_step)
        self._last_step_end: float | None = None  # None: something ran since
        # Called on this thread before each turn of work, and before it waits idle
        # (BlasShare.tick and .idle: thread counts).
        self.before_turn: Callable[[], None] | None = None
        self.on_idle: Callable[[], None] | None = None
        threading.Thread(target=self._run, daemon=True, name="mlx").start()

    # -- other threads ---------------------------------------------------------

    def post(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run fn(*args) on the mlx thread before its next step."""
        fut: Future[Any] = Future()
        self.tasks.put((lambda: fn(*args), fut))
        return fut

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the mlx thread and return what it returns (or raise)."""
        return self.post(fn, *args).result()

    def prefill(self, run: Callable[[int, int], None], start: int, end: int) -> Future[None]:
        """Compute prompt positions [start, end) with run(a, b) in chunks, each
        followed by a decode step while other requests decode."""
        fut: Future[None] = Future()
        self.post(self.prefills.append, PrefillJob(run, start, end, fut))
        return fut

    def join(self, seq: Seq) -> None:
        seq.posted_at = time.perf_counter()
        self.post(self._admit, seq)

    def busy(self) -> bool:
        """Rows decoding or prompts prefilling here now (read from any thread)."""
        return bool(self.seqs or self.prefills)

    def snapshot(self) -> dict[str, int]:
        return {
            "batch": len(self.seqs),
            "batch_waiting": len(self.waiting),
            "batch_peak": self.peak_batch,
            "decode_steps": self.steps,
            "local_prefills": len(self.prefills),  # prompts being prefilled here now
            "draft_tokens": self.drafted,
            "draft_accepted_tokens": self.accepted,
            "verify_steps": self.verify_steps,
        }

    def prometheus(self) -> str:
        """The drafts' counters for /metrics (any thread: plain ints)."""
        return prom_series(
            "disagg_speculation",
            "decode",
            [
                ("draft_tokens_total", "counter", self.drafted),
                ("accepted_tokens_total", "counter", self.accepted),
                ("verify_steps_total", "counter", self.verify_steps),
                ("decode_steps_total", "counter", self.steps),
            ],
        )

    # -- the mlx thread --------------------------------------------------------

    def _run(self) -> None:
        with mx.stream(generation_stream):  # where mlx-lm's own generation runs
            self._serve()

    def _serve(self) -> None:
        while True:
            block = not self.seqs and not self.prefills
            if block and self.on_idle is not None:
                self.on_idle()
            while True:
                try:
                    fn, fut = self.tasks.get(block=block)
                except queue.Empty:
                    break
                block = False
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed back to the caller
                        fut.set_exception(e)
            self._admit_waiting()
            if self.before_turn is not None and (self.seqs or self.prefills):
                self.before_turn()
            if self.prefills:
                self._chunks()
            if self.seqs:
                try:
                    self._step()
                except Exception as e:  # fail these requests, keep the agent
                    log.exception("decode step failed")
                    self._fail(e)
                self._admit_waiting()

    def _fail(self, e: Exception) -> None:
        for seq in self.seqs:
            seq.out.put(e)
        self.seqs, self.caches, self.batched, self.rows = [], [], False, None
        self.next_tokens = self.next_logprobs = None
        self._last_step_end = None
        release_memory()

    def _chunks(self) -> None:
        """One turn of local prefill. Nothing decoding: a full chunk of every
        prompt in line (mlx-lm's chunks). Beside decoding streams: the turn's token
        budget (about 1.5 steps' worth), prompts first come first served, so a
        burst of short prompts shares one turn and a long one is spread over many."""
        busy = bool(self.seqs)
        if busy and self.next_tokens is not None:
            mx.eval(self.next_tokens)  # the queued step first, so the chunks are timed alone
        budget = self.chunks.size(busy)
        for _ in range(len(self.prefills)):
            if busy and budget <= 0:
                break
            job = self.prefills.popleft()
            if job.fut.cancelled():
                continue
            n = min(budget if busy else self.chunks.full, job.end - job.pos)
            t0 = time.perf_counter()
            try:
                job.run(job.pos, job.pos + n)
            except BaseException as e:  # handed back to the request's thread
                job.fut.set_exception(e)
                continue
            self.chunks.observe_chunk(n, time.perf_counter() - t0)
            budget -= n
            job.pos += n
            if job.pos >= job.end:
                job.fut.set_result(None)
            elif busy:
                self.prefills.appendleft(job)  # the budget is spent: it goes on next turn
            else:
                self.prefills.append(job)
        self._last_step_end = None  # the next step's interval is not a step's time

    def _admit(self, seq: Seq) -> None:
        self.waiting.append(seq)  # admitted with every other join of this turn

    def _fairest(self, group: list[Seq]) -> int:
        """The waiting request to admit next: of the tenant holding the fewest rows
        (those joining now counted), the longest waiting first."""
        if len({seq.tenant for seq in self.waiting}) < 2:
            return 0
        rows = Counter(seq.tenant for seq in (*self.seqs, *group))
        return min(range(len(self.waiting)), key=lambda i: (rows[self.waiting[i].tenant], i))

    def _admit_waiting(self) -> None:
        """Waiting requests into free slots, all in one extend of the batch caches:
        a burst of n joins copies the batch once, not n times."""
        group: list[Seq] = []
        while self.waiting and len(self.seqs) + len(group) < self.max_batch:
            seq = self.waiting.pop(self._fairest(group))
            if seq.done:
                self._release(seq, seq.caches)
                seq.out.put(None)
            else:
                group.append(seq)
        if group and not self.seqs:  # the first keeps its plain caches (mlx-lm's path)
            lone = group.pop(0)
            self.caches, self.batched = lone.caches, False
            self.next_tokens = mx.array([lone.first], dtype=mx.uint32)
            self.next_logprobs = None
            self._joined(lone)
        if not group:
            return
        # A lone request's plain caches, which the batch is about to take over.
        plain, released = (None if self.batched else self.seqs[0]), self.caches
        try:
            self._extend(group)
        except Exception as e:  # the batch's caches may be half extended: fail them all
            log.exception("joining the batch failed")
            for seq in group:
                seq.out.put(e)
            self._fail(e)
            return
        if plain is not None:
            self._release(plain, released)
        for seq in group:
            self._release(seq, seq.caches)
            self._joined(seq)

    def _extend(self, group: list[Seq]) -> None:
        if not self.batched:
            self._start_batch(len(group))
        if self.rows is not None:  # a row per sequence, the others untouched
            self.rows.join([s.caches for s in group])
        else:
            for i, mine in enumerate(self.caches):
                theirs = [s.caches[i] for s in group]
                mine.extend(type(theirs[0]).merge(theirs))
        assert self.next_tokens is not None
        firsts = mx.array([s.first for s in group], dtype=mx.uint32)
        self.next_tokens = mx.concatenate([self.next_tokens, firsts])
        if self.next_logprobs is not None:  # the fresh rows' are never reported
            blank = mx.zeros((len(group), self.next_logprobs.shape[-1]), self.next_logprobs.dtype)
            self.next_logprobs = mx.concatenate([self.next_logprobs, blank])

    def hand_over_caches(self, seq: Seq) -> None:
        """On the mlx thread: if `seq` decodes alone on its plain caches, the loop
        goes on with copies of them and `seq`'s own are released to the prefix
        cache's save. (A request still waiting for a slot in a full batch is left waiting.)"""
        self._admit_waiting()  # it may be queued behind this call's own turn
        if seq.released is None or seq.released.done():
            return
        if self.batched or len(self.seqs) != 1 or self.seqs[0] is not seq:
            return
        old = self.caches
        self.caches = [own_copy(c) for c in old]
        self._release(seq, old)

    def _release(self, seq: Seq, caches: list[Any]) -> None:
        """Prefix save hook: `seq`'s plain caches are no longer written here."""
        if seq.released is not None and not seq.released.done():
            seq.released.set_result(caches)

    def _joined(self, seq: Seq) -> None:
        if self.speculate and seq.context is not None and seq.drafter is None:
            seq.drafter = Drafter([*seq.context, seq.first])
        seq.caches = []  # the batch owns them now
        seq.joined_at = time.perf_counter()
        self.seqs.append(seq)
        self.peak_batch = max(self.peak_batch, len(self.seqs))

    def _step(self) -> None:
        """One forward pass for every active sequence. As in mlx-lm, the next step
        is queued (async_eval) before this one's tokens are read back; a row that
        may draft makes it a turn that reads them first (_draft_turn)."""
        assert self.next_tokens is not None
        drafting = (
            self.speculate
            and len(self.seqs) <= self.draft_rows
            and any(self._may_draft(s) for s in self.seqs)
        )
        if drafting and can_rewind(self.caches):
            self._draft_turn()
            return
        current, current_logprobs = self.next_tokens, self.next_logprobs
        tokens: list[int] = []
        if self.grammars is not None and any(s.matcher is not None for s in self.seqs):
            # The forward runs while the masks are computed: they need this
            # step's inputs (the tokens sampled last step), not its logits.
            logprobs = self._forward(current)
            mx.async_eval(logprobs)
            tokens = current.tolist()  # type: ignore[assignment]  # a [B] array
            self._sample(logprobs, self._masks(tokens))
        else:
            self._sample(self._forward(current), None)
        if not tokens:
            tokens = current.tolist()  # type: ignore[assignment]  # a [B] array
        self._stepped()
        for i, (seq, tid) in enumerate(zip(self.seqs, tokens, strict=True)):
            self._emit_input(seq, tid, current_logprobs, i)
        self._finish_rows()

    def _forward(self, current: mx.array) -> mx.array:
        """[B, vocab] logprobs after each row's one input token."""
        logits = self.model(current[:, None], cache=self.caches)[:, -1, :]
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _sample(self, logprobs: mx.array, allowed: mx.array | None) -> None:
        """The next step's inputs, queued (not read back)."""
        samplers = [s.sampler for s in self.seqs]
        pick = logprobs if allowed is None else mx.where(allowed, logprobs, -mx.inf)
        self.next_tokens = sample_rows(pick, samplers)
        self.next_logprobs = logprobs
        mx.async_eval(self.next_tokens, logprobs)

    def _masks(self, tokens: list[int]) -> mx.array | None:
        """The grammar rows' masks [B, vocab] after their matchers take `tokens`."""
        if self.grammars is None or all(s.matcher is None for s in self.seqs):
            return None
        return mx.array(self._advance(self.grammars, tokens))

    def _stepped(self) -> None:
        self.steps += 1
        # Steps are pipelined: one's length is the time between two read-backs.
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.chunks.observe_step(now - self._last_step_end)
        self._last_step_end = now

    def _emit_input(self, seq: Seq, tid: int, logprobs: mx.array | None, row: int) -> None:
        """A step's input token goes out (a fresh row's was sent already)."""
        if seq.fresh:
            seq.fresh = False
        elif not seq.done:
            lp = None
            if seq.want_logprobs and logprobs is not None:
                lp = np.array(logprobs[row].astype(mx.float32))
            self._emit(seq, tid, lp)

    def _emit(self, seq: Seq, tid: int, lp: np.ndarray | None) -> None:
        """One new token of `seq`: sent, or it ends the row (EOS, a grammar's end or
        failure, max_tokens)."""
        seq.produced += 1
        m = seq.matcher
        if tid in seq.eos or (m is not None and tid in m.eos):
            seq.done = True  # the stop token itself is not sent
        elif m is not None and m.failed:
            seq.out.put(RuntimeError(f"the output grammar failed: {m.failed}"))
            seq.done = True
        else:
            seq.out.put((tid, lp))
            if seq.drafter is not None:
                seq.drafter.append([tid])
            if seq.produced >= seq.max_tokens or (m is not None and m.finished):
                seq.done = True

    def _finish_rows(self) -> None:
        """Rows that ended leave the batch."""
        keep: list[int] = []
        for i, seq in enumerate(self.seqs):
            if seq.done:
                seq.out.put(None)
            else:
                keep.append(i)
        if len(keep) < len(self.seqs):
            self._keep(keep)

    # -- prompt-lookup drafts ------------------------------------------------------

    def _may_draft(self, seq: Seq) -> bool:
        d = seq.drafter
        return d is not None and not d.pause and seq.matcher is None and not seq.done

    def _draft_turn(self) -> None:
        """A step whose inputs are read back first: the rows' drafts continue from
        them. With drafts, one verify forward for every row; without, a plain step."""
        assert self.next_tokens is not None
        current, current_logprobs = self.next_tokens, self.next_logprobs
        tokens: list[int] = current.tolist()  # type: ignore[assignment]  # a [B] array
        allowed = self._masks(tokens)
        for i, (seq, tid) in enumerate(zip(self.seqs, tokens, strict=True)):
            self._emit_input(seq, tid, current_logprobs, i)
        drafts = [
            s.drafter.propose() if s.drafter is not None and self._may_draft(s) else []
            for s in self.seqs
        ]
        if any(drafts):
            self._verify(tokens, drafts, allowed)
        else:
            self._sample(self._forward(current), allowed)
        self._stepped()
        self._finish_rows()

    def _verify(self, tokens: list[int], drafts: list[list[int]], allowed: mx.array | None) -> None:
        """One forward over every row's input and draft; each row sends what it
        accepted, its next input is the model's own token after that, and the
        rejected positions leave the caches."""
        logprobs = verify(self.model, self.caches, tokens, drafts)  # [B, L, vocab]
        outs = judge(logprobs, drafts, [s.sampler for s in self.seqs], allowed)
        width = 1 + max(len(d) for d in drafts)
        garbage = [width - len(o) for o in outs]
        if self.batched:
            rewind_batch(self.caches, self.rows, garbage)
        else:
            rewind_plain(self.caches, garbage[0])
        self.verify_steps += 1
        for r, (seq, draft, out) in enumerate(zip(self.seqs, drafts, outs, strict=True)):
            if draft and seq.drafter is not None:
                seq.drafter.judged(len(draft), len(out) - 1)
                self.drafted += len(draft)
                self.accepted += len(out) - 1
            for j, tid in enumerate(out[:-1]):
                if seq.done:
                    break
                lp = np.array(logprobs[r, j].astype(mx.float32)) if seq.want_logprobs else None
                self._emit(seq, tid, lp)
        taken = mx.array([len(o) - 1 for o in outs])
        self.next_tokens = mx.array([o[-1] for o in outs], dtype=mx.uint32)
        self.next_logprobs = logprobs[mx.arange(len(outs)), taken]

    def _advance(self, grammars: Grammars, tokens: list[int]) -> np.ndarray:
        """Each matcher consumes its row's new token (a fresh row's `first` was
        consumed when it was sampled); returns the rows' allowed tokens [B, vocab]."""
        matchers: list[Matcher | None] = []
        for seq, tid in zip(self.seqs, tokens, strict=True):
            m = seq.matcher if not seq.done else None
            if m is not None and not seq.fresh:
                m.consume(tid)
            matchers.append(m)
        return grammars.masks(matchers)

    def _keep(self, keep: list[int]) -> None:
        if not keep and not self.batched:  # prefix save hook: a lone request ended
            for seq in self.seqs:
                self._release(seq, self.caches)
        if keep and self.rows is not None:
            self._leave_rows(keep)
            return
        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self.caches, self.batched, self.rows = [], False, None
            self.next_tokens = self.next_logprobs = None
            self._last_step_end = None
            release_memory()
            return
        assert self.next_tokens is not None
        idx = mx.array(keep)
        self.next_tokens = self.next_tokens[idx]
        if self.next_logprobs is not None:
            self.next_logprobs = self.next_logprobs[idx]
        if not self.batched:
            return
        if len(keep) == 1:  # back to plain caches: the single-stream fast path
            self.caches = [c.extract(keep[0]) for c in self.caches]
            self.batched = False
        else:
            for c in self.caches:
                c.filter(keep)

    # -- batchrows: preallocated rows (a join writes one, a departure moves one)
    def _start_batch(self, joining: int) -> None:
        """The lone stream's plain caches become the batch's first row."""
        if self.use_rows and any(type(c) is KVCache for c in self.caches):
            capacity = min(self.max_batch, max(4, 1 << joining.bit_length()))  # pow2 > joining
            self.rows = RowBatch(self.caches, capacity, self.max_batch)
            self.caches = self.rows.caches
        else:
            self.caches = [c.merge([c]) for c in self.caches]
        self.batched = True

    def _leave_rows(self, keep: list[int]) -> None:
        assert self.rows is not None and self.next_tokens is not None
        kept = set(keep)
        order = self.rows.leave([i for i in range(len(self.seqs)) if i not in kept])
        self.seqs = [self.seqs[i] for i in order]
        idx = mx.array(order)  # [B] and [B, vocab]: small beside the K/V rows
        self.next_tokens = self.next_tokens[idx]
        if self.next_logprobs is not None:
            self.next_logprobs = self.next_logprobs[idx]
        if len(order) == 1:  # back to plain caches: the single-stream fast path
            self.caches = self.rows.extract(0)
            self.rows, self.batched = None, False


def own_copy(cache: Any) -> Any:
    """The same cache state in arrays of its own (capacity kept, so decoding
    still writes in place)."""
    new = copy.copy(cache)
    if getattr(cache, "keys", None) is not None:
        new.keys, new.values = mx.array(cache.keys), mx.array(cache.values)
    return new
