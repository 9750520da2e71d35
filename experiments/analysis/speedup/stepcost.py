"""Step-cost profiles: what one engine step costs, measured per engine, release, model, site and flags, never
assumed. Read from finished runs' records (one streamed chunk per engine step), fitted per CUDA-graph regime:

    decode(c)            = a + b_seq * c                                  (baseline runs)
    verify excess(c, q)  = over + over_seq * c + b_tok * c * (q - 1)       (n-gram runs, over their paired baseline)
    EAGLE-3 excess       = over_e + over_seq_e * c + b_tok * c * (q - 1) + draft_ms * draft steps

The excess terms are fitted in one of two units: `base` (the default), fractions of the paired baseline's own decode
step at the same level, so that a profile carries from one host to another as the host's baseline moves; or `ms`,
absolute milliseconds, true only on the host state that measured them. The decode terms stay in ms: they say which
baseline speeds each host (lease) of the profile ran at; a forecast uses the hosts near its own baseline
(`StepCostProfile.nearest_hosts`) and predicts nothing where none is.

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
UNITS = ("base", "ms")
# a baseline this much faster or slower than any the profile saw is on a host outside it. 2.0 measured as 1.5 did on
# the committed leases (22.5 against 22.8 % mean |error| across hosts, 84 against 85 % covered, 0 opposite); 2.5
# admits a pair of leases 2x apart whose within-lease forecasts cover 10 of 24 (docs/reference/forecast.md)
HOST_TOLERANCE = 2.0
MIN_GAPS = 20          # chunk intervals a level needs before its step time counts


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
    ttft_ms: float | None = None        # mean time to first token over the level's requests
    base_ttft_ms: float | None = None

    @property
    def excess_ms(self) -> float | None:
        return None if self.base_step_ms is None else self.step_ms - self.base_step_ms


def mean_step_ms(gaps: np.ndarray) -> float:
    """Mean streamed-chunk interval (ms), every interval counted: the pauses for other requests' prefill are part of
    what a step costs a request that lives through them."""
    return float(1000.0 * gaps.mean())


def chunk_gaps(record: dict) -> list[float]:
    """The intervals (s) between a record's streamed chunks."""
    t = record.get("chunk_times_s") or []
    return [b - a for a, b in zip(t, t[1:], strict=False)]


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
    if config.arrival != "closed":
        return []   # open-loop arrivals: a level's batch is not its concurrency cap
    gaps: dict[int, list[float]] = {}
    ttfts: dict[int, list[float]] = {}
    for r in run_records(client, run.info.run_id) or []:
        c = r.get("concurrency")
        if c and not r.get("error"):
            gaps.setdefault(int(c), []).extend(chunk_gaps(r))
            if r.get("ttft_s"):
                ttfts.setdefault(int(c), []).append(1000.0 * r["ttft_s"])
    cap = config.graph_batch_limit
    draft_steps = (config.spec.num_steps or 0) if config.spec.method == "eagle3" else 0
    out = []
    for c, g in sorted(gaps.items()):
        q = verified_at(config, run.data.metrics, c)
        if len(g) >= MIN_GAPS and q is not None:
            out.append(LevelStep(run.info.run_id, lease, config.spec.method, c, q, draft_steps,
                                 mean_step_ms(np.asarray(g)), regime_of(c, cap),
                                 ttft_ms=float(np.mean(ttfts[c])) if ttfts.get(c) else None))
    return out


def level_steps(client, runs, lease: str = "") -> list[LevelStep]:
    """Every level of every run, speculative ones paired with their baseline's step time at the same c."""
    steps = {run.info.run_id: run_level_steps(client, run, lease) for run in runs}
    baselines = {r.info.run_id: r.data.tags.get("specws.baseline_run_id") for r in runs}
    for run_id, levels in steps.items():
        base = {s.c: s for s in steps.get(baselines[run_id] or "", []) if s.method == "none"}
        for s in levels:
            if s.method != "none" and s.c in base:
                s.base_step_ms, s.base_ttft_ms = base[s.c].step_ms, base[s.c].ttft_ms
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
    unit: str = "ms"               # of the excess terms: ms, or `base` (fractions of the baseline's decode step)
    host_range: list[float] | None = None   # measured baseline step / fitted decode(c), lowest and highest (shown)
    unseparated: list[str] = field(default_factory=list)   # terms the runs could not tell apart (set from others)
    ttft_ratio: dict[str, float] = field(default_factory=dict)   # per method: its TTFT over the paired baseline's
    host_residual_rel: float = 0.0   # the same RMS on each host under terms fitted on the others (a host never seen)

    def decode_ms(self, c: float) -> float | None:
        if self.decode_a_ms is None:
            return None
        return self.decode_a_ms + (self.decode_b_seq_ms or 0.0) * c

    def excess(self, method: str, c: float, q: float, draft_steps: int = 0) -> float | None:
        """Step time over the baseline's at the same c, in the regime's unit; None where a term it needs is
        missing."""
        if method == "none" or q <= 1 and not draft_steps:
            return 0.0
        if self.b_tok_ms is None or method == "ngram" and self.over_ms is None:
            return None   # no run of this method in the regime: a missing term is not a zero
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
    else:
        b, a = np.polyfit(cs, ts, 1)
        cost.decode_a_ms, cost.decode_b_seq_ms = float(max(a, 0.0)), float(max(b, 0.0))
    ratios = [p.step_ms / cost.decode_ms(p.c) for p in base if cost.decode_ms(p.c)]
    cost.host_range = [float(min(ratios)), float(max(ratios))] if ratios else None


