"""vLLM's prompt-lookup n-gram proposer replayed over recorded greedy outputs, every position of a workload
at once (the algorithm behind experiments/analysis/replay.py, which documents the rule it reproduces).

n-gram ids per length (an unstable sort of packed keys; the request index in the key keeps matches inside a
request), the earliest occurrence of each id, then the draft and its accepted length at every output
position with numpy; only the jump from step to step is a Python loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from experiments.engines.base import Acceptance, acceptance_from_positions

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class NgramConfig:
    min_match: int
    max_match: int
    k: int

    @property
    def label(self) -> str:
        return f"min{self.min_match}_max{self.max_match}_k{self.k}"


@dataclass
class ReplaySequence:
    prompt_ids: list[int]
    output_ids: list[int]
    prompt_id: str = ""
    concurrency: int = 0
    repetition: int = 0
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)


@dataclass
class ReplayStats:
    """Counters in vLLM's terms; `accepted_upper` also counts draft tokens past the recorded end as
    accepted (the engine compares them with tokens the record does not have)."""
    steps: int = 0                  # decode steps after prefill
    drafts: int = 0                 # steps that carried a draft
    draft_tokens: int = 0
    accepted: int = 0
    accepted_upper: int = 0
    output_tokens: int = 0
    decode_tokens: int = 0          # output tokens after the first (which prefill emits)
    per_pos: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # tokens per step, prefill's first token included
    verified: list[int] = field(default_factory=list)  # draft tokens verified by each decode step

    def add(self, other: ReplayStats) -> None:
        self.steps += other.steps
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.accepted_upper += other.accepted_upper
        self.output_tokens += other.output_tokens
        self.decode_tokens += other.decode_tokens
        if len(other.per_pos) > len(self.per_pos):
            self.per_pos += [0] * (len(other.per_pos) - len(self.per_pos))
        for i, c in enumerate(other.per_pos):
            self.per_pos[i] += c

    def acceptance(self) -> Acceptance | None:
        return acceptance_from_positions(self.drafts, self.draft_tokens, self.accepted,
                                         [float(c) for c in self.per_pos])

    def metrics(self) -> dict[str, float]:
        acc = self.acceptance()
        out = {"steps": float(self.steps), "drafts": float(self.drafts),
               "draft_tokens": float(self.draft_tokens), "accepted": float(self.accepted),
               "accepted_upper": float(self.accepted_upper),
               "steps_with_draft": self.drafts / self.steps if self.steps else 0.0,
               # tokens per decode step, steps without a draft included: what throughput sees
               "tokens_per_step": self.decode_tokens / self.steps if self.steps else 1.0}
        if acc is not None:
            out |= {"accept_length": acc.accept_length, "acceptance_rate": acc.acceptance_rate}
            out |= {f"accept_pos_{i}": p for i, p in enumerate(acc.per_position)}
        return out


class NgramIndex:
    """The workload's tokens (prompt + output per request, concatenated) and, per n-gram length L, the
    earliest start of the L-gram that starts at every position. Queries (contexts a step can start from)
    are the output positions only: from the second output token to the last."""

    def __init__(self, sequences: list[ReplaySequence], max_len: int):
        lengths = np.array([len(s.prompt_ids) + len(s.output_ids) for s in sequences], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.ends = self.starts + lengths
        self.prompt_lens = np.array([len(s.prompt_ids) for s in sequences], dtype=np.int64)
        self.tokens = np.concatenate([np.asarray(part, dtype=np.int64) for s in sequences
                                      for part in (s.prompt_ids, s.output_ids)] or [np.zeros(0, np.int64)])
        request = np.repeat(np.arange(len(sequences), dtype=np.int64), lengths)
        # query positions n: the context is tokens[start:n]; the first output token comes from prefill
        first_query = self.starts + self.prompt_lens + 1
        counts = np.maximum(self.ends - first_query, 0)
        self.block_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.block_ends = self.block_starts + counts
        self.query_request = np.repeat(np.arange(len(sequences), dtype=np.int64), counts)
        self.query = first_query[self.query_request] + (np.arange(int(counts.sum()), dtype=np.int64)
                                                        - self.block_starts[self.query_request])
        self.query_start = self.starts[self.query_request]
        self.query_end = self.ends[self.query_request]
        self._request = request
        self.earliest: list[np.ndarray] = []   # earliest[L-1][j]: first start of the L-gram tokens[j:j+L]
        self._codes: np.ndarray | None = None
        self.extend(max_len)

    def extend(self, max_len: int) -> None:
        n = len(self.tokens)
        while len(self.earliest) < max_len and n:
            if self._codes is None:   # the request index in the key keeps matches inside one request
                key = self._request * (int(self.tokens.max()) + 1) + self.tokens
            else:
                length = len(self.earliest) + 1
                # windows running past the array end get a key no real window has
                pad = np.full(min(length - 1, n), self._unigram_count)
                tail = np.concatenate([self._unigrams[length - 1:], pad])
                key = self._codes * (self._unigram_count + 1) + tail
            codes, earliest = _dense_ids(key)
            if self._codes is None:
                self._unigrams, self._unigram_count = codes, int(codes.max()) + 1
            self._codes = codes
            self.earliest.append(earliest)

    def proposals(self, cfg: NgramConfig, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(draft start, draft length) at every query position (length 0: no draft)."""
        self.extend(cfg.max_match)
        n = self.query
        best = np.zeros(len(n), dtype=np.int64)
        start = np.zeros(len(n), dtype=np.int64)
        for length in range(1, cfg.max_match + 1):
            j = n - length                     # queries start after the prompt, so j >= request start
            earliest = self.earliest[length - 1][j]
            found = earliest < j               # an occurrence before the suffix itself
            best[found] = length
            start[found] = earliest[found] + length
        room = np.minimum(n - start, max_model_len - (n - self.query_start))
        draft_len = np.where(best >= cfg.min_match, np.clip(np.minimum(cfg.k, room), 0, None), 0)
        return start, draft_len

    def accepted(self, start: np.ndarray, draft_len: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Accepted draft tokens at every query (recorded tokens only) and the upper bound that also
        accepts draft tokens past the recorded end when everything before them matched."""
        n = self.query
        left = self.query_end - n
        ok = np.ones(len(n), dtype=bool)
        acc = np.zeros(len(n), dtype=np.int64)
        last = len(self.tokens) - 1
        for i in range(k):
            ok &= (i < draft_len) & (i < left)
            if not ok.any():
                break
            ok &= self.tokens[np.minimum(start + i, last)] == self.tokens[np.minimum(n + i, last)]
            acc += ok
        upper = np.where((acc == np.minimum(left, draft_len)) & (draft_len > left), draft_len, acc)
        return acc, upper


def _dense_ids(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dense id of every key, earliest index holding the same key); an unstable sort plus a per-group
    minimum is several times faster than np.unique's stable sort here."""
    order = np.argsort(key)
    ordered = key[order]
    new = np.empty(len(key), dtype=bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    group_starts = np.flatnonzero(new)
    first = np.minimum.reduceat(order, group_starts)
    gid_sorted = np.cumsum(new) - 1
    codes = np.empty_like(order)
    codes[order] = gid_sorted
    return codes, first[codes]


def replay_config(index: NgramIndex, cfg: NgramConfig, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                  keep_emitted: bool = False) -> list[ReplayStats]:
    """Per-request counters for one configuration."""
    start, draft_len = index.proposals(cfg, max_model_len)
    acc, upper = index.accepted(start, draft_len, cfg.k)
    jump_arr = np.where(draft_len > 0, acc + 1, 1)
    jump = jump_arr.tolist()
    visited: list[int] = []
    append = visited.append
    for b, e in zip(index.block_starts.tolist(), index.block_ends.tolist(), strict=True):
        while b < e:
            append(b)
            b += jump[b]
    v = np.asarray(visited, dtype=np.int64)
    req = index.query_request[v]
    n_req = len(index.starts)
    drafted = draft_len[v] > 0
    a = np.where(drafted, acc[v], 0)

    def per_request(weights) -> list[int]:
        return np.bincount(req, weights=weights, minlength=n_req).astype(np.int64).tolist()

    steps, drafts = per_request(None), per_request(drafted)
    draft_tokens, accepted = per_request(draft_len[v]), per_request(a)
    accepted_upper = per_request(np.where(drafted, upper[v], 0))
    per_pos = [per_request(a > i) for i in range(cfg.k)]
    outputs = (index.ends - index.starts - index.prompt_lens).tolist()
    out = []
    for r in range(n_req):
        stats = ReplayStats(steps=steps[r], drafts=drafts[r], draft_tokens=draft_tokens[r], accepted=accepted[r],
                            accepted_upper=accepted_upper[r], output_tokens=outputs[r],
                            decode_tokens=max(0, outputs[r] - 1), per_pos=[p[r] for p in per_pos])
        if keep_emitted and outputs[r]:
            mine = v[req == r]
            stats.emitted = [1, *np.minimum(jump_arr[mine], index.query_end[mine] - index.query[mine]).tolist()]
            stats.verified = draft_len[mine].tolist()
        out.append(stats)
    return out


def total(stats: list[ReplayStats]) -> ReplayStats:
    agg = ReplayStats()
    for s in stats:
        agg.add(s)
    return agg
