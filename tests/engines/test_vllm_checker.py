"""The session's vLLM checker (`vllm_check.py --serve`) answers exactly as a fresh `vllm_check.py` process does."""
from __future__ import annotations

import json
import sys

from conftest import SMOLLM2, VLLM_PYTHON

from experiments.engines.vllm_engine import VLLMAdapter, _check_in, ask_checker, model_config_present

BASE = ["--model", str(SMOLLM2), "--dtype", "bfloat16", "--max-model-len", "2048"]
BAD_WINDOW = json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                         "prompt_lookup_min": 5, "prompt_lookup_max": 2})
ARGVS = [BASE + ["--max-num-seqs", "4"],                       # accepted, engine config resolved
         BASE + ["--max-num-seqz", "4"],                       # refused by the parser
         BASE + ["--speculative-config", BAD_WINDOW],          # refused by the engine config
         ["--model", "/nonexistent", "--max-num-seqs", "2"]]   # no model folder: the parser only


def test_checker_answers_as_a_fresh_process(vllm_checker, embedded_ready) -> None:
    checks = [[model_config_present(a), a] for a in ARGVS]
    served = ask_checker(str(VLLM_PYTHON), checks)
    assert vllm_checker and served is not None, "the session's checker did not answer"
    assert served == _check_in(str(VLLM_PYTHON), checks)
    ok, unknown_flag, bad_window, parser_only = VLLMAdapter().validate_many(str(VLLM_PYTHON), ARGVS)
    assert ok.ok and ok.limits["max_num_seqs"] == 4 and ok.limits["max_model_len"] == 2048
    assert not unknown_flag.ok and "--max-num-seqz" in unknown_flag.error
    assert not bad_window.ok and "prompt_lookup_min=5 must be <= prompt_lookup_max=2" in bad_window.error
    assert parser_only.ok and parser_only.limits == {}


def test_checker_leaves_another_interpreter_to_its_own_process(vllm_checker, embedded_ready) -> None:
    assert vllm_checker
    assert ask_checker(sys.executable, [[False, ["--model", "x"]]]) is None
