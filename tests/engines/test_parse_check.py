"""experiments/engines/parse_check.py: an engine's argparse parser and follow-up check run on a command line, every
refusal turned into the engine's message -- argparse's last line, or the check's exception -- and the limits the
check resolved passed back."""
from __future__ import annotations

import argparse

from experiments.engines.parse_check import parse_and_check


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--method", choices=["ngram", "eagle3"])
    return p


def _limits(ns: argparse.Namespace) -> dict:
    if ns.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {ns.max_num_seqs}")
    return {"max_num_seqs": ns.max_num_seqs}


def test_a_valid_command_line_returns_the_checks_limits() -> None:
    assert parse_and_check(_parser(), ["--max-num-seqs", "8"], _limits, "0.32") == \
        {"ok": True, "version": "0.32", "error": None, "limits": {"max_num_seqs": 8}}


def test_a_check_without_limits_leaves_the_key_out() -> None:
    assert parse_and_check(_parser(), [], lambda ns: None, "0.5.23") == {"ok": True, "version": "0.5.23", "error": None}
    assert "limits" not in parse_and_check(_parser(), [], lambda ns: {}, "v")


def test_an_argparse_refusal_is_its_last_line() -> None:
    result = parse_and_check(_parser(), ["--method", "medusa"], _limits, "0.32")
    assert (result["ok"], result["version"]) == (False, "0.32")
    assert result["error"].startswith("engine: error: argument --method: invalid choice: 'medusa'")


def test_an_unknown_flag_is_named() -> None:
    result = parse_and_check(_parser(), ["--no-such-flag"], _limits, "0.32")
    assert (result["ok"], result["error"]) == (False, "engine: error: unrecognized arguments: --no-such-flag")


def test_a_check_that_raises_gives_its_type_and_message() -> None:
    result = parse_and_check(_parser(), ["--max-num-seqs", "0"], _limits, "0.32")
    assert result == {"ok": False, "version": "0.32", "error": "ValueError: max_num_seqs must be positive, got 0"}


def test_a_help_flag_is_refused_by_name_not_with_an_index_error() -> None:
    result = parse_and_check(_parser(), ["--max-num-seqs", "8", "--help"], _limits, "0.32")
    assert (result["ok"], result["version"]) == (False, "0.32")
    assert result["error"] == "--help exits the parser without an error message (it is not a server flag)"


def test_a_silent_exit_without_a_known_flag_still_says_so() -> None:
    parser = _parser()
    parser.add_argument("--quit", action="store_true")

    def _parse(args=None, namespace=None):
        raise SystemExit(0)

    parser.parse_args = _parse
    assert parse_and_check(parser, ["--quit"], _limits, "v")["error"] == \
        "the command line exits the parser without an error message"
