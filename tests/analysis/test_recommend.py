"""The recommendation per load on recorded runs (tests/analysis/leases.py): the H200 lease of 2026-12-01, where no
configuration paid at any level, and the vLLM-CPU lease of 2026-12-03, where option A paid at c = 1 and 4 (and
breaks a 2.18 s TTFT target at c = 1, where its TTFT p99 was 2.198 s against the baseline's 2.172 s). Where a case
needs a configuration that pays, the H200 baseline's request times are stretched by a known factor: the options'
records, and so the spread between them, stay as measured."""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import VLLM_PYTHON
from mlflow.tracking import MlflowClient

from experiments.analysis.recommend import Recommendation, build, main
from experiments.analysis.recommend.decision import (
    DECIDED,
    INCONCLUSIVE,
    NO_SPECULATION,
    Candidate,
    Load,
    choice_label,
    decide,
)
from experiments.analysis.report import select_runs
from experiments.analysis.runs import run_config
from experiments.analysis.stats import paired_speedup, prompt_totals
from experiments.tracking.records import run_records
from tests.analysis import leases
from tests.analysis.leases import CPU_EXPERIMENT, H200_EXPERIMENT, copy_store

cpu_store, h200_store = leases.cpu_store, leases.h200_store


@pytest.fixture(scope="module")
def grounded(h200_store: str) -> tuple[dict[str, tuple[dict, list[dict]]], list[dict]]:
    """The H200 lease's grounded runs: short name -> (spec, records) per option run, and the baseline's records."""
    client = MlflowClient(h200_store)
    exp = client.get_experiment_by_name(H200_EXPERIMENT)
    runs = [r for r in client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'measure'")
            if r.data.tags.get("specws.workload") == "grounded" and r.data.tags["specws.option"] != "baseline"]
    (base_id,) = {r.data.tags["specws.baseline_run_id"] for r in runs}
    options = {choice_label(run_config(r)): (dataclasses.asdict(run_config(r).spec), run_records(client, r.info.run_id))
               for r in runs}
    return options, run_records(client, base_id)


def candidates(grounded, c: int, slower: float, labels: tuple[str, ...]) -> list[Candidate]:
    """The named options at level c against the baseline with every request `slower` times as long."""
    options, base = grounded
    ref = prompt_totals([{**r, "e2e_s": r["e2e_s"] * slower} for r in base if r["concurrency"] == c])
    out = []
    for label in labels:
        spec, records = options[label]
        totals = prompt_totals([r for r in records if r["concurrency"] == c])
        out.append(Candidate(label, label, label.split()[0], "sglang", spec, paired_speedup(totals, ref), totals))
    return out


def recommendation(grounded, slower: dict[int, float], labels: tuple[str, ...]) -> Recommendation:
    decisions = [decide(Load("closed", None, c), candidates(grounded, c, s, labels)) for c, s in slower.items()]
    return Recommendation("grounded", "grounded", {}, decisions)


def test_nothing_pays_on_the_h200_lease_so_no_speculation_at_every_level(h200_store: str) -> None:
    client = MlflowClient(h200_store)
    options, all_runs, _, _ = select_runs(client, H200_EXPERIMENT)
    recs = {r.workload: r for r in build(client, options, all_runs)}
    assert set(recs) == {"chat", "grounded", "mixed"}
    for rec in recs.values():
        assert all(d.choice == NO_SPECULATION and d.status == DECIDED for d in rec.decisions)
        assert all(c.speedup.high < 1.0 for d in rec.decisions for c in d.candidates)
    assert recs["grounded"].as_dict()["summary"] == "no speculation at c = 1–8"
    assert {c.label for d in recs["chat"].decisions for c in d.candidates} == {"A k=2", "A k=4", "A k=8", "B steps=3"}
    assert recs["grounded"].as_dict()["schedule"] == {"needed": False}


def test_two_paying_candidates_the_intervals_cannot_separate_are_inconclusive(grounded) -> None:
    """Against a baseline twice as slow, A at 8 and at 4 draft tokens both pay at c = 1 (1.18x and 1.17x); paired
    on the same 21 prompts, 8 over 4 is 1.01x [0.98, 1.05]: not separated."""
    d = decide(Load("closed", None, 1), candidates(grounded, 1, 2.0, ("A k=4", "A k=8")))
    assert (d.choice, d.status, d.versus) == ("A k=8", INCONCLUSIVE, ["A k=4"])
    assert d.speedup.low > 1.0 and all(c.speedup.low > 1.0 for c in d.candidates)
    assert d.further_prompts is not None and d.further_prompts > 21     # half-width / distance to 1 is above 1
    clear = decide(Load("closed", None, 1), candidates(grounded, 1, 2.0, ("A k=2", "A k=8")))
    assert (clear.choice, clear.status, clear.versus) == ("A k=8", DECIDED, [])


