"""Flags of one site composed from another's: the ws.flags / ws.flag_reasons / ws.flag_value resolvers."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import experiments.config.paths  # noqa: F401  (registers the ws.* resolvers)
from experiments.config.flags import FlagChangeError, compose_flags, compose_reasons, flag_value, split_flags

BOX = ["--tp-size", "8", "--quantization", "compressed-tensors", "--disable-custom-all-reduce",
       "--cuda-graph-bs", "1", "2", "4", "--mem-fraction-static", "0.88"]
WHY = "a reason that is long enough"


def test_split_keeps_values_with_their_flag() -> None:
    assert split_flags(BOX)[3] == ("--cuda-graph-bs", ["1", "2", "4"])
    assert split_flags(BOX)[2] == ("--disable-custom-all-reduce", [])
    with pytest.raises(FlagChangeError):
        split_flags(["8", "--tp-size"])


def test_drop_change_and_add() -> None:
    changes = {"drop": {"--tp-size": {"reason": WHY}},
               "set": {"--mem-fraction-static": {"value": "0.8", "reason": WHY},
                       "--cuda-graph-bs": {"value": [1, 8], "reason": WHY},
                       "--load-format": {"value": "dummy", "reason": WHY},
                       "--enable-metrics": {"value": None, "reason": WHY}}}
    assert compose_flags(BOX, changes) == [
        "--quantization", "compressed-tensors", "--disable-custom-all-reduce", "--cuda-graph-bs", "1", "8",
        "--mem-fraction-static", "0.8", "--load-format", "dummy", "--enable-metrics"]
    assert compose_flags(BOX, {}) == BOX


def test_silent_or_impossible_changes_are_refused() -> None:
    with pytest.raises(FlagChangeError, match="no such flag"):
        compose_flags(BOX, {"drop": {"--tp-sizes": {"reason": WHY}}})
    with pytest.raises(FlagChangeError, match="needs a reason"):
        compose_flags(BOX, {"set": {"--mem-fraction-static": {"value": "0.8"}}})
    with pytest.raises(FlagChangeError, match="both dropped and set"):
        compose_flags(BOX, {"drop": {"--tp-size": {"reason": WHY}}, "set": {"--tp-size": {"value": 1, "reason": WHY}}})


def test_reasons_follow_the_flags() -> None:
    base = {"--tp-size": {"reason": "tp"}, "--quantization": {"reason": "q"}}
    changes = {"drop": {"--tp-size": {"reason": WHY}}, "set": {"--quantization": {"value": "x", "reason": WHY},
                                                              "--load-format": {"value": "dummy", "reason": WHY}}}
    got = compose_reasons(base, changes)
    assert set(got) == {"--quantization", "--load-format"}
    assert (got["--quantization"]["from_base"], got["--load-format"]["from_base"]) == ("changed", "added")


def test_flag_value() -> None:
    assert flag_value(BOX, "--mem-fraction-static") == "0.88"
    assert flag_value(BOX, "--cuda-graph-bs") == ["1", "2", "4"]
    assert flag_value(BOX, "--disable-custom-all-reduce") is None
    with pytest.raises(FlagChangeError):
        flag_value(BOX, "--nope")


def test_resolvers_work_inside_a_config() -> None:
    cfg = OmegaConf.create({"box": BOX, "changes": {"drop": {"--tp-size": {"reason": WHY}}},
                            "args": "${ws.flags:${box},${changes}}",
                            "mem": "${ws.flag_value:${box},--mem-fraction-static}"})
    assert cfg.args[:2] == ["--quantization", "compressed-tensors"] and cfg.mem == "0.88"
