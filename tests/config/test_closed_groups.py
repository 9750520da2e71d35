"""Closed config groups: a key no config file declares, added on the command line or misspelt in a file, is refused
before anything starts, naming the nearest declared key; the free-form blocks stay open; every shipped option,
site and workload composes without such a refusal. Real Hydra composition throughout."""
from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest
from conftest import compose_cfg, run_workspace

from experiments.config.closed import OPEN, declared_keys, nearest, refuse_unknown_keys, refuse_unknown_overrides
from experiments.config.views import typed_run
from experiments.harness.preflight import Refused, check_option

OPTIONS = ("baseline", "A", "B", "C", "D", "E")
SITES = ("local", "h200", "blackwell", "h200-kimi", "h200x8-kimi")
WORKLOADS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "workload").glob("*.yaml")
                   if not p.stem.startswith("_"))
# a refusal that starts nothing: CPU time of the child, and a wall bound whatever the load (tests/harness pattern)
REFUSAL_CPU_S, REFUSAL_WALL_S = 10.0, 60.0


@pytest.mark.parametrize(("override", "named", "nearest_key"), [
    ("+workload.request_rate=2", "workload.request_rate", "workload.rate"),
    ("+workload.max_token=64", "workload.max_token", "workload.max_tokens"),
    ("+workload.burstyness=2", "workload.burstyness", "workload.burstiness"),
    ("+workload.slo.ttft_p90_s=1", "workload.slo.ttft_p90_s", "workload.slo.ttft_p99_s"),
    ("+spec.num_draft_token=4", "spec.num_draft_token", "spec.num_draft_tokens"),
    ("+spec.ngram.min_mach=2", "spec.ngram.min_mach", "spec.ngram.min_match"),
    ("+limits.max_running_request=4", "limits.max_running_request", "limits.max_running_requests"),
    ("+server.startup_timeout=10", "server.startup_timeout", "server.startup_timeout_s"),
    ("+baseline.max_age=1", "baseline.max_age", "baseline.max_age_h"),
    ("+run.dryrun=true", "run.dryrun", "run.dry_run"),
    ("+tracking.experment=x", "tracking.experment", "tracking.experiment"),
    ("+engine.modul=x", "engine.modul", "engine.module"),
    ("+site.acelerator=cpu", "site.acelerator", "site.accelerator"),
    ("+model.max_model_length=4096", "model.max_model_length", "model.max_model_len"),
    ("+wrkload.max_tokens=3", "wrkload", "workload"),
])
def test_an_unknown_key_is_refused_naming_the_nearest_declared_one(override: str, named: str,
                                                                   nearest_key: str) -> None:
    with pytest.raises(Refused) as refused:
        check_option(typed_run(compose_cfg("+option=A", override)))
    said = str(refused.value)
    assert said.startswith(f"unknown setting {named}: ") and f"did you mean {nearest_key}?" in said, said


def test_a_key_with_nothing_near_lists_the_declared_keys() -> None:
    with pytest.raises(Refused, match=r"unknown setting limits\.qps: .*the limits keys: max_running_requests"):
        refuse_unknown_keys(compose_cfg("+option=A", "+limits.qps=3"))


def test_nearest_prefers_a_whole_word_of_the_key() -> None:
    names = list(declared_keys()["workload"])
    assert nearest("request_rate", names) == "rate"             # difflib alone: request_timeout_s
    assert nearest("arival_seed", names) == "arrival_seed"
    assert nearest("qps", names) is None


@pytest.mark.parametrize("override", ["+engine.env.SOME_FLAG=1", "+site.env.NCCL_DEBUG=INFO", "+run.tags.note=x",
                                      "+site.patches_forced=[sm12x_wna16_moe_triton]",
                                      "+model.hf_config.num_hidden_layers=2"])
def test_free_form_blocks_stay_open(override: str) -> None:
    refuse_unknown_keys(compose_cfg("+option=A", override))


def test_the_open_blocks_are_declared_blocks() -> None:
    """Each open path is a block of the declared keys: an open path that names nothing would open nothing."""
    tree = declared_keys()
    for path in OPEN:
        node = tree
        for part in path.split("."):
            node = node[part]
        assert isinstance(node, dict), path


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("site", SITES)
def test_every_shipped_option_and_site_composes_without_an_unknown_key(option: str, site: str) -> None:
    refuse_unknown_keys(compose_cfg(f"+option={option}", f"site={site}"))


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_shipped_workload_declares_only_base_keys(workload: str) -> None:
    refuse_unknown_keys(compose_cfg("+option=A", f"workload={workload}"))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _refused(*overrides: str) -> tuple[int, str]:
    """`python -m experiments.run +option=A ... run.dry_run=true`, with an engine interpreter that does not exist
    (refused later: a check that does not come first shows up as the wrong message): exit code, output unwrapped."""
    started, cpu = time.monotonic(), _children_cpu_s()
    out = run_workspace("+option=A", "run.dry_run=true", "engine.python=/nonexistent/engine/python", *overrides,
                        env={"COLUMNS": "1000"}, timeout=REFUSAL_WALL_S)
    elapsed, cpu = time.monotonic() - started, _children_cpu_s() - cpu
    assert cpu < REFUSAL_CPU_S and elapsed < REFUSAL_WALL_S, (
        f"refused after {elapsed:.1f} s ({cpu:.1f} s of CPU, load average {os.getloadavg()[0]:.1f})")
    said = " ".join((out.stdout + out.stderr).split())
    assert "starting vllm" not in said and "engine.python" not in said, said[-2000:]
    return out.returncode, said


def test_an_added_workload_key_is_refused_from_the_command_line_before_any_engine_check() -> None:
    rc, said = _refused("+workload.request_rate=2")
    assert rc == 2 and "refused: unknown setting workload.request_rate" in said and "workload.rate?" in said, said


def test_a_misspelt_key_in_your_own_workload_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "workload").mkdir()
    (tmp_path / "workload" / "mine.yaml").write_text(
        "defaults: [_base, _self_]\nname: mine\nprompt_set: grounded\nmax_token: 64\n")
    rc, said = _refused("workload=mine", f"hydra.searchpath=[file://{tmp_path}]")
    assert rc == 2 and "unknown setting workload.max_token" in said and "workload.max_tokens?" in said, said
    assert "conf/workload/_base.yaml" in said


def test_a_plain_typo_without_plus_gets_the_nearest_key_before_hydra_composes() -> None:
    """Without `+`, Hydra would refuse it while composing with its own message and no nearest key (exit code 1):
    the runner's entry point refuses it first, in the same words as an added key."""
    rc, said = _refused("workload.concurency=[1]")
    assert rc == 2 and "refused: unknown setting workload.concurency" in said, said
    assert "did you mean workload.concurrency?" in said and "Could not override" not in said, said
    rc, said = _refused("spec.num_draft_token=3")
    assert rc == 2 and "did you mean spec.num_draft_tokens?" in said, said


def test_overrides_of_declared_keys_groups_and_free_form_blocks_pass_the_typo_check() -> None:
    refuse_unknown_overrides(["workload.concurrency=[1]", "+option=A", "site=local", "tracking=server",
                              "hydra.run.dir=x", "-m", "engine.env.ANY=1", "run.tags.anything=1",
                              "spec.ngram.min_match=2", "hydra/launcher=slurm_box", "++workload.new_key=1",
                              "~workload.slo", "server.api_key_env=KEY_VAR"])
    with pytest.raises(Refused, match="unknown setting workloda: .*did you mean workload\\?"):
        refuse_unknown_overrides(["workloda=file"])
