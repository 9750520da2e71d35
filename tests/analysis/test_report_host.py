"""The report's Host section over real runs: the 2026-12-05 H100 lease (B paired in time and sequentially with its
baseline), and, beside an earlier lease of another host, what differs between the two."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import import_into

from experiments.analysis.report.host import cross_host_diff, host_rows, html_section

JOURNAL = Path(__file__).resolve().parents[2] / "docs" / "journal"
EXPERIMENT = "smollm2_135m@h200"


@pytest.fixture(scope="module")
def lease(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h100")
    client, out = import_into(JOURNAL / "2026-12-05-h100" / "runs.tar.xz", tmp)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    return client, tmp, runs


def test_each_level_names_its_pairing_steps_blocks_and_flags(lease) -> None:
    client, _, runs = lease
    options = [r for r in runs if r.data.tags["specws.option"] == "B"]
    rows = host_rows(options, {r.info.run_id: r for r in runs})
    assert len(rows) == 6 and {r["timing"] for r in rows} == {"interleaved", "-"}   # the lease's sequential run
    sensitive = [r for r in rows if r["verdict"] == "host-sensitive"]
    assert [(r["c"], r["blocks"]) for r in sensitive] == [(8, "0.75–1.16")]
    assert all(r["step"] > r["base_step"] and r["excess"] > 1.0 for r in rows)     # B's step: 2.3-3.7x
    assert any("py_loop_us swung" in r["flags"] for r in rows)
    html = html_section(client, options, runs)
    assert "<h2>Host</h2>" in html and "host-sensitive" in html and "more than one host" not in html


def test_runs_of_two_hosts_get_the_diff(lease) -> None:
    client, tmp, _ = lease
    _, out = import_into(JOURNAL / "2026-11-30-h200c" / "runs.tar.xz", tmp)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    options = [r for r in runs if r.data.tags.get("specws.option") == "B"]
    text = cross_host_diff(client, options)
    assert "max_running_requests" in text and "matters" in text
