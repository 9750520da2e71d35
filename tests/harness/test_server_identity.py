"""A healthy port is used only when it is the server this runner started: a foreign server on the port (another
runner's, a stale one) is refused, and a fresh port is tried."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from experiments.config.paths import ROOT
from experiments.harness import server as server_module
from experiments.harness.launch import LaunchSpec
from experiments.harness.ports import free_port
from experiments.harness.server import ForeignServer, Server, served_model_name
from tests.helpers.loopback_server import MODULE


def _loopback(name: str, log: Path) -> Server:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    spec = LaunchSpec(engine="loopback", python=sys.executable, module=MODULE, health_path="/health", env=env,
                      args=["--ttft-ms", "1", "--itl-ms", "1", "--served-model-name", name])
    return Server(spec, log)


@pytest.fixture
def foreign(tmp_path: Path):
    other = _loopback("other", tmp_path / "foreign.log")
    other.start(30, health_poll_s=0.1)
    yield other
    other.stop()


def _served(server: Server) -> list[str]:
    return [m["id"] for m in httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]]


@pytest.mark.parametrize("name", ["mine", "other"])   # another model, or the same name from another process
def test_a_foreign_server_on_the_port_is_refused(foreign: Server, tmp_path: Path, monkeypatch, name: str) -> None:
    monkeypatch.setattr(server_module, "free_port", lambda *a, **k: foreign.spec.port)   # the port is lost to it
    ours = _loopback(name, tmp_path / "ours.log")
    with pytest.raises(ForeignServer, match=rf"127\.0\.0\.1:{foreign.spec.port} .*not .*server this runner started"):
        ours.start(30, attempts=2, health_poll_s=0.1)
    assert ours.proc is None   # ours was stopped, nothing left behind
    assert _served(foreign) == ["other"]


def test_after_a_foreign_server_a_fresh_port_is_used(foreign: Server, tmp_path: Path, monkeypatch) -> None:
    ports = iter([foreign.spec.port])
    monkeypatch.setattr(server_module, "free_port", lambda *a, **k: next(ports, None) or free_port())
    ours = _loopback("mine", tmp_path / "ours.log")
    ours.start(30, health_poll_s=0.1)
    try:
        assert ours.spec.port != foreign.spec.port and _served(ours) == ["mine"]
    finally:
        ours.stop()


def test_served_model_name_is_read_from_the_command_line() -> None:
    assert served_model_name(["--model", "/m", "--served-model-name", "smollm2_135m"]) == "smollm2_135m"
    assert served_model_name(["--served-model-name=kimi"]) == "kimi"
    assert served_model_name(["--model", "/m"]) is None
