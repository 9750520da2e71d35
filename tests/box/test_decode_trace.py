"""experiments.box.decode_trace on the loopback server (SGLang's streamed /generate): a profile pass keeps c
requests decoding through the harness's client while it asks for the profile over plain HTTP; the command warms
the server up, then profiles each concurrency and writes what it got."""
from __future__ import annotations

import json
from pathlib import Path

from experiments.box import decode_trace
from tests.helpers.loopback_server import sent_times, start_loopback


class ProfileAsked:
    """Stands in for SGLang's POST /start_profile: notes the body and how many requests had finished, and writes
    the trace file a TP rank would."""

    def __init__(self, server) -> None:
        self.server, self.calls = server, []

    def __call__(self, url: str, json: dict, timeout: float):
        self.calls.append((url, json, len(sent_times(self.server))))
        Path(json["output_dir"], "0-TP-0.trace.json.gz").write_bytes(b"")
        return self

    def raise_for_status(self) -> None:
        pass


def test_the_profile_is_asked_while_the_batch_decodes(tmp_path: Path, monkeypatch) -> None:
    # 8 tokens 500 ms apart: every request still decodes when the profile is asked, 2 s in
    server = start_loopback(ttft_ms=5.0, itl_ms=500.0, log_path=tmp_path / "server.log")
    server.spec.engine = "sglang"   # the loopback speaks SGLang's streamed /generate
    asked = ProfileAsked(server)
    monkeypatch.setattr(decode_trace.httpx, "post", asked)
    prompts = [{"id": f"p{i}", "token_ids": [i, 1]} for i in range(3)]
    try:
        out = decode_trace.profile_pass(server, prompts, 4, 8, tmp_path / "c4", num_steps=5)
    finally:
        server.stop()
    (url, body, finished), = asked.calls
    assert url.endswith("/start_profile") and finished == 0
    assert body == {"output_dir": str((tmp_path / "c4").resolve()), "num_steps": 5, "activities": ["GPU"]}
    assert out == {"concurrency": 4, "num_steps": 5, "traces": [str(tmp_path / "c4" / "0-TP-0.trace.json.gz")],
                   "output_tokens": 32}


def test_the_command_warms_up_then_profiles_every_concurrency(tmp_path: Path, monkeypatch) -> None:
    server = start_loopback(ttft_ms=5.0, itl_ms=2.0, log_path=tmp_path / "server.log")
    server.spec.engine = "sglang"
    asked = ProfileAsked(server)
    monkeypatch.setattr(decode_trace.httpx, "post", asked)
    monkeypatch.setattr(decode_trace, "launch_spec", lambda *args: None)   # the server is the loopback's

    def served(spec, log: Path, record: dict, body) -> None:   # as h200_serve.served, without catching
        body(server)

    monkeypatch.setattr(decode_trace, "served", served)
    try:
        assert decode_trace.main(["--model", "unused", "--out", str(tmp_path / "out"), "--concurrency", "1,3",
                                  "--max-new-tokens", "4", "--num-steps", "2"]) == 0
        sent = [v for _, v in sorted(sent_times(server).items(), key=lambda kv: int(kv[0]))]
    finally:
        server.stop()
    record = json.loads((tmp_path / "out" / "decode_trace.json").read_text())
    passes = [(p["concurrency"], p["output_tokens"], len(p["traces"])) for p in record["passes"]]
    assert passes == [(1, 4, 1), (3, 12, 1)]
    assert [len(s["times"]) for s in sent] == [8, 8, 4, 4, 4, 4]   # two warm-ups of 8 tokens first
    assert [c[1]["output_dir"] for c in asked.calls] == [str((tmp_path / "out" / f"c{c}").resolve()) for c in (1, 3)]
