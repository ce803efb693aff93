"""Continuous batching for one autoregressive stage: admit into slots, pick a batch, retire.

There is no prefill or decode phase on a request: each has `num_computed_tokens` catching up with
its token count. A step is either a prefill batch (prompt chunks within `max_num_batched_tokens`)
or a decode batch (one token per running request); when both are waiting they alternate, so a
long prompt never stalls the decoders for more than one step, and that step is bounded by the budget.

With a `Priority` (`omnirt/pipeline/stage/priority.py`, first packet first) every KV slot may hold a running request,
more than a step's `max_num_seqs` rows where the memory plan gave the stage more slots: a new request is
placed and prefilled at once instead of waiting for a slot, and each step takes the rows the policy ranks
first (requests left out too long, then those still owed their first packet, then the longest waiting).
Without one, at most `max_num_seqs` requests hold a slot and every runnable one is in each step.

With a `PrefixReuse` a request is placed in the resident slot that holds the longest start of its
prompt, and its prefill begins after it (`omnirt/pipeline/stage/prefix_cache.py`); an ended request's slot stays
resident unless it failed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from omnirt.pipeline.stage.host_tier import Offloaded
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.prefix_cache import Held, PrefixReuse
from omnirt.pipeline.stage.priority import Priority, WaitCounts, in_arrival_order, ranked
from omnirt.pipeline.stage.protocols import PLACEMENTS, PrefixStats
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.step import Batch, RowOutput


class SlotScheduler:
    def __init__(self, kv: SlotKVCache, max_num_seqs: int, max_num_batched_tokens: int, eos_ids: list[int],
                 is_ready: Callable[[StageRequest], bool], reuse: PrefixReuse | None = None,
                 priority: Priority | None = None):
        self.kv = kv
        self.max_num_seqs = min(max_num_seqs, kv.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_ids = set(eos_ids)
        self.is_ready = is_ready  # may the request take its next step (its inputs have arrived)?
        self.reuse = reuse  # None: every slot is freed when its request ends
        self.priority = priority  # None: arrival order, at most max_num_seqs requests hold a slot
        self.max_num_running = kv.num_slots if priority is not None else self.max_num_seqs  # requests with a slot
        self.waits = WaitCounts()
        self.waiting: deque[StageRequest] = deque()
        self.running: list[StageRequest] = []
        self._last_was_prefill = False
        self.num_prefill_tokens = 0  # prompt tokens computed by prefill steps
        self.num_cached_tokens = 0  # prompt tokens taken from resident slots (or the host tier) instead
        self.num_restored_tokens = 0  # of those, copied back from the host tier
        # how each request got its slot: a free or given-up one (fresh), a resident match taken over or copied, a
        # prefix copied back from the host tier; a conversation whose turns keep taking their slot over holds one
        self.placements = dict.fromkeys(PLACEMENTS, 0)
        self._hits: list[tuple[str, int]] = []  # (request id, tokens reused) of hits not yet reported

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_slots(self) -> int:
        return self.kv.num_free_slots

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    def prefix_stats(self) -> PrefixStats:
        held, host = list(self.kv.resident.values()), self.kv.host
        return PrefixStats(self.num_prefill_tokens, self.num_cached_tokens, len(held), sum(h.num_bytes for h in held),
                           len(host.entries) if host else 0, host.num_bytes if host else 0, self.num_restored_tokens,
                           dict(self.placements), self.kv.num_given_up)

    def take_cached(self) -> list[tuple[str, int]]:
        hits, self._hits = self._hits, []
        return hits

    def add(self, req: StageRequest) -> None:
        self.waiting.append(req)

    def schedule(self) -> Batch | None:
        self._admit()
        ready = [r for r in self.running if self._may_step(r)]
        prefill = [r for r in ready if r.is_prefill]
        decode = [r for r in ready if not r.is_prefill]
        self._last_was_prefill = bool(prefill) and not (decode and self._last_was_prefill)
        kind = prefill if self._last_was_prefill else decode
        if not kind:
            return None
        batch = self._prefill_batch(kind) if self._last_was_prefill else self._decode_batch(kind)
        runnable = ready + [r for r in self.waiting if self.is_ready(r)]
        self.waits.account(runnable, batch.requests, len(kind) - len(batch.requests))
        return batch

    def _may_step(self, req: StageRequest) -> bool:
        """Its next step's inputs are there. With a token in flight (async scheduling) it steps again unless
        that token is sure to end it (its last by max_tokens), a grammar must see it first, or a second one is
        in flight; a token that turns out to end it (EOS) makes the step after it void (`update` skips it)."""
        if req.num_pending and (req.num_pending > 1 or req.constraint is not None
                                or req.num_outputs >= req.sampling.max_tokens):
            return False
        return self.is_ready(req)

    def _admit(self) -> None:
        """Give slots to waiting requests whose first input is there, oldest first."""
        for req in list(self.waiting):
            if len(self.running) >= self.max_num_running:
                break
            if self.is_ready(req):
                self.waiting.remove(req)
                self._place(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)

    def _place(self, req: StageRequest) -> None:
        """Give `req` a slot: the resident one holding the longest start of its prompt, taken over when that
        covers the ended request's prompt, else copied into another slot (a free one, or the least recently
        used resident one) so that the rest stays for whoever continues it; a prefix in the host tier is copied
        back into a slot the same way; without any, a free slot."""
        found = self._lookup(req)
        if found is None:
            req.slot = self.kv.allocate()
            self.placements["fresh"] += 1
            return
        source, n = found
        if isinstance(source, Offloaded):
            held = self._restore(req, source, n)
            self.placements["restored"] += 1
        else:
            held = self.kv.resident[source]
            spare = self.kv.spare(keep=source) if n < held.num_prompt_tokens else None
            if spare is None:
                self.kv.claim(source)
                req.slot = source
            else:
                self.kv.touch(source)
                self.kv.copy_prefix(source, spare, n)
                req.slot = spare
            self.placements["taken_over" if spare is None else "copied"] += 1
        self.reuse.adopt(req, held, n)
        req.num_computed_tokens = req.num_cached_tokens = n
        self.num_cached_tokens += n
        self._hits.append((req.request_id, n))

    def _restore(self, req: StageRequest, entry: Offloaded, n: int) -> Held:
        """A slot for `req` with the first `n` positions of an offloaded prefix copied back into it; the prefix
        stays in the host tier for whoever continues it unless `req` takes all of its prompt. Out of the tier
        while a slot is found: the slot's own prefix may go there meanwhile, and must not push this one out."""
        self.kv.host.take(entry)
        req.slot = self.kv.allocate()
        held = self.kv.restore(entry, req.slot, n)
        if n < entry.held.num_prompt_tokens:
            self.kv.host.add(entry)
        self.num_restored_tokens += n
        return held

    def _lookup(self, req: StageRequest) -> tuple[int | Offloaded, int] | None:
        """(resident slot or offloaded prefix, positions of the prompt it has) with the most, if any (a resident
        slot wins a tie); the prompt's last token is always left to compute (its logits start the reply)."""
        key = self.reuse.key(req) if self.reuse is not None else None
        host = self.kv.host.entries if self.kv.host is not None else {}
        if key is None or not (self.kv.resident or host):
            return None
        n, source = -1, None
        # most recently used first: it wins ties
        for where, held in [*reversed(self.kv.resident.items()), *((e, e.held) for e in reversed(host))]:
            matched = self.reuse.match(held, key)
            if matched > n:
                n, source = matched, where
                if n >= req.num_prompt_tokens:  # the whole prompt: no slot can match more
                    break
        n = min(n, req.num_prompt_tokens - 1)
        return (source, n) if n > 0 else None

    def _prefill_batch(self, reqs: list[StageRequest]) -> Batch:
        """Prompt chunks of the first-ranked requests within the token budget."""
        counts, budget = {}, self.max_num_batched_tokens
        for req in ranked(self.priority, reqs, _is_owed)[: self.max_num_seqs]:
            n = min(req.num_prompt_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                break
            counts[id(req)] = n
            budget -= n
        chosen = [r for r in reqs if id(r) in counts]
        return Batch(chosen, [counts[id(r)] for r in chosen], is_prefill=True)

    def _decode_batch(self, reqs: list[StageRequest]) -> Batch:
        chosen = in_arrival_order(ranked(self.priority, reqs, _is_owed)[: self.max_num_seqs], reqs)
        return Batch(chosen, [1] * len(chosen), is_prefill=False)

    def launched(self, batch: Batch) -> None:
        """A step was issued: its positions count as computed, and each row past its prompt has a token in
        flight until `update` applies it (at once, or after the next step was issued: async scheduling)."""
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            if batch.is_prefill:
                self.num_prefill_tokens += n
            if not req.is_prefill:
                req.num_pending += 1

    def update(self, batch: Batch, outputs: list[RowOutput]) -> list[StageRequest]:
        """Apply a launched step's results; returns the requests that finished in it (slots already freed)."""
        finished = []
        for req, out in zip(batch.requests, outputs, strict=True):
            if req.status.is_finished:  # aborted while the step ran, or ended by the step before it
                continue
            if out.token is not None:
                req.num_pending -= 1
                req.output_ids.append(out.token)
                self._check_stop(req)
            if req.status.is_finished:
                self._retire(req)
                finished.append(req)
        return finished

    def _check_stop(self, req: StageRequest) -> None:
        if req.output_ids[-1] in self.eos_ids:
            req.status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_ids) >= req.sampling.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH

    def finish(self, req: StageRequest, status: RequestStatus) -> None:
        """End a request from outside a step (abort, error, or no work left)."""
        if req.status.is_finished:
            return
        req.status = status
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._retire(req)

    def _retire(self, req: StageRequest) -> None:
        """Out of the running set; its slot stays resident with what it holds unless it failed (its KV is
        then not known to be whole)."""
        if req in self.running:
            self.running.remove(req)
        if req.slot is None:
            return
        ok = self.reuse is not None and req.status is not RequestStatus.FINISHED_ERROR
        held = self.reuse.held(req) if ok else None
        if held is not None and held.num_tokens > 0:
            self.kv.park(req.slot, held)
        else:
            self.kv.free(req.slot)
        req.slot = None


def _is_owed(req: StageRequest) -> bool:
    return req.is_owed_first_packet
