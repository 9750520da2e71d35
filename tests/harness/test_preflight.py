"""Preflight refuses a bad input before anything starts, dry runs included, naming the value and the fix:
prompt sets, model folders, the engine's environment, the tracking store."""
from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
from conftest import SMOLLM2, compose_cfg

from experiments.harness import preflight
from experiments.harness.preflight import Refused, check_engine_env, check_inputs, check_tracking
from experiments.harness.server import POOL
from experiments.run import experiment

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
    started = time.monotonic()
    with pytest.raises(Refused, match=words):
        experiment(_dry(tmp_path, "workload=file", f"workload.prompt_set={path}"))
    assert time.monotonic() - started < 10


def test_model_folder_without_config_or_tokenizer_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(Refused, match=r"no Hugging Face folder at .*model \(no config\.json\); set model\.path"):
        check_inputs(_dry(tmp_path, f"model.path={model}", "model.embedded=false"))
    shutil.copy(SMOLLM2 / "config.json", model / "config.json")
    with pytest.raises(Refused, match=r"has no tokenizer files \(one of tokenizer\.json.*\); run `bin/setup`"):
        check_inputs(_dry(tmp_path, f"model.path={model}"))
    shutil.copy(SMOLLM2 / "tokenizer.json", model / "tokenizer.json")
    check_inputs(_dry(tmp_path, f"model.path={model}"))


def test_a_model_that_is_not_here_passes_a_dry_run(tmp_path: Path) -> None:
    """The box's model, checked from here: its folder is checked where it is served."""
    check_inputs(_dry(tmp_path, f"model.path={tmp_path / 'elsewhere'}"))


def test_missing_engine_interpreter_says_run_setup_even_in_a_dry_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(POOL, "acquire", lambda *a, **k: pytest.fail("a server was started"))
    missing = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(Refused, match=rf"interpreter {missing} \(engine\.python\) does not exist; run `bin/setup`"):
        experiment(_dry(tmp_path, f"engine.python={missing}"))


def test_interpreter_without_the_engine_is_refused(tmp_path: Path) -> None:
    no_vllm = tmp_path / "python"   # this interpreter, run from a path: it has no vLLM
    no_vllm.symlink_to(sys.executable)
    with pytest.raises(Refused, match=rf"{no_vllm} \(engine\.python\) cannot import vllm; run `bin/setup`"):
        check_engine_env(_dry(tmp_path, f"engine.python={no_vllm}"))


def test_tracking_folder_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(Refused, match=r"tracking\.uri=sqlite:///.*cannot create the folder .*file/store"):
        check_tracking(_dry(tmp_path, f"tracking.uri=sqlite:///{blocker / 'store' / 'mlflow.db'}"))
    with pytest.raises(Refused, match=r"tracking\.uri=offline://.*cannot create the folder"):
        check_tracking(_dry(tmp_path, f"tracking.uri=offline://{blocker / 'offline'}"))


def test_unresolvable_tracking_uri_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(Refused, match=r"tracking\.uri cannot be resolved .*set MLFLOW_TRACKING_URI"):
        check_tracking(compose_cfg("+option=A", "tracking=server"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tracking_server_that_does_not_answer_is_refused_within_seconds(tmp_path: Path, monkeypatch) -> None:
    closed = f"http://user:s3cr3t@127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(Refused, match=r"tracking\.uri=http://\*\*\*@127\.0\.0\.1:\d+: no answer") as refused:
        check_tracking(_dry(tmp_path, f"tracking.uri={closed}"))
    assert "s3cr3t" not in str(refused.value)
    assert time.monotonic() - started < 5
    monkeypatch.setattr(preflight, "TRACKING_TIMEOUT_S", 0.5)
    with socket.socket() as silent:   # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        started = time.monotonic()
        with pytest.raises(Refused, match=r"no answer within .*Timeout"):
            check_tracking(_dry(tmp_path, f"tracking.uri=http://127.0.0.1:{silent.getsockname()[1]}"))
        assert time.monotonic() - started < 3
