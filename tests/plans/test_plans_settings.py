"""The knobs as keys: key=value arguments typed by the settings dataclass, an unknown key or a bad value refused
with a message that names it, Hydra overrides after `--`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from experiments.plans import d
from experiments.plans.settings import KnobError, describe, parse_knobs


@dataclass(frozen=True)
class Knobs:
    budget_s: float = 100
    gpus: int = 8
    eagle: Literal["B", "C"] = "C"
    fit: bool = True
    rates: str = "8,32"
    overrides: tuple[str, ...] = ()


def test_keys_take_typed_values_and_the_later_one_wins() -> None:
    k = parse_knobs(Knobs, ["budget_s=1300", "gpus=4", "eagle=B", "fit=false", "rates=4", "gpus=2",
                            "overrides=a=1 'b=[1, 2]'"])
    assert k == Knobs(1300.0, 2, "B", False, "4", ("a=1", "b=[1, 2]"))
    assert parse_knobs(Knobs, []) == Knobs()


def test_overrides_after_the_separator_follow_the_overrides_key() -> None:
    k = parse_knobs(Knobs, ["overrides=a=1", "--", "site=local", "fit=false"])
    assert k.overrides == ("a=1", "site=local", "fit=false") and k.fit is True


@pytest.mark.parametrize("args,message", [
    (["nope=1"], "unknown key 'nope'"),
    (["site=local"], "Hydra overrides after --"),
    (["budget_s"], "expected key=value"),
    (["gpus=4.5"], "gpus='4.5': not an integer"),
    (["budget_s=soon"], "not a number"),
    (["fit=maybe"], "true or false"),
    (["eagle=D"], "one of B, C"),
])
def test_an_unknown_key_or_a_bad_value_is_refused(args: list[str], message: str) -> None:
    with pytest.raises(KnobError, match=message.replace("[", r"\[")):
        parse_knobs(Knobs, args)


def test_a_plan_without_overrides_refuses_them() -> None:
    @dataclass(frozen=True)
    class Bare:
        n: int = 1

    with pytest.raises(KnobError, match="takes no overrides"):
        parse_knobs(Bare, ["--", "site=local"])


def test_the_d_plans_keys_from_the_command_line() -> None:
    s = parse_knobs(d.Settings, ["budget_s=1300", "minutes=6", "q25_minutes=2", "skip_train=1"])
    assert (s.budget_s, s.minutes, s.q25_minutes, s.skip_train, s.q25_need_s) == (1300, 6, 2, True, 240)
    assert "minutes=6" in describe(s) and "overrides=" in describe(s)