def _unit_of(p: LevelStep, unit: str) -> float:
    """What one unit of the excess is worth at this point, in ms."""
    return 1.0 if unit == "ms" else float(p.base_step_ms or 0.0)


def _excess_rows(points: list[LevelStep], method: str, unit: str) -> list[LevelStep]:
    return [p for p in points if p.method == method and p.excess_ms is not None and _unit_of(p, unit) > 0
            and (method != "eagle3" or p.draft_steps)]


def _fit_verify(points: list[LevelStep], cost: RegimeCost) -> None:
    rows = _excess_rows(points, "ngram", cost.unit)
    if not rows:
        return
    c, q = np.array([p.c for p in rows], float), np.array([p.q for p in rows], float)
    y = np.array([p.excess_ms / _unit_of(p, cost.unit) for p in rows])
    drops = [[], ["over_seq"], ["over"], ["over", "over_seq"]]
    coef = nonneg_lstsq({"over": np.ones_like(c), "over_seq": c, "b_tok": c * (q - 1)}, y, drops)
    if coef is not None:
        cost.over_ms, cost.over_seq_ms, cost.b_tok_ms = coef["over"], coef["over_seq"], coef["b_tok"]
        cost.unseparated += _unseparated(c, q, "over_seq", "b_tok")


def _unseparated(c: np.ndarray, second: np.ndarray, per_seq: str, other: str) -> list[str]:
    """The growth terms one concurrency (or one draft length) cannot tell from the fixed cost."""
    return ([per_seq] if len(set(c)) == 1 else []) + ([other] if len(set(second)) == 1 else [])


def _fit_eagle(points: list[LevelStep], cost: RegimeCost) -> None:
    rows = _excess_rows(points, "eagle3", cost.unit)
    if not rows:
        return
    c, d = np.array([p.c for p in rows], float), np.array([p.draft_steps for p in rows], float)
    y = np.array([p.excess_ms / _unit_of(p, cost.unit) - (cost.b_tok_ms or 0.0) * p.c * (p.q - 1) for p in rows])
    if cost.b_tok_ms is None:
        cost.b_tok_ms = 0.0   # no n-gram run: verification is folded into the EAGLE-3 terms
        cost.unseparated.append("b_tok")
    coef = nonneg_lstsq({"over": np.ones_like(c), "over_seq": c, "draft": d}, y,
                        [[], ["over_seq"], ["draft"], ["over_seq", "draft"]])
    if coef is not None and len(set(zip(c, d, strict=True))) > 1:
        cost.eagle_over_ms, cost.eagle_over_seq_ms, cost.draft_ms = coef["over"], coef["over_seq"], coef["draft"]
        cost.unseparated += _unseparated(c, d, "eagle_over_seq", "draft")
        return
    # one (c, steps) point: the n-gram overhead stands for EAGLE-3's own, the rest is the draft's
    over, over_seq = cost.over_ms or 0.0, cost.over_seq_ms or 0.0
    cost.eagle_over_ms, cost.eagle_over_seq_ms = over, over_seq
    cost.draft_ms = float(max(0.0, np.median((y - over - over_seq * c) / d)))
    cost.unseparated += ["eagle_over_seq", "draft"]


def _ttft_ratios(points: list[LevelStep]) -> dict[str, float]:
    """Per speculative method: the median of its TTFT over its baseline's at the same level (an EAGLE-3 prefill also
    runs the draft; a new request's prefill waits behind slower speculative steps)."""
    out: dict[str, list[float]] = {}
    for p in points:
        if p.method != "none" and p.ttft_ms and p.base_ttft_ms:
            out.setdefault(p.method, []).append(p.ttft_ms / p.base_ttft_ms)
    return {m: float(np.median(v)) for m, v in out.items()}


def _residual(points: list[LevelStep], cost: RegimeCost) -> float:
    errs = []
    for p in points:
        fit = cost.excess(p.method, p.c, p.q, p.draft_steps)
        if p.method != "none" and p.base_step_ms is not None and fit is not None:
            errs.append((p.base_step_ms + fit * _unit_of(p, cost.unit) - p.step_ms) / p.step_ms)
    return float(np.sqrt(np.mean(np.square(errs)))) if errs else 0.0