def test_inconclusive_further_prompts_from_a_subsample_agree_with_the_full_run(cpu_store: str) -> None:
    """Option A at c = 4 on the first 4 of its 12 prompts straddles 1 and asks for about 2 more; the first 6
    decide it, as all 12 do."""
    client = MlflowClient(cpu_store)
    exp = client.get_experiment_by_name(CPU_EXPERIMENT)
    (run,) = [r for r in client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'measure'")
              if r.data.tags["specws.option"] == "A"]
    opt = prompt_totals([r for r in run_records(client, run.info.run_id) if r["concurrency"] == 4])
    base = prompt_totals([r for r in run_records(client, run.data.tags["specws.baseline_run_id"])
                          if r["concurrency"] == 4])
    spec = dataclasses.asdict(run_config(run).spec)

    def first(n: int):
        mine = {k: opt[k] for k in sorted(opt)[:n]}
        return decide(Load("closed", None, 4), [Candidate("A k=4", "A", "A", "vllm", spec,
                                                          paired_speedup(mine, base), mine)])
    few = first(4)
    assert (few.choice, few.status, few.versus, few.further_prompts) == (NO_SPECULATION, INCONCLUSIVE, ["A k=4"], 2)
    assert (first(6).choice, first(6).status) == ("A k=4", DECIDED)
    assert (first(12).choice, first(12).status) == ("A k=4", DECIDED)


def test_levels_with_the_same_choice_collapse_into_ranges(grounded) -> None:
    labels = ("A k=2", "A k=8")
    together = recommendation(grounded, {1: 2.0, 4: 2.2, 8: 1.0}, labels)
    assert [(d.choice, d.status) for d in together.decisions] == [("A k=8", DECIDED)] * 2 + [(NO_SPECULATION, DECIDED)]
    assert together.as_dict()["summary"] == "A: n-gram, 8 draft tokens at c = 1–4; no speculation at c = 8"
    apart = recommendation(grounded, {1: 2.0, 4: 1.0, 8: 2.3}, labels)
    assert apart.as_dict()["summary"] == ("A: n-gram, 8 draft tokens at c = 1; no speculation at c = 4; "
                                         "A: n-gram, 8 draft tokens at c = 8")
    plan = json.loads(apart.as_dict()["schedule"]["vllm"]["flags"][1])["num_speculative_tokens_per_batch_size"]
    assert plan == [[1, 1, 8], [4, 4, 0], [8, 8, 8]]


def test_a_schedule_is_followed_by_each_engines_own_routing(grounded, tmp_path: Path) -> None:
    """B (EAGLE-3, 3 steps) at c = 1, no speculation at c = 4 and 8: vLLM's dynamic schedule and SGLang's adaptive
    config, as each engine's own code expands them, give 3 draft steps at batch 1-3 and none from 4 on."""
    rec = recommendation(grounded, {1: 2.0, 4: 1.0, 8: 1.0}, ("A k=2", "A k=4", "A k=8", "B steps=3"))
    out = rec.as_dict()
    assert out["summary"] == "B: EAGLE-3, 3 steps at c = 1; no speculation at c = 4–8"
    s = out["schedule"]
    conf = json.loads(s["vllm"]["flags"][s["vllm"]["flags"].index("--speculative-config") + 1])
    assert conf["method"] == "eagle3" and conf["num_speculative_tokens"] == 3
    dense = _vllm_lookup(conf["num_speculative_tokens_per_batch_size"], 8, 3)
    assert dense[1:] == [3, 3, 3, 0, 0, 0, 0, 0]
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
    path = tmp_path / s["sglang"]["config_file"]
    path.write_text(json.dumps(s["sglang"]["config"]))
    routed = AdaptiveSpeculativeParams(initial_steps=3, cfg_path=str(path))
    assert [routed.get_steps_for_batch(b) for b in (1, 2, 3, 4, 8, 64)] == [3, 3, 3, 0, 0, 0]
    flags = s["sglang"]["flags"]
    assert flags[flags.index("--speculative-adaptive-config") + 1] == "sglang-adaptive.json"
    # one setting for the whole range: no speculation loses 28 % at c = 1; B everywhere loses 54 % at c = 4
    costs = {r["setting"]: r for r in s["single_setting"]}
    b = {d.load.label: d.candidates[3].speedup.estimate for d in rec.decisions}
    assert costs[NO_SPECULATION]["worst_loss"] == pytest.approx(1 - 1 / b["c 1"])
    assert costs["B steps=3"]["worst_loss"] == pytest.approx(1 - b["c 4"])
    assert s["single_setting"][0]["setting"] == NO_SPECULATION          # the smallest worst loss first


