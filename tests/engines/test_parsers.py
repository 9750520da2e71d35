"""Command lines are checked by the engines' own parsers: SGLang's ServerArgs (installed sglang) and
vLLM's serve parser + engine config (in vLLM's environment)."""
from __future__ import annotations

import sys

import pytest
from conftest import VLLM_PYTHON, compose_cfg

from experiments.config.views import typed_run
from experiments.engines.base import InvalidLaunch
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.harness.launch import build_launch_spec
from experiments.harness.pipeline import validated_spec
from experiments.harness.ports import free_port, port_is_free

sglang = pytest.importorskip("sglang")  # installed by bin/setup; CI has it


@pytest.mark.parametrize("option", ["baseline", "A", "B", "E"])
def test_blackwell_sglang_command_lines_pass_sglang_parser(option: str) -> None:
    cfg = compose_cfg(f"+option={option}", "site=blackwell")
    spec = build_launch_spec(typed_run(cfg))
    result = SGLangAdapter().validate(sys.executable, spec.args)
    assert result.ok, result.error
    assert result.version == sglang.__version__


def test_ngram_flags_reach_sglang() -> None:
    spec = build_launch_spec(typed_run(compose_cfg("+option=A", "site=blackwell", "spec.num_draft_tokens=6")))
    args = spec.args
    assert args[args.index("--speculative-algorithm") + 1] == "NGRAM"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "6"


def test_sglang_refuses_unknown_flag_with_its_own_message() -> None:
    result = SGLangAdapter().validate(sys.executable, ["--model-path", "x", "--speculative-window", "3"])
    assert not result.ok
    assert "unrecognized arguments: --speculative-window" in result.error


def test_sglang_refuses_bad_choice_with_its_own_message() -> None:
    argv = ["--model-path", "x", "--speculative-algorithm", "LOOKAHEAD"]
    result = SGLangAdapter().validate(sys.executable, argv)
    assert not result.ok
    assert "Unknown speculative algorithm name: LOOKAHEAD" in result.error


def test_sglang_refuses_unknown_attention_backend() -> None:
    result = SGLangAdapter().validate(sys.executable, ["--model-path", "x", "--attention-backend", "fa9"])
    assert not result.ok and "invalid choice: 'fa9'" in result.error


def test_vllm_accepts_option_a(embedded_ready) -> None:
    spec, validation = validated_spec(typed_run(compose_cfg("+option=A")))
    assert validation.ok and validation.version.startswith("0.")
    assert spec.python == str(VLLM_PYTHON)


def test_vllm_refuses_invalid_ngram_window_before_launch(embedded_ready) -> None:
    cfg = compose_cfg("+option=A", "spec.ngram.min_match=5", "spec.ngram.max_match=2")
    with pytest.raises(InvalidLaunch, match="prompt_lookup_min=5 must be <= prompt_lookup_max=2"):
        validated_spec(typed_run(cfg))


def test_vllm_refuses_unknown_flag(embedded_ready) -> None:
    cfg = compose_cfg("+option=baseline", "engine.extra_args=[--speculative-windowz,3]")
    with pytest.raises(InvalidLaunch, match="unrecognized arguments: --speculative-windowz"):
        validated_spec(typed_run(cfg))


def test_taken_port_is_replaced() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert not port_is_free(taken)
        other = free_port(taken)
        assert other != taken and port_is_free(other)
    assert free_port(other) == other


def test_an_api_key_from_the_environment_reaches_the_servers_and_never_the_record(monkeypatch) -> None:
    """server.api_key_env names the variable: SGLang gets --api-key (its parser takes it), vLLM VLLM_API_KEY (the
    same check as its --api-key, off the command line); the recorded launch spec holds neither."""
    from experiments.harness.preflight import Refused, check_option
    from experiments.tracking.redact import redact_text

    key = "sk-parser-key-5e1f"
    monkeypatch.setenv("SPECWS_TEST_API_KEY", key)
    spec = build_launch_spec(typed_run(compose_cfg("+option=A", "site=blackwell",
                                                   "server.api_key_env=SPECWS_TEST_API_KEY")))
    assert spec.args[spec.args.index("--api-key") + 1] == key and spec.api_key == key
    result = SGLangAdapter().validate(sys.executable, spec.args)
    assert result.ok, result.error
    vllm = build_launch_spec(typed_run(compose_cfg("+option=A", "server.api_key_env=SPECWS_TEST_API_KEY")))
    assert vllm.env["VLLM_API_KEY"] == key and "--api-key" not in vllm.args
    for recorded in (spec.to_dict(), vllm.to_dict()):
        assert key not in str(recorded)
    assert key not in redact_text(repr(spec))   # registered as a secret: masked in whatever prints it
    assert vllm.to_dict()["env"]["VLLM_API_KEY"] == "***"
    monkeypatch.delenv("SPECWS_TEST_API_KEY")
    with pytest.raises(Refused, match="the environment variable SPECWS_TEST_API_KEY is not set"):
        build_launch_spec(typed_run(compose_cfg("+option=A", "server.api_key_env=SPECWS_TEST_API_KEY")))
    with pytest.raises(Refused, match="--api-key is set in the config .*server.api_key_env"):
        check_option(typed_run(compose_cfg("+option=A", "site=blackwell",
                                           "engine.extra_args=[--api-key,sk-in-the-config]")))