def fit_regime(points: list[LevelStep], unit: str = "base") -> RegimeCost:
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r}: one of {', '.join(UNITS)}")
    cost = RegimeCost(points=[asdict(p) for p in points], unit=unit)
    _fit_decode(points, cost)
    _fit_verify(points, cost)
    _fit_eagle(points, cost)
    cost.unseparated = sorted(set(cost.unseparated))
    cost.ttft_ratio = _ttft_ratios(points)
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

    def unit(self) -> str:
        return next(iter(self.regimes.values())).unit if self.regimes else "base"

    def hosts_at(self, c: int, cap: int | None = None) -> dict[str, float]:
        """Each host (lease) the profile was fitted on -> its baseline's decode step at level c (ms), from its own
        baseline runs in the level's regime."""
        regime = self.regime(c, cap)[1]
        by_lease: dict[str, list[tuple[int, float]]] = {}
        for p in (regime.points if regime is not None else []):
            if p["method"] == "none":
                by_lease.setdefault(p.get("lease") or "", []).append((p["c"], p["step_ms"]))
        out = {}
        for lease, pts in by_lease.items():
            cs, ts = np.array([x for x, _ in pts], float), np.array([t for _, t in pts])
            if c in cs:
                out[lease] = float(ts[cs == c].mean())
                continue
            a, b = (float(ts.mean()), 0.0) if len(set(cs)) == 1 else tuple(np.polyfit(cs, ts, 1)[::-1])
            out[lease] = max(float(a + b * c), 1e-9)
        return out

    def nearest_hosts(self, c: int, step_ms: float, cap: int | None = None,
                      band: float = HOST_TOLERANCE) -> tuple[StepCostProfile | None, str]:
        """The profile refitted on the hosts whose baseline ran within `band` times `step_ms` at level c (itself
        where every host did, or where the hosts are unknown), and a note; None with the reason where none did."""
        hosts = self.hosts_at(c, cap)
        if not hosts:
            return self, ""
        near = {h for h, ms in hosts.items() if 1 / band <= step_ms / ms <= band}
        seen = ", ".join(f"{h or 'unnamed'} {ms:.1f} ms" for h, ms in sorted(hosts.items(), key=lambda kv: kv[1]))
        if not near:
            return None, (f"host outside the profile: this baseline's decode step at c={c} is {step_ms:.1f} ms; the "
                          f"hosts the profile was fitted on ran {seen} (within {band}x counts)")
        if near == set(hosts):
            return self, ""
        points = [LevelStep(**p) for r in self.regimes.values() for p in r.points if (p.get("lease") or "") in near]
        refit = fit_profile(self.key, points, self.graph_cap, self.note, self.unit())
        return refit, f"c={c}: step costs of the hosts nearest this one ({', '.join(sorted(near))}; of {seen})"

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
            terms = {k: v for k, v in asdict(r).items() if isinstance(v, float) and k != "residual_rel"}
            hosts = "" if r.host_range is None else \
                f", hosts {r.host_range[0]:.2f}-{r.host_range[1]:.2f}x the decode fit"
            parts.append(f"{name} (excess in {'ms' if r.unit == 'ms' else 'baseline steps'}): "
                         + ", ".join(f"{k} {v:.3g}" for k, v in terms.items())
                         + f" (residual {100 * r.residual_rel:.0f} %{hosts})")
        return "; ".join(parts)


def _host_residual(points: list[LevelStep], unit: str) -> float:
    """RMS relative error of the speculative steps of each host (lease) under terms fitted on the other hosts: what
    the terms miss on a host they never saw (0 with fewer than two hosts)."""
    leases = {p.lease for p in points}
    if len(leases) < 2:
        return 0.0
    errs = []
    for lease in leases:
        cost = fit_regime([p for p in points if p.lease != lease], unit)
        for p in points:
            fit = cost.excess(p.method, p.c, p.q, p.draft_steps) if p.lease == lease else None
            if fit is not None and p.method != "none" and p.base_step_ms is not None:
                errs.append((p.base_step_ms + fit * _unit_of(p, unit) - p.step_ms) / p.step_ms)
    return float(np.sqrt(np.mean(np.square(errs)))) if errs else 0.0


def fit_profile(key: ProfileKey, steps: list[LevelStep], graph_cap: int | None, note: str = "",
                unit: str = "base") -> StepCostProfile:
    regimes = {}
    for name in ("all", "graphs", "eager"):
        pts = [s for s in steps if s.regime == name]
        if pts:
            regimes[name] = fit_regime(pts, unit)
            regimes[name].host_residual_rel = _host_residual(pts, unit)
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
