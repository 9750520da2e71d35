"""The engines' own logs read back as data: the committed H200 and vLLM-CPU leases' server logs, as the runner
stored them."""
from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from experiments.config.paths import ROOT
from experiments.engines.server_log import parse_log, read_log, resolved_args, split_top_level

JOURNAL = ROOT / "docs" / "journal"
# (lease, offline run id of the run whose server log is read)
H200C_B, H200_1201_B = ("2026-11-30-h200c", "27e9186ba69b4abea1edc0ffcdae68d6"), \
    ("2026-12-01-h200", "3b6c2dd915e74a3386bcfc3179095010")
CPU_A = ("2026-12-03-cpu", "778689d3a7644e2da7c8759a4a06d8a3")


def server_log(lease_run: tuple[str, str], tmp: Path) -> Path:
    lease, run = lease_run
    with tarfile.open(JOURNAL / lease / "runs.tar.xz") as tar:
        members = [m for m in tar.getmembers() if f"/{run}/artifacts/server/" in m.name and m.name.endswith(".log")]
        tar.extractall(tmp, members=members, filter="data")
    (log,) = tmp.rglob("*.log")
    return log


def test_sglang_server_args_and_captured_graphs_of_the_two_b_leases(tmp_path: Path) -> None:
    old, new = read_log(server_log(H200C_B, tmp_path / "a")), read_log(server_log(H200_1201_B, tmp_path / "b"))
    assert (old.engine, old.version, new.version) == ("sglang", "0.5.14", "0.5.14")
    assert len(old.args) > 300 and old.args.keys() == new.args.keys()
    assert (old.args["max_running_requests"], new.args["max_running_requests"]) == (48, 8)
    assert old.args["speculative_draft_model_path"].endswith("smollm2_135m-gpu-sglang")
    assert old.args["disable_overlap_schedule"] is False and old.args["attention_backend"] == "triton"
    # SGLang reset the limit to 48 for speculation and captured graphs up to the decode cap (32); at 8, up to 8
    assert set(old.graphs) == {"target verify", "draft decode", "draft extend"}
    assert old.graphs["target verify"]["bs"][-1] == 32 and len(old.graphs["target verify"]["bs"]) == 20
    assert new.graphs["target verify"] == {"backend": "full", "num_tokens_per_bs": 4, "bs": [1, 2, 3, 4, 5, 6, 7, 8]}
    differ = sorted(k for k in old.args if old.args[k] != new.args[k])
    assert differ == ["max_running_requests", "port", "random_seed", "speculative_draft_model_path"]


def test_vllm_non_default_args_and_engine_config(tmp_path: Path) -> None:
    facts = read_log(server_log(CPU_A, tmp_path))
    assert (facts.engine, facts.version) == ("vllm", "0.32.0")
    assert facts.non_default["max_num_seqs"] == 4
    assert facts.non_default["speculative_config"]["num_speculative_tokens"] == 4
    assert facts.args["enable_prefix_caching"] is True and facts.args["device_config"] == "cpu"
    assert facts.graphs == {"cudagraph": {"bs": []}}   # the CPU captures no graphs
    args = resolved_args({"log": facts.to_dict()})
    assert args["config.max_num_seqs"] == 4 and args["max_seq_len"] == 2048


def test_the_last_start_of_an_appended_log_is_read() -> None:
    first = "$ python3 -m sglang ...\n[t] server_args=ServerArgs(max_running_requests=48, port=1)\n"
    second = "$ python3 -m sglang ...\n[t] server_args=ServerArgs(max_running_requests=8, port=2)\n" \
             "[t] Capture cuda graph bs [1, 2, 4, 8]\n"
    facts = parse_log(first + second)
    assert facts.args == {"max_running_requests": 8, "port": 2} and facts.graphs == {"decode": {"bs": [1, 2, 4, 8]}}
    assert not parse_log("no server here\n").found and not read_log(Path("/nonexistent.log")).found


@pytest.mark.parametrize("text, parts", [
    ("a=1, b='x, y', c=[1, (2, 3)], d={'k': 'v,w'}", ["a=1", "b='x, y'", "c=[1, (2, 3)]", "d={'k': 'v,w'}"]),
    (r"a='it\'s, fine', b=Foo(x=1, y=2)", [r"a='it\'s, fine'", "b=Foo(x=1, y=2)"]),
])
def test_split_top_level_keeps_quotes_and_brackets_whole(text: str, parts: list[str]) -> None:
    assert split_top_level(text) == parts
