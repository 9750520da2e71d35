"""Regeneration with SGLang's offline engine (token ids in, token ids out), for a GPU host.

    python -m experiments.eagle3.sglang_regen --model DIR --convs IN.jsonl --out OUT.jsonl [...]

reads conversations (regen.conversation_record), answers them turn by turn (regen.regenerate: greedy, the
target's own answers in context) and writes the rows as JSONL. It runs in its own process, with the bundle's
site-packages first on the path (SGLang 0.5.14 needs the bundle's transformers; the trainer keeps the host's):
`run_subprocess` starts it and reads the rows back. Engine flags: the H200 site's (conf/site/h200.yaml).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from experiments.eagle3.regen import Generate, conversation_record, from_record, regenerate

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none"}
CHUNK = 4096          # requests per engine call: one progress line each


def _finished_ids(out: dict, eos_ids: list[int]) -> tuple[list[int], bool]:
    """An engine output as (answer ids ending with the end-of-turn token when it stopped there, finished)."""
    ids = [int(t) for t in out["output_ids"]]
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    stopped = reason.get("type") == "stop"
    if stopped and (not ids or ids[-1] not in eos_ids):
        matched = reason.get("matched")
        ids.append(matched if isinstance(matched, int) else eos_ids[0])
    return ids, stopped


def sglang_generate(engine, max_new_tokens: int, eos_ids: list[int], progress: Callable[[str], None]) -> Generate:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": eos_ids}

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        got: list[tuple[list[int], bool]] = []
        for b in range(0, len(prompts), CHUNK):
            outs = engine.generate(input_ids=prompts[b: b + CHUNK], sampling_params=params)
            got += [_finished_ids(o, eos_ids) for o in outs]
            progress(f"eagle3 regen (sglang): {len(got)}/{len(prompts)}")
        return got

    return generate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.eagle3.sglang_regen", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--convs", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-context-tokens", type=int, default=2048)
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import sglang
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    gen_cfg = json.loads(Path(a.model, "generation_config.json").read_text()) if Path(
        a.model, "generation_config.json").exists() else {}
    eos = gen_cfg.get("eos_token_id", tok.eos_token_id)
    eos_ids = sorted(set(eos if isinstance(eos, list) else [eos]))
    convs = [from_record(json.loads(line)) for line in a.convs.read_text().splitlines() if line.strip()]
    engine = sglang.Engine(model_path=a.model, skip_tokenizer_init=True, dtype="bfloat16", random_seed=a.seed,
                           mem_fraction_static=a.mem_fraction, context_length=a.max_context_tokens + a.max_new_tokens,
                           log_level="error", **ENGINE_ARGS)
    try:
        rows = regenerate(convs, tok, sglang_generate(engine, a.max_new_tokens, eos_ids, print), a.max_turns,
                          a.max_context_tokens, lambda m: print(m, flush=True))
    finally:
        engine.shutdown()
    tmp = a.out.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(a.out)
    return 0


def run_subprocess(convs: list, model: str, work: Path, max_turns: int, max_new_tokens: int,
                   max_context_tokens: int, seed: int, site: str | None,
                   progress: Callable[[str], None] = print) -> list[dict]:
    """Regenerate `convs` [(conversation, kind)] in a child process with `site` (the H200 bundle's
    site-packages) first on its path; its output lines go to `progress`."""
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / "sglang_regen.convs.jsonl", work / "sglang_regen.rows.jsonl"
    src.write_text("".join(json.dumps(conversation_record(c, k)) + "\n" for c, k in convs))
    path = [p for p in (site, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    argv = [sys.executable, "-m", "experiments.eagle3.sglang_regen", "--model", model, "--convs", str(src),
            "--out", str(out), "--max-turns", str(max_turns), "--max-new-tokens", str(max_new_tokens),
            "--max-context-tokens", str(max_context_tokens), "--seed", str(seed)]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        progress(line.rstrip())
    if proc.wait() != 0:
        raise RuntimeError(f"SGLang regeneration failed (exit {proc.returncode}); its output is above")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
