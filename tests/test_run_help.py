"""`python -m experiments.run --help` (conf/hydra/help/specws.yaml): says what each option is, lists the workloads and
sites a user can pick (and only those: no internal group such as workload/_base), and exits 0."""
from __future__ import annotations

import re
import subprocess
import sys

from experiments.config.paths import ROOT

CONF = ROOT / "conf"


def test_help_names_options_workloads_and_sites() -> None:
    out = subprocess.run([sys.executable, "-m", "experiments.run", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # each option on a line of its own, with words saying what it is
    for option, words in {"A": "n-gram", "B": "SGLang + an EAGLE-3", "C": "vLLM + the same EAGLE-3",
                          "D": "train an EAGLE-3 head", "E": "MoE expert budget"}.items():
        assert re.search(rf"^\s+{option}\s+.*{re.escape(words)}", text, re.M), f"option {option} not described"
    assert "Kimi-K2.5" in text and "Blackwell" in text and "SmolLM2" in text
    assert "python -m experiments.run +option=A workload=quick" in text
    assert "python -m experiments.run -m +option=A spec.num_draft_tokens=2,4,8" in text
    words = set(re.findall(r"[\w.-]+", text))
    # every workload and site a user can choose is listed; the internal ones are not
    for group in ("option", "workload", "site"):
        names = {p.stem for p in (CONF / group).glob("*.yaml")}
        public = {n for n in names if not n.startswith("_")}
        assert public <= words, f"{group}: {sorted(public - words)} missing from --help"
        assert not (names - public) & words, f"{group}: internal {sorted(names - public)} listed"
    assert "quick" in words and "_base" not in text
