"""SpecForge's flags as facts: the ast extractor on a small source tree, the committed fact sheet, and the check
that each form of option D's box plan uses only flags (and chat templates) its own SpecForge release knows."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import compose_cfg

from experiments.options.specforge_forms import (
    REVISIONS,
    chat_templates,
    check_commands,
    dir_reader,
    extract,
    load_sheet,
    program_flags,
)
from experiments.options.specforge_plan import (
    SPECFORGE_TARGET,
    check_current,
    check_scripts,
    commands,
    scripts_commands,
)

MIRROR = Path(os.environ.get("SPECFORGE_MIRROR", "/work/.mirror/sgl-project+SpecForge/repo"))

TRAIN = '''
import argparse
from pkg.args import TrackerArgs
MODES = ("a", "b")
def parse_args():
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("model")
    group.add_argument("--target-model-path", type=str, required=True)
    group.add_argument("--mode", choices=(*MODES, "c"), default="a")
    group.add_argument("--backend", choices=BACKENDS)
    group.add_argument("--verbose", action="store_true")
    parser.add_argument("overrides", nargs="*")
    TrackerArgs.add_args(parser.add_argument_group("tracker"))
    tracker = parser.add_argument_group("tracker2")
    TrackerArgs.add_args(tracker)
    add_unknown(tracker)
    return parser.parse_args()
'''
ARGS = '''
class TrackerArgs:
    @staticmethod
    def add_args(parser):
        parser.add_argument("--report-to", choices=["none", "mlflow"], default="none")
'''
CLI = '''
import argparse
def main():
    parser = argparse.ArgumentParser(prog="x")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train")
    train.add_argument("-c", "--config", required=True)
    export = sub.add_parser("export")
    export.add_argument("--to", choices=("hf", "sglang"), required=True)
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text("\ufeff" + TRAIN)   # a BOM, as some SpecForge files have
    (tmp_path / "pkg" / "args.py").write_text(ARGS)
    (tmp_path / "pkg" / "cli.py").write_text(CLI)
    return tmp_path


def test_extractor_follows_groups_helpers_and_subcommands(tree: Path) -> None:
    read = dir_reader(tree)
    flags = program_flags(read, "scripts/train.py")
    by_name = {e["names"][0]: e for e in flags["parsers"][""]}
    assert set(by_name) == {"--target-model-path", "--mode", "--backend", "--verbose", "--report-to"}
    assert by_name["--target-model-path"]["required"] and not by_name["--mode"]["required"]
    assert by_name["--mode"]["choices"] == ["a", "b", "c"]
    assert by_name["--backend"]["choices_from"] == "BACKENDS" and "choices" not in by_name["--backend"]
    assert not by_name["--verbose"]["takes_value"]
    assert by_name["--report-to"]["choices"] == ["none", "mlflow"]   # through the class helper, in another module
    assert flags["unresolved"] == ["scripts/train.py: add_unknown(...) adds to a parser; not followed"]
    cli = program_flags(read, "pkg/cli.py")["parsers"]
    assert cli["train"] == [{"names": ["-c", "--config"], "required": True, "takes_value": True}]
    assert cli["export"][0]["choices"] == ["hf", "sglang"]


def test_check_refuses_unknown_flags_missing_required_and_bad_choices(tree: Path) -> None:
    programs = {"scripts/train.py": program_flags(dir_reader(tree), "scripts/train.py")}
    good = "torchrun --nproc_per_node 8 /opt/sf/scripts/train.py --target-model-path /m --mode=b --verbose && echo ok"
    assert check_commands([good], programs) == []
    assert check_commands([good.replace("--verbose", "--verbse")], programs) == [
        "scripts/train.py: unknown flag --verbse"]
    assert check_commands(["python /opt/sf/scripts/train.py --mode c"], programs) == [
        "scripts/train.py: required flag --target-model-path not given"]
    assert check_commands([good.replace("--mode=b", "--report-to wandb")], programs) == [
        "scripts/train.py: --report-to wandb is not one of ['none', 'mlflow']"]
    assert check_commands(["python /opt/sf/scripts/train_eagle3.py --x 1"], programs) == [
        "scripts/train_eagle3.py: no such program in this revision"]


def test_fact_sheet_records_the_revisions() -> None:
    release, last, head = (load_sheet(k) for k in ("v0.2.0", "last-scripts", "head"))
    assert release["commit"].startswith("73e6f808") and release["subject"].startswith("bump version to v0.2.0")
    assert {r["version_txt"] for r in (release, last, head)} == {"0.2.0"}   # version.txt never moved past it
    assert "scripts/train_eagle3.py" in release["programs"] and "scripts/train_eagle3.py" in last["programs"]
    assert "kimi-k2-instruct" not in release["chat_templates"] and "kimi-k2-instruct" in last["chat_templates"]
    assert all(not p["unresolved"] for r in (release, last, head) for p in r["programs"].values())


@pytest.mark.skipif(not (MIRROR / "HEAD").exists(), reason="no SpecForge git mirror here (CI has no GitHub)")
def test_fact_sheet_is_what_the_mirror_says() -> None:
    sheet = extract(MIRROR)["revisions"]
    for label in ("v0.2.0", "last-scripts"):
        assert sheet[label] == load_sheet(label)
    assert sheet["head"]["commit"] == load_sheet("head")["commit"] or pytest.skip("the mirror moved on")
    assert sheet["head"] == load_sheet("head")
    assert set(REVISIONS) == {"v0.2.0", "last-scripts", "head"}


def test_scripts_form_uses_only_its_release_flags(tmp_path: Path) -> None:
    steps = scripts_commands(compose_cfg("site=blackwell", "+option=D"), tmp_path)
    assert check_scripts(steps) == []
    train = next(i for i, s in enumerate(steps) if "/scripts/train_eagle3.py" in s)
    misspelt = [*steps[:train], steps[train].replace("--ttt-length", "--ttt-lenght"), *steps[train + 1:]]
    assert check_scripts(misspelt) == ["scripts/train_eagle3.py: unknown flag --ttt-lenght"]
    dropped = [s.replace("--output-dir", "--cache-dir") if "train_eagle3" in s else s for s in steps]
    assert "scripts/train_eagle3.py: required flag --output-dir not given" in check_scripts(dropped)
    # The v0.2.0 release commit has every flag the form uses, but no Kimi chat template yet.
    release = check_scripts(steps, "v0.2.0")
    assert release and all("chat template kimi-k2-instruct is not registered" in p for p in release)


def test_current_form_against_the_installed_wheel_and_head_scripts(tmp_path: Path) -> None:
    if not (SPECFORGE_TARGET / "specforge" / "cli.py").exists():
        pytest.fail(f"SpecForge not installed at {SPECFORGE_TARGET}; run bin/setup")
    steps = commands(compose_cfg("site=blackwell", "+option=D"), tmp_path)
    assert check_current(steps) == []
    assert check_current([s.replace("--draft-config", "--draft-cfg") for s in steps]) == [
        "specforge/cli.py export: unknown flag --draft-cfg", "specforge/cli.py export: required flag --draft-config "
        "not given"]
    assert check_current(["specforge trian -c x.yaml"]) == ["specforge/cli.py trian: no such subcommand"]
    # HEAD's capture script resolves the aux layers from the draft config; 0.2.0's flag for them is gone.
    capture = next(s for s in steps if "prepare_hidden_states.py" in s)
    assert check_current([capture + " --enable-aux-hidden-states"]) == [
        "scripts/prepare_hidden_states.py: unknown flag --enable-aux-hidden-states"]
    # The wheel's CLI is the mirror HEAD's, flag for flag, and it registers the same chat templates.
    wheel = dir_reader(SPECFORGE_TARGET)
    assert program_flags(wheel, "specforge/cli.py") == load_sheet("head")["programs"]["specforge/cli.py"]
    assert chat_templates(wheel) == load_sheet("head")["chat_templates"]