def _vllm_lookup(schedule: list, max_batch: int, tokens: int) -> list[int]:
    """vLLM's own expansion of a dynamic speculative-decoding schedule (its scheduler's batch size -> K table)."""
    import subprocess
    code = ("import json,sys; from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup as b; "
            "print(json.dumps(b(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))")
    out = subprocess.run([str(VLLM_PYTHON), "-c", code, json.dumps(schedule), str(max_batch), str(tokens)],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_option_breaking_a_target_is_not_chosen_and_ngram_has_no_sglang_schedule(cpu_store: str,
                                                                                        tmp_path: Path) -> None:
    client = MlflowClient(copy_store(cpu_store, tmp_path))
    options, all_runs, _, _ = select_runs(client, CPU_EXPERIMENT)
    for run in all_runs:
        if run.data.tags.get("specws.workload") == "grounded":
            client.log_param(run.info.run_id, "workload.slo.ttft_p99_s", "2.18")
    options, all_runs, _, _ = select_runs(client, CPU_EXPERIMENT)
    rec = next(r for r in build(client, options, all_runs) if r.workload == "grounded")
    out = rec.as_dict()
    assert out["slo"] == {"ttft": 2.18}
    assert out["summary"] == "no speculation at c = 1; A: n-gram, 4 draft tokens at c = 4"
    one = rec.decisions[0]
    assert one.candidates[0].speedup.low > 1.3 and one.candidates[0].breaks == ["ttft"]
    s = out["schedule"]
    plan = json.loads(s["vllm"]["flags"][1])
    assert plan["method"] == "ngram" and plan["num_speculative_tokens_per_batch_size"] == [[1, 1, 0], [4, 4, 4]]
    assert plan["prompt_lookup_min"] == 2 and plan["prompt_lookup_max"] == 4
    assert s["sglang"]["flags"] is None and "EAGLE/EAGLE3" in s["sglang"]["why"]
    costs = {r["setting"]: r for r in s["single_setting"]}
    assert not costs["A k=4"]["usable"] and costs["A k=4"]["loss"]["c 1"] == "breaks ttft"
    assert costs[NO_SPECULATION]["worst_loss"] == pytest.approx(1 - 1 / rec.decisions[1].speedup.estimate)


def test_each_choice_has_the_adapters_flags_and_sglang_parses_them(cpu_store: str) -> None:
    from experiments.engines.sglang_engine import SGLangAdapter
    client = MlflowClient(cpu_store)
    options, all_runs, _, _ = select_runs(client, CPU_EXPERIMENT)
    rec = next(r for r in build(client, options, all_runs) if r.workload == "grounded").as_dict()
    flags = rec["flags"]["A k=4"]
    assert flags["sglang"]["flags"] == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
    assert any(reason.startswith("spec.ngram.min_match=2") for reason in flags["sglang"]["not_passed"])
    assert SGLangAdapter().validate(sys.executable, ["--model-path", "x", *flags["sglang"]["flags"]]).ok
    conf = json.loads(flags["vllm"]["flags"][1])
    assert conf == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert rec["flags"].keys() == {"A k=4"} and rec["schedule"] == {"needed": False}


def test_an_open_loop_run_is_a_load_of_its_own(cpu_store: str, tmp_path: Path) -> None:
    client = MlflowClient(copy_store(cpu_store, tmp_path))
    options, all_runs, _, _ = select_runs(client, CPU_EXPERIMENT)
    for run in all_runs:
        if run.data.tags.get("specws.workload") == "grounded":
            client.log_param(run.info.run_id, "workload.arrival", "poisson")
            client.log_param(run.info.run_id, "workload.rate", "2.0")
    options, all_runs, _, _ = select_runs(client, CPU_EXPERIMENT)
    rec = next(r for r in build(client, options, all_runs) if r.workload == "grounded").as_dict()
    assert [d["load"] for d in rec["loads"]] == ["poisson 2 req/s, cap 1", "poisson 2 req/s, cap 4"]
    assert rec["summary"] == ("A: n-gram, 4 draft tokens under poisson 2 req/s, cap 1; "
                              "A: n-gram, 4 draft tokens under poisson 2 req/s, cap 4")
    assert rec["schedule"] == {"needed": False}


def test_the_command_writes_and_logs_the_recommendation(cpu_store: str, tmp_path: Path, capsys) -> None:
    store = copy_store(cpu_store, tmp_path)
    assert main(["--experiment", CPU_EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr()
    text = printed.out
    assert "replaced" not in printed.err
    assert "**Warning**: too few prompts to decide on (12 per level, fewer than 32); run workload=grounded" in text
    assert "**A: n-gram, 4 draft tokens at c = 1–4**" in text
    assert "| c 4 | A: n-gram, 4 draft tokens | decided |" in text
    client = MlflowClient(store)
    exp = client.get_experiment_by_name(CPU_EXPERIMENT)
    (report,) = client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")
    logged = {a.path for a in client.list_artifacts(report.info.run_id, "recommendation")}
    assert logged == {"recommendation/recommendation-smollm2_135m_local.json",
                      "recommendation/recommendation-smollm2_135m_local.md"}
    # a second call (the experiment given positionally, as to the report) goes onto the experiment's report run, not
    # a new one, and says which files it replaced
    assert main([CPU_EXPERIMENT, "--tracking-uri", store, "--out", str(tmp_path / "out")]) == 0
    assert len(client.search_runs([exp.experiment_id], "tags.`specws.mode` = 'report'")) == 1
    err = capsys.readouterr().err
    assert all(f"replaced {tmp_path / 'out' / f'recommendation-smollm2_135m_local.{x}'}" in err for x in ("json", "md"))
    assert main(["--experiment", "nothing-here", "--tracking-uri", store]) == 2


def test_an_engines_caveat_names_only_a_setting_someone_chose_and_says_what_to_do(cpu_store: str) -> None:
    """Option A on vLLM gets vLLM's window 2-4 from the workspace: SGLang's "no such setting" is nobody's to act on.
    A window someone chose (3-5) is named, with what to do about it on SGLang."""
    from experiments.analysis.recommend.flags import choice_flags
    from experiments.analysis.recommend.render import caveats
    client = MlflowClient(cpu_store)
    options, all_runs, _, _ = select_runs(client, CPU_EXPERIMENT)
    rec = next(r for r in build(client, options, all_runs) if r.workload == "grounded").as_dict()
    (cand,) = {c["label"]: c for d in rec["loads"] for c in d["candidates"]}.values()
    sglang = rec["flags"]["A k=4"]["sglang"]
    assert len(sglang["not_passed"]) == 2 and caveats(sglang["not_passed"], "sglang", cand) == []
    chosen = choice_flags({**cand_spec(options), "ngram": {"min_match": 3, "max_match": 5}})["sglang"]["not_passed"]
    notes = caveats(chosen, "sglang", cand)
    assert len(notes) == 2 and notes[0].startswith("spec.ngram.min_match=3 (your setting): SGLang's NGRAM drafter")
    assert all("remove it" not in n and n.endswith("deploy this choice on vllm, where it was measured with it, or "
                                                   "measure it on sglang without it") for n in notes)


def cand_spec(options: list) -> dict:
    return dataclasses.asdict(run_config(next(r for r in options if run_config(r).option == "A")).spec)


def test_the_tables_explain_their_columns_in_words(cpu_store: str) -> None:
    from experiments.analysis.recommend.render import html_section, markdown
    client = MlflowClient(cpu_store)
    options, all_runs, _, _ = select_runs(client, CPU_EXPERIMENT)
    recs = build(client, options, all_runs)
    html, md = html_section(recs), markdown(recs, "t")
    for column in ("not separated from", "further prompts"):
        assert re.search(rf'<th title="[^"]+">{column}</th>', html)
        assert f"{column}: " in md and f"{column}: " in html
    assert "| c 4 | no speculation | inconclusive | 1 (baseline) | 12 | C: EAGLE-3, 3 steps | 6 |" in md
    assert "A k=4" not in md and "steps=3" not in md and "(workload " not in md
