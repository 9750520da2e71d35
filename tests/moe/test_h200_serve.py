"""experiments.moe.h200_serve's servers: the telemetry and budget phases verify with NGRAM on every model (Kimi's
option E drafts with EAGLE-3, whose verify carries what its head proposed), and a setting SGLang would not use
is refused before a server starts, as the runner refuses it."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config.errors import Refused
from experiments.config.paths import ROOT
from experiments.moe import h200_serve


def args(model: Path, model_config: str, site: str) -> argparse.Namespace:
    return argparse.Namespace(model=model, model_config=model_config, site=site, overrides=[],
                              concurrency=[1, 4, 16, 64])


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kimi") / "model"
    subprocess.run([sys.executable, "-m", "experiments.box.kimi_mini", "build", "--out", str(out)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.mark.parametrize("model_config, site", [("kimi_k25_mini", "h200-kimi"), ("tiny_moe_dsv3", "h200")])
def test_budget_phases_verify_with_ngram_chains(kimi: Path, model_config: str, site: str) -> None:
    spec = h200_serve.launch_spec(args(kimi, model_config, site), "E",
                                  {"num_draft_tokens": 5, **h200_serve.NGRAM, "moe_expert_budget": 64}, [])
    argv = spec.argv
    assert argv[argv.index("--speculative-algorithm") + 1] == "NGRAM"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "5"
    assert argv[argv.index("--speculative-ngram-max-bfs-breadth") + 1] == "1"
    assert "--speculative-draft-model-path" not in argv and "--speculative-num-steps" not in argv
    assert spec.env["SPECWS_MOE_EXPERT_BUDGET"] == "64"


def test_a_setting_sglang_would_not_use_is_refused(kimi: Path) -> None:
    # chain-draft settings on Kimi's option E as it stands (EAGLE-3): SGLang would not pass them
    with pytest.raises(Refused, match="spec.ngram.max_bfs_breadth"):
        h200_serve.launch_spec(args(kimi, "kimi_k25_mini", "h200-kimi"), "E",
                               {"num_draft_tokens": 4, **h200_serve.NGRAM_CHAIN}, [])


def test_warmups_are_a_copy_never_measured() -> None:
    base = [{"id": f"p{i}", "token_ids": [i * 10 + j for j in range(6)]} for i in range(5)]
    measured, warmups = h200_serve.measured_and_warmups(base, 3, h200_serve.PROMPT_VOCAB)
    assert len(measured) == 15 and len(warmups) == 5
    assert measured[:5] == base                      # the first copy is the prompts themselves
    assert not {p["id"] for p in measured} & {p["id"] for p in warmups}
    firsts = {tuple(p["token_ids"][:2]) for p in measured}
    assert not firsts & {tuple(p["token_ids"][:2]) for p in warmups}


def test_every_level_gets_a_warmup_batch_as_wide_as_itself() -> None:
    warmups = [{"id": f"w{i}", "token_ids": [i]} for i in range(3)]
    batches = h200_serve.warmup_batches(warmups, [1, 4, 16])
    assert [len(b) for b in batches] == [1, 4, 16]
    assert {p["id"] for p in batches[2]} == {"w0", "w1", "w2"}
