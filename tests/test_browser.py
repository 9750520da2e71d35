"""What a user sees in a browser (headless Chromium, Debian's `chromium`; skipped where none is installed): the MLflow
UI started by bin/ui over a finished option run shows the run's verdict (its description, written by the verdict
block), and the decision report shows its verdict on the first screen, before any table or figure.

The store: a baseline and option A logged from records the workspace's client wrote against the loopback server
(the option streaming two tokens per event, about twice the baseline's rate), then the post-run analysis and the
verdict block as the runner calls them; no engine is started (about 30-40 s in all)."""
from __future__ import annotations

import html
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_fixed
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.engines.vllm_engine import VLLMAdapter
from experiments.harness.summary import summarize
from tests.helpers.loopback_server import start_loopback

CHROMIUM = os.environ.get("CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install "
                                "chromium; .ci/run installs it; CHROMIUM=/path overrides)")
EXPERIMENT = "browser@loopback"
SERVER_START_S = 90          # bin/ui answers in ~5 s on a quiet 2-core host, 20 s on a busy one
BLOCKS = ("<table", "<img", "<svg", "<figure", "<iframe", "<canvas")


def loopback_run(client: MlflowClient, exp: str, tmp: Path, name: str, tokens_per_event: int, params: dict,
                 tags: dict) -> str:
    """12 first-seen prompts, 6 per level at c = 1 and 4, logged as a measured run (not yet terminated)."""
    server = start_loopback(ttft_ms=10.0, itl_ms=4.0, tokens_per_event=tokens_per_event)
    try:
        path = tmp / f"records-{name}.jsonl"
        levels = run_fixed(server, VLLMAdapter(), 48, path, {f"p{i}": [100 + i, 1, 2] for i in range(12)}, [1, 4],
                           reuse=False)
    finally:
        server.stop()
    run_id = client.create_run(exp, run_name=name, tags={"specws.mode": "measure", "specws.workload": "quick",
                                                         **tags}).info.run_id
    for k, v in {"engine.name": "vllm", "workload.concurrency": "[1, 4]", **params}.items():
        client.log_param(run_id, k, v)
    metrics = summarize(levels, VLLMAdapter()).metrics
    client.log_batch(run_id, metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()])
    client.log_artifact(run_id, str(path), "records")
    return run_id


def analyse(client: MlflowClient, run_id: str, baseline) -> None:
    """The runner's post-run processors: the analysis, then the verdict block where it exists."""
    from experiments.analysis.post_run import log_run_analysis
    log_run_analysis(client, run_id, baseline, "vllm")
    try:
        from experiments.analysis.verdict_block import log_verdict_block
    except ImportError:
        pass
    else:
        log_verdict_block(client, run_id, baseline, "vllm")
    client.set_terminated(run_id, "FINISHED")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium(tmp: Path, url: str, *flags: str) -> str:
    """Chromium headless on `url`: the DOM after the page's scripts ran (virtual time: network loads hold it)."""
    out = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=15000", *flags,
                          "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def visible_text(dom: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[tuple[MlflowClient, str, Path, str, str, str]]:
    """A baseline and an analysed option run in a fresh store, and bin/ui over it on a free port (its default store
    and port overridden by arguments), started as soon as the store exists so that it comes up while the runs are
    measured: (client, uri, folder, experiment id, option run id, the UI's base URL)."""
    tmp = tmp_path_factory.mktemp("browser")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment(EXPERIMENT, artifact_location=(tmp / "artifacts").as_uri())
    port, log = free_port(), tmp / "ui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(ROOT / "bin" / "ui"), "--backend-store-uri", uri, "--port", str(port)],
                                stdout=out, stderr=out, start_new_session=True,
                                env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    try:
        base_id = loopback_run(client, exp, tmp, "baseline-quick", 1, {"spec.method": "none"},
                               {"specws.option": "baseline", "specws.spec_method": "none"})
        option_id = loopback_run(client, exp, tmp, "A-quick-k4", 2,
                                 {"spec.method": "ngram", "spec.num_draft_tokens": "4"},
                                 {"specws.option": "A", "specws.spec_method": "ngram",
                                  "specws.baseline_run_id": base_id})
        analyse(client, base_id, None)
        analyse(client, option_id, client.get_run(base_id))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"bin/ui did not answer within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield client, uri, tmp, exp, option_id, url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)   # its own session: the uvicorn worker goes with it
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_run_page_shows_the_verdict(store) -> None:
    verdict_block = pytest.importorskip("experiments.analysis.verdict_block")
    client, _, tmp, exp, option_id, ui = store
    note = client.get_run(option_id).data.tags[verdict_block.NOTE_TAG]
    head = note.splitlines()[0]
    assert head.startswith("Verdict: A ") and "pays" in head
    dom = chromium(tmp, f"{ui}/#/experiments/{exp}/runs/{option_id}", "--window-size=1280,800")
    text = " ".join(visible_text(dom).split())
    assert "A-quick-k4" in text, "the run page did not render"   # the run's name: the SPA loaded the run
    assert head in text, f"the run's description ({head!r}) is not on its page"


def test_the_report_leads_with_the_verdict(store) -> None:
    import json

    from experiments.analysis.report import main
    client, uri, tmp, exp, _, _ = store
    out = tmp / "reports"
    assert main([EXPERIMENT, "--tracking-uri", uri, "--out", str(out)]) == 0
    page = out / f"report-{EXPERIMENT.replace('@', '_')}.html"
    (report_run,) = client.search_runs([exp], "tags.`specws.mode` = 'report'")
    (entry,) = json.loads(Path(client.download_artifacts(report_run.info.run_id, "report/verdicts.json",
                                                         str(tmp))).read_text()).values()
    verdict = entry["verdict"]
    assert verdict.startswith("pays")
    shot = tmp / "report.png"
    dom = chromium(tmp, page.as_uri(), "--window-size=1280,800", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    body = dom[dom.index("<body"):]
    at = body.find(html.escape(verdict, quote=False))
    assert at >= 0, f"the report's verdict {verdict!r} is not on the page"
    before = body[:at]
    # the first screen: nothing but headings and short text above the verdict, no table, figure or image
    assert not [b for b in BLOCKS if b in before], f"the verdict comes after {[b for b in BLOCKS if b in before]}"
    assert "Verdict" in visible_text(before) and len(" ".join(visible_text(before).split())) < 400
