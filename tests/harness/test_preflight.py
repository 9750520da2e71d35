"""Preflight refuses a bad input before anything starts, dry runs included, naming the value and the fix:
prompt sets, model folders and EAGLE-3 heads, the engine's environment, the tracking store, the folders a run
writes."""
from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CONF, SMOLLM2, compose_cfg, run_workspace
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from experiments.config.paths import ROOT
from experiments.config.views import typed_run
from experiments.harness.head_fields import KINDS, REQUIRED_TO_LOAD
from experiments.harness.preflight import (
    Refused,
    check_assets,
    check_engine_env,
    check_head_fits,
    check_head_loads,
    check_inputs,
    check_moe_model,
    check_tracking,
)
from experiments.harness.server import POOL
from experiments.run import experiment
from experiments.tracking import store_check

ROW = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}


def _dry(tmp_path: Path, *overrides: str):
    return compose_cfg("+option=A", "run.dry_run=true", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                       f"tracking.artifact_root={tmp_path / 'artifacts'}", *overrides)


def _write(path: Path, rows: list) -> Path:
    return _raw(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def _raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


PROMPT_SETS = {
    "missing": (lambda d: d / "nope.jsonl", r"nope\.jsonl does not exist; set workload\.prompt_set"),
    "empty": (lambda d: _write(d / "empty.jsonl", []), r"empty\.jsonl: the prompt file is empty"),
    "duplicate ids": (lambda d: _write(d / "dup.jsonl", [ROW, ROW]), r"dup\.jsonl:2: duplicate id 'a'"),
    "unreadable": (lambda d: _raw(d / "bad.jsonl", b"\xff\xfe\x00"), r"bad\.jsonl: cannot read the prompt file"),
    "malformed row": (lambda d: _raw(d / "m.jsonl", b'{"id": "a",\n'), r"m\.jsonl:1:\d+: malformed JSON"),
}


@pytest.mark.parametrize("case", sorted(PROMPT_SETS))
def test_bad_prompt_sets_are_refused_in_a_dry_run_before_anything_starts(tmp_path: Path, case: str,
                                                                         monkeypatch) -> None:
    make, words = PROMPT_SETS[case]
    path = make(tmp_path)
    monkeypatch.setattr(POOL, "acquire", lambda *a, **k: pytest.fail("a server was started"))
    started, cpu = time.monotonic(), time.process_time()
    with pytest.raises(Refused, match=words):
        experiment(_dry(tmp_path, "workload=file", f"workload.prompt_set={path}"))
    assert time.process_time() - cpu < 10 and time.monotonic() - started < WALL_BOUND_S


def test_model_folder_without_config_or_tokenizer_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(Refused, match=r"no Hugging Face folder at .*model \(no config\.json\); set model\.path"):
        check_inputs(typed_run(_dry(tmp_path, f"model.path={model}", "model.embedded=false")))
    shutil.copy(SMOLLM2 / "config.json", model / "config.json")
    with pytest.raises(Refused, match=r"has no tokenizer files \(one of tokenizer\.json.*\); run `bin/setup`"):
        check_inputs(typed_run(_dry(tmp_path, f"model.path={model}")))
    shutil.copy(SMOLLM2 / "tokenizer.json", model / "tokenizer.json")
    check_inputs(typed_run(_dry(tmp_path, f"model.path={model}")))


def test_a_model_that_is_not_here_passes_a_dry_run(tmp_path: Path) -> None:
    """The box's model, checked from here: its folder is checked where it is served."""
    check_inputs(typed_run(_dry(tmp_path, f"model.path={tmp_path / 'elsewhere'}")))


def test_missing_engine_interpreter_says_run_setup_even_in_a_dry_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(POOL, "acquire", lambda *a, **k: pytest.fail("a server was started"))
    missing = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(Refused, match=rf"interpreter {missing} \(engine\.python\) does not exist; run `bin/setup`"):
        experiment(_dry(tmp_path, f"engine.python={missing}"))


def test_interpreter_without_the_engine_is_refused(tmp_path: Path) -> None:
    no_vllm = tmp_path / "python"   # this interpreter, run from a path: it has no vLLM
    no_vllm.symlink_to(sys.executable)
    with pytest.raises(Refused, match=rf"{no_vllm} \(engine\.python\) cannot import vllm; run `bin/setup`"):
        check_engine_env(typed_run(_dry(tmp_path, f"engine.python={no_vllm}")))


def test_tracking_folder_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(Refused, match=r"tracking\.uri=sqlite:///.*cannot create the folder .*file/store"):
        check_tracking(typed_run(_dry(tmp_path, f"tracking.uri=sqlite:///{blocker / 'store' / 'mlflow.db'}")).tracking)
    with pytest.raises(Refused, match=r"tracking\.uri=offline://.*cannot create the folder"):
        check_tracking(typed_run(_dry(tmp_path, f"tracking.uri=offline://{blocker / 'offline'}")).tracking)


def test_unresolvable_tracking_uri_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(Refused, match=r"tracking\.uri cannot be resolved .*set MLFLOW_TRACKING_URI"):
        check_tracking(typed_run(compose_cfg("+option=A", "tracking=server")).tracking)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tracking_server_that_does_not_answer_is_refused_within_seconds(tmp_path: Path, monkeypatch) -> None:
    closed = f"http://user:s3cr3t@127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(Refused, match=r"tracking\.uri=http://\*\*\*@127\.0\.0\.1:\d+: no answer") as refused:
        check_tracking(typed_run(_dry(tmp_path, f"tracking.uri={closed}")).tracking)
    assert "s3cr3t" not in str(refused.value)
    assert time.monotonic() - started < 5
    monkeypatch.setattr(store_check, "TRACKING_TIMEOUT_S", 0.5)
    with socket.socket() as silent:   # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        started = time.monotonic()
        with pytest.raises(Refused, match=r"no answer within .*Timeout"):
            check_tracking(typed_run(_dry(tmp_path, f"tracking.uri=http://127.0.0.1:{silent.getsockname()[1]}")).tracking)
        assert time.monotonic() - started < 3


# Command-line refusals: settings that are refused later (no engine interpreter, no prompt file) ride along, so a
# check that does not refuse first shows up as the wrong message; the console is made wide so that no path wraps.
REFUSAL_BUDGET_S = 10
WALL_BOUND_S = 60.0   # a refusal that starts nothing heavy, whatever the load
LATER_REFUSALS = ("engine.python=/nonexistent/engine/python", "workload=file")
HEAD = {"hidden_size": 576, "vocab_size": 49152, "draft_vocab_size": 4096,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}
TARGET = {"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30}
BROKEN_JSON = '{\n  "hidden_size": 576,\n  "vocab_size": \n}\n'   # "Expecting value" at line 4, column 1
FULL_HEAD = json.loads((ROOT / "experiments" / "eagle3" / "artifacts" / "smollm2_135m" / "config.json").read_text())
AUX = "eagle_aux_hidden_state_layer_ids"


def _refused_from_cli(tmp_path: Path, *overrides: str) -> str:
    """`python -m experiments.run ...` refused within the budget with no engine: the message, unwrapped."""
    started, cpu = time.monotonic(), _children_cpu_s()
    out = run_workspace(*LATER_REFUSALS, f"workload.prompt_set={tmp_path / 'no-prompts.jsonl'}",
                        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                        f"tracking.artifact_root={tmp_path / 'artifacts'}", f"hydra.run.dir={tmp_path / 'out'}",
                        *overrides, env={"COLUMNS": "1000"}, timeout=60)
    elapsed, cpu = time.monotonic() - started, _children_cpu_s() - cpu
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, said[-3000:]
    # CPU time, not wall time: on a shared 2-core machine (CI's two workers) the wall time follows the load
    assert cpu < REFUSAL_BUDGET_S and elapsed < WALL_BOUND_S, (
        f"refused after {elapsed:.1f} s ({cpu:.1f} s of CPU, load average {os.getloadavg()[0]:.1f})")
    assert "Traceback" not in said and "starting vllm" not in said and "validated by" not in said
    return said


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _head(folder: Path, text: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return folder


def _model(folder: Path, config_text: str) -> Path:
    _head(folder, config_text)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _without(*names: str) -> dict:
    return {k: v for k, v in FULL_HEAD.items() if k not in names}


def _head_cfg(d: Path, head: dict) -> list[str]:
    return [f"spec.draft_model={_head(d / 'head', json.dumps(head))}"]


BROKEN_CONFIGS = {
    "head not JSON": (lambda d: [f"spec.draft_model={_head(d / 'head', BROKEN_JSON)}"],
                      "head/config.json is not valid JSON (Expecting value at line 4, column 1)"),
    "head not an object": (lambda d: [f"spec.draft_model={_head(d / 'head', '[1, 2]')}"],
                           "head/config.json holds an array, not a JSON object"),
    "target not JSON": (lambda d: [f"spec.draft_model={_head(d / 'head', json.dumps(HEAD))}",
                                   f"model.path={_model(d / 'target', BROKEN_JSON)}"],
                        "target/config.json is not valid JSON (Expecting value at line 4, column 1)"),
    "head without hidden_size": (lambda d: _head_cfg(d, _without("hidden_size")), "head/config.json: no hidden_size"),
    "aux layer ids not integers": (
        lambda d: _head_cfg(d, FULL_HEAD | {"eagle_config": {AUX: ["2", 15, 27]}}),
        f"head/config.json: eagle_config.{AUX} must be a list of non-negative integers, not ['2', 15, 27]"),
    "head missing what the engine loads": (lambda d: _head_cfg(d, _without("num_attention_heads", "rms_norm_eps")),
                                           "head/config.json: no num_attention_heads; no rms_norm_eps"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_CONFIGS))
def test_a_broken_config_json_is_refused_from_the_command_line_naming_the_file(tmp_path: Path, case: str) -> None:
    make, words = BROKEN_CONFIGS[case]
    said = _refused_from_cli(tmp_path, "+option=C", *make(tmp_path))
    assert "refused: " in said and f"{tmp_path}/{words}" in said, said[-2000:]


def test_every_config_json_preflight_reads_is_refused_naming_the_file(tmp_path: Path) -> None:
    """check_assets, the fit, the engine's load check and the MoE check read config.json through one helper."""
    head, target = _head(tmp_path / "head", json.dumps(HEAD)), _model(tmp_path / "target", '"a string"')
    with pytest.raises(Refused, match=r"target model .*target: .*target/config\.json holds a string, not a JSON"):
        check_head_fits(head, target)
    (head / "config.json").write_text(BROKEN_JSON)
    good = _model(tmp_path / "good", json.dumps(TARGET))
    cfg = compose_cfg("+option=C", f"spec.draft_model={head}", f"model.path={good}")
    with pytest.raises(Refused, match=r"EAGLE-3 head .*head/config\.json is not valid JSON .*line 4, column 1"):
        check_head_loads("vllm", head)
    with pytest.raises(Refused, match=r"EAGLE-3 head .*head/config\.json is not valid JSON"):
        check_assets(typed_run(cfg))
    cfg = compose_cfg("+option=A", "spec.moe_expert_budget=4", f"model.path={target}")
    with pytest.raises(Refused, match=r"model smollm2_135m: .*target/config\.json holds a string"):
        check_moe_model(typed_run(cfg))


def test_head_checks_run_in_check_inputs_where_the_head_is_an_input(tmp_path: Path) -> None:
    """C needs its head (a dry run only one that is here: the box's is checked where it is served); D trains it."""
    missing = tmp_path / "no-head"
    store = (f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.artifact_root={tmp_path / 'art'}")
    with pytest.raises(Refused, match=r"EAGLE-3 head not found at .*no-head: train one with \+option=D"):
        check_inputs(typed_run(compose_cfg("+option=C", f"spec.draft_model={missing}", *store)))
    check_inputs(typed_run(compose_cfg("+option=C", f"spec.draft_model={missing}", "run.dry_run=true", *store)))
    check_inputs(typed_run(compose_cfg("+option=D", f"train.out_dir={missing}", *store)))
    assert not missing.exists()


def _not_sqlite(db: Path) -> None:
    db.write_bytes(b"this is no database\n" * 20)


def _foreign_sqlite(db: Path) -> None:
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE notes (text TEXT)")
        con.execute("INSERT INTO notes VALUES ('mine')")
    con.close()


def _damaged_mlflow_store(db: Path) -> None:
    """A real MLflow store with a run in it, then 16 KiB of random bytes at offset 8192 (its header and schema
    page intact: only SQLite's own check of the pages finds it)."""
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.create_experiment("damaged", artifact_location=(db.parent / "art").as_uri())
    run = client.create_run(exp).info.run_id
    for i in range(50):
        client.log_metric(run, f"m{i}", float(i))
    client.set_terminated(run)
    with open(db, "r+b") as f:
        f.seek(8192)
        f.write(random.Random(0).randbytes(16384))


BAD_STORES = {
    "garbage": (_not_sqlite, "is not a SQLite database"),
    "foreign SQLite": (_foreign_sqlite, "is a SQLite database but not an MLflow store"),
    "damaged page": (_damaged_mlflow_store, "is a damaged SQLite database (PRAGMA quick_check: "),
}


@pytest.mark.parametrize("case", sorted(BAD_STORES))
def test_a_store_file_that_is_no_mlflow_store_is_refused_from_the_command_line_and_left_intact(
        tmp_path: Path, case: str) -> None:
    make, words = BAD_STORES[case]
    db = tmp_path / "x" / "mlflow.db"
    db.parent.mkdir()
    make(db)
    before = db.read_bytes()
    said = _refused_from_cli(tmp_path, "+option=A", f"tracking.uri=sqlite:///{db}")
    assert f"tracking.uri=sqlite:///{db}: {db} {words}" in said, said[-2000:]
    assert db.read_bytes() == before


def test_a_new_empty_or_mlflow_sqlite_store_passes_and_is_left_as_it_was(tmp_path: Path) -> None:
    def check(db: Path, *overrides: str) -> None:
        check_tracking(typed_run(_dry(tmp_path, f"tracking.uri=sqlite:///{db}", *overrides)).tracking)

    check(tmp_path / "new" / "mlflow.db")
    assert not (tmp_path / "new" / "mlflow.db").exists()
    (tmp_path / "empty.db").write_bytes(b"")
    check(tmp_path / "empty.db")
    assert (tmp_path / "empty.db").read_bytes() == b""
    with sqlite3.connect(tmp_path / "tableless.db") as con:   # a database whose only table is gone
        con.execute("CREATE TABLE t (x)")
        con.execute("DROP TABLE t")
    con.close()
    check(tmp_path / "tableless.db")
    MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").create_experiment(
        "kept", artifact_location=(tmp_path / "kept").as_uri())
    before = (tmp_path / "mlflow.db").read_bytes()
    check(tmp_path / "mlflow.db", "tracking.experiment=kept")
    assert (tmp_path / "mlflow.db").read_bytes() == before
    assert (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())   # checked, probe removed


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    """An existing folder no file can be created in: mode 0o555, and where that does not stop writes (root) the
    immutable attribute too; skipped where neither does."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    if _writable(folder):
        _chattr("+i", folder)
    try:
        if _writable(folder):
            pytest.skip("neither mode 0o555 nor chattr +i stops writes here")
        yield folder
    finally:
        _chattr("-i", folder)
        folder.chmod(0o755)


def _chattr(flag: str, folder: Path) -> None:
    if shutil.which("chattr"):
        subprocess.run(["chattr", flag, str(folder)], capture_output=True, check=False)


def _writable(folder: Path) -> bool:
    try:
        (folder / "probe").touch()
    except OSError:
        return False
    (folder / "probe").unlink()
    return True


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("")
    return tmp_path / "afile" / "sub"


def test_an_artifact_root_that_cannot_be_created_is_refused_from_the_command_line(tmp_path: Path) -> None:
    folder = _under_a_file(tmp_path)
    said = _refused_from_cli(tmp_path, "+option=A", f"tracking.artifact_root={folder}")
    assert (f"tracking.artifact_root={folder}: cannot create the folder {folder}" in said
            and "set tracking.artifact_root to a writable folder" in said), said[-2000:]


def test_a_read_only_artifact_root_is_refused_from_the_command_line(tmp_path: Path, unwritable: Path) -> None:
    said = _refused_from_cli(tmp_path, "+option=A", f"tracking.artifact_root={unwritable}")
    assert (f"tracking.artifact_root={unwritable}: cannot write in the folder {unwritable}" in said
            and "set tracking.artifact_root to a writable folder" in said), said[-2000:]


def test_an_existing_experiment_whose_artifact_folder_cannot_be_written_is_refused(tmp_path: Path) -> None:
    """Its location was fixed when it was created: tracking.artifact_root does not move it."""
    folder = _under_a_file(tmp_path)
    db = tmp_path / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").create_experiment("old", artifact_location=folder.as_uri())
    said = _refused_from_cli(tmp_path, "+option=A", "tracking.experiment=old")
    assert (f"the artifact location of experiment old (store tracking.uri=sqlite:///{db}): cannot create the "
            f"folder {folder}" in said and "set tracking.experiment to a new name" in said), said[-2000:]


def test_a_read_only_output_folder_is_refused_from_the_command_line(tmp_path: Path, unwritable: Path) -> None:
    """Hydra itself writes there first unless told not to (no .hydra/ copy, no log file)."""
    said = _refused_from_cli(tmp_path, "+option=A", f"hydra.run.dir={unwritable}", "hydra.output_subdir=null",
                             "hydra/job_logging=disabled")
    assert (f"the run's output folder (hydra.run.dir): cannot write in the folder {unwritable}" in said
            and "set hydra.run.dir to a writable folder" in said), said[-2000:]


def test_an_output_folder_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    folder = _under_a_file(tmp_path)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+option=A"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(folder)
    HydraConfig.instance().set_config(cfg)
    try:
        with pytest.raises(Refused, match=rf"\(hydra\.run\.dir\): cannot create the folder {re.escape(str(folder))}"):
            check_inputs(typed_run(_dry(tmp_path)))
    finally:
        HydraConfig.instance().cfg = None
    check_inputs(typed_run(_dry(tmp_path)))   # no Hydra: no output folder to check


def _set(head: dict, dotted: str, value) -> dict:
    node = head
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return head


@pytest.mark.parametrize("field", sorted(KINDS))
def test_every_head_field_of_the_wrong_kind_is_refused_naming_file_and_field(tmp_path: Path, field: str) -> None:
    head = _head(tmp_path / "head", json.dumps(_set(json.loads(json.dumps(FULL_HEAD)), field, "x")))
    with pytest.raises(Refused, match=rf"{re.escape(str(head / 'config.json'))}: (.*; )?{re.escape(field)} must be "):
        check_head_loads("vllm", head)


@pytest.mark.parametrize("field", REQUIRED_TO_LOAD)
def test_every_head_field_the_engine_loads_is_required(tmp_path: Path, field: str) -> None:
    head = _head(tmp_path / "head", json.dumps(_without(field)))
    with pytest.raises(Refused, match=rf"{re.escape(str(head / 'config.json'))}: no {field}"):
        check_head_loads("vllm", head)
    check_head_loads("vllm", ROOT / "experiments" / "eagle3" / "artifacts" / "smollm2_135m")   # the committed head
