"""Serve the small MoE with SGLang on the H200 host and measure expert telemetry and the MoE-Spec budget.

Runs with the host's python3 and the offline bundle on PYTHONPATH (SGLang 0.5.14, Hydra; no mlflow):

    python3 -m experiments.moe.h200_serve --model DIR --out $OUT --phase decode|ngram|graphs [--ks 2,4,8]
        [--model-config kimi_k25_mini --site h200-kimi --override KEY=VALUE ...]

Every server is the ordinary runner's: the config composed for `site=h200 model=tiny_moe_dsv3` and an option,
its command line built by `harness.launch` (the site's SGLang flags, the engine adapter's model, speculation
and limit flags, the launcher `python -m sglang_patches.launch` applying the named patches in SGLang's
spawned processes too), started, health-checked and stopped by `harness.server.Server`.
- `decode`: baseline (no speculation) + `spec.moe_telemetry` (`expert_telemetry`), no CUDA graphs; every
  prompt greedy at concurrency 1, 4, 8: the reference outputs and decode-step expert counts.
- `ngram`: option E per k in --ks, on NGRAM whatever the model's option E drafts with, k draft tokens
  (`spec.num_draft_tokens` = k+1, chain drafts: bfs breadth 1), `moe_budget` + `expert_telemetry`, no CUDA
  graphs; B is set through a file between passes (budget grid --budgets, the first being the number of
  experts = unbudgeted) at each concurrency.
- `graphs`: tok/s with CUDA graphs: option E on NGRAM with --graph-k draft tokens, one server per B
  (`moe_budget` only).
Every request goes through the harness's client (`harness.client.WorkloadRunner`, streamed `/generate` with the
prompt's token ids, greedy); a request that fails fails its server's configuration.
Results: $OUT/<phase>.json (per pass: outputs, per-request accept length, tok/s, telemetry summary) and the
raw telemetry lines under $OUT/<phase>-telemetry/. A failing server is recorded with its log tail, and the
phase goes on with the next configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.config.paths import ROOT
from experiments.config.views import views_of
from experiments.engines import adapter_for
from experiments.engines.knobs import refuse_unused_knobs
from experiments.harness.client import RequestRecord, RequestSettings, WorkloadRunner, fixed_prompts
from experiments.harness.launch import LaunchSpec, build_launch_spec
from experiments.harness.server import Server, served_model_name
from experiments.harness.workloads.sampling import VisitPlan
from sglang_patches.moe_budget import BUDGET_FILE_ENV

PROMPTS = Path(__file__).with_name("prompts.json")
STARTUP_TIMEOUT_S = 400
REQUEST_TIMEOUT_S = 300   # per request, and between two of its stream events
PROMPT_VOCAB = 49152   # SmolLM2's, whose ids prompts.json holds (valid ids of any larger vocabulary too)
NO_GRAPHS = ["--disable-cuda-graph"]   # telemetry counts synchronise; graph replays run no Python
# chain drafts: one continuation per step, so a verify forward carries bs * (k+1) tokens
NGRAM_CHAIN = {"ngram.min_bfs_breadth": 1, "ngram.max_bfs_breadth": 1, "ngram.max_trie_depth": 18}
# NGRAM whatever option E drafts with for the model (Kimi's is EAGLE-3): an NGRAM verify always carries
# bs * (k+1) tokens, whatever was accepted, and loads no draft; EAGLE's settings are cleared, not left unused
NGRAM = {"method": "ngram", "draft_model": None, "num_steps": None, "topk": None, **NGRAM_CHAIN}


def launch_spec(a: argparse.Namespace, option: str, spec: dict, extra_args: list[str]) -> LaunchSpec:
    """The server for `+option=<option>` on `a.site` with the model config `a.model_config` served from
    `a.model`, `spec` settings (dotted keys under spec.), `a.overrides` (Hydra overrides) and `extra_args` on
    top; its engine limits sized for `a.concurrency`. A spec setting the engine would not use is refused
    (preflight.Refused), as the runner refuses it."""
    overrides = [f"site={a.site}", f"model={a.model_config}", f"+option={option}", *a.overrides]
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    cfg.model.path = str(a.model)
    cfg.workload.concurrency = list(a.concurrency)
    cfg.engine.extra_args = list(extra_args)
    for key, value in spec.items():
        OmegaConf.update(cfg, f"spec.{key}", value, force_add=True)
    run = views_of(cfg)
    refuse_unused_knobs(run)
    return build_launch_spec(run)


def telemetry_spec(folder: Path) -> dict:
    return {"moe_telemetry": True, "moe_telemetry_dir": str(folder.resolve())}


class RequestFailed(RuntimeError):
    """A request of a batch failed or was not sent; the server's configuration is recorded with the error."""


def generate_all(server: Server, prompts: list[dict], concurrency: int, max_new_tokens: int
                 ) -> tuple[list[RequestRecord], float]:
    """Every prompt once, greedy, through the harness's client with at most `concurrency` requests in flight: the
    records in the prompts' order and the wall seconds of the batch. RequestFailed when one of them failed."""
    # keyed by position: a warm-up batch may hold a prompt twice
    convs, render = fixed_prompts({str(i): p["token_ids"] for i, p in enumerate(prompts)})
    plan = VisitPlan(warmup=[], level_warmup={}, measured={(concurrency, 0): convs}, levels=[concurrency])
    settings = RequestSettings(max_new_tokens, 0.0, 0, REQUEST_TIMEOUT_S, REQUEST_TIMEOUT_S)
    with tempfile.TemporaryDirectory() as tmp:   # the client's records file; this script writes its own JSON
        runner = WorkloadRunner(server, adapter_for(server.spec.engine), served_model_name(server.spec.args) or "",
                                settings, render, Path(tmp) / "records.jsonl")
        (level,) = runner.run(plan)
    by_position = {r.prompt_id: r for r in level.records}
    failed = [r for r in level.records if r.error is not None]
    if failed or len(by_position) != len(prompts):
        first = f"; first: {failed[0].error_kind}: {failed[0].error}" if failed else ""
        raise RequestFailed(f"{len(failed)} of {len(prompts)} requests failed, {len(prompts) - len(by_position)} "
                            f"not sent, at concurrency {concurrency}{first}")
    return [by_position[str(i)] for i in range(len(prompts))], level.wall_s


def telemetry_lines(folder: Path) -> int:
    return sum(len(f.read_text().splitlines()) for f in folder.glob("experts-*.jsonl"))


def telemetry_since(folder: Path, skip: int) -> list[dict]:
    lines = [ln for f in sorted(folder.glob("experts-*.jsonl")) for ln in f.read_text().splitlines()]
    return [json.loads(ln) for ln in lines[skip:] if ln.strip()]


def summarise_telemetry(records: list[dict]) -> dict:
    """Mean distinct experts per MoE layer per forward, by forward mode and by (mode, tokens per forward)."""
    out: dict[str, dict] = {}
    for r in records:
        for key in (r["mode"], f"{r['mode']}@tokens={r['tokens']}@bs={r['bs']}"):
            d = out.setdefault(key, {"forwards": 0, "sum": 0.0, "per_layer_sum": None})
            d["forwards"] += 1
            d["sum"] += statistics.fmean(r["distinct"])
            d["per_layer_sum"] = [a + b for a, b in zip(d["per_layer_sum"], r["distinct"], strict=True)] \
                if d["per_layer_sum"] else list(r["distinct"])
    return {k: {"forwards": d["forwards"], "mean_distinct": d["sum"] / d["forwards"],
                "per_layer": [x / d["forwards"] for x in d["per_layer_sum"]]} for k, d in out.items()}


def run_pass(server: Server, prompts: list[dict], concurrency: int, max_new_tokens: int,
             telemetry: Path | None) -> dict:
    skip = telemetry_lines(telemetry) if telemetry else 0
    records, wall = generate_all(server, prompts, concurrency, max_new_tokens)
    requests = []
    for p, r in zip(prompts, records, strict=True):
        meta = r.meta or {}   # the finishing event's meta_info
        requests.append({"id": p["id"], "output_ids": r.output_token_ids, "text": r.text,
                         "completion_tokens": meta.get("completion_tokens"),
                         "spec_verify_ct": meta.get("spec_verify_ct"),
                         "spec_accept_length": meta.get("spec_accept_length"), "latency_s": r.e2e_s})
    tokens = sum(q["completion_tokens"] or 0 for q in requests)
    accept = [q["spec_accept_length"] for q in requests if q["spec_accept_length"] is not None]
    verify = sum(q["spec_verify_ct"] or 0 for q in requests)
    out = {"concurrency": concurrency, "wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
           "accept_length_mean_per_request": statistics.fmean(accept) if accept else None,
           "accept_length_tokens_per_verify": tokens / verify if verify else None, "requests": requests}
    if telemetry:
        recs = telemetry_since(telemetry, skip)
        out["telemetry"] = summarise_telemetry(recs)
        out["telemetry_forwards"] = len(recs)
    return out


def extend_pass(server: Server, prompts: list[dict], telemetry: Path) -> list[dict]:
    """Prefill prompt + SmolLM2's answer (real text), one request at a time: the extend forward's distinct experts
    per layer, to compare with the offline routing of exactly the same tokens (the last `tokens` of the text)."""
    rows = []
    for p in prompts:
        if not p.get("teacher_ids") or "#" in p["id"]:   # copies (--copies) are not the teacher's text
            continue
        skip = telemetry_lines(telemetry)
        generate_all(server, [{"token_ids": p["token_ids"] + p["teacher_ids"]}], 1, 1)
        recs = [r for r in telemetry_since(telemetry, skip) if r["mode"] == "extend"]
        if recs:
            rows.append({"id": p["id"], "tokens": recs[0]["tokens"], "distinct": recs[0]["distinct"],
                         "forwards": len(recs)})
    return rows


def warmup_batches(warmups: list[dict], levels: list[int]) -> list[list[dict]]:
    """One unrecorded batch per concurrency level, as wide as the level (cycling through the warm-up prompts): a
    level's first batch pays first-use costs (Triton kernels compiled per batch shape, graph replays) that would
    otherwise land on the first server's measured pass."""
    return [[warmups[i % len(warmups)] for i in range(c)] for c in levels]


def warm(server: Server, warmups: list[dict], levels: list[int], max_new_tokens: int) -> None:
    for batch in warmup_batches(warmups, levels):
        generate_all(server, batch, len(batch), max_new_tokens)


def served(spec: LaunchSpec, log: Path, record: dict, body: Callable[[Server], None]) -> None:
    """Start the server, record its command line and start-up time, run `body`, or record the error (the phase
    goes on); always stop the server. (A context manager cannot skip its body when the server never comes up.)"""
    server = Server(spec, log)
    t0 = time.time()
    try:
        server.start(STARTUP_TIMEOUT_S)
        record["healthy_after_s"] = time.time() - t0
        body(server)
    except Exception as exc:  # noqa: BLE001 - recorded, the phase goes on
        record["error"] = f"{exc!r}"
        print(f"server failed: {exc!r}"[:2000], flush=True)
    finally:
        record["cmd"] = spec.argv   # with the port it was started on
        server.stop()


def concurrency_passes(server: Server, a: argparse.Namespace, prompts: list[dict], tel: Path | None, label: str,
                       passes: list[dict], **tags) -> None:
    """Warm up on prompts never measured, then one pass per concurrency level, each tagged, reported and appended
    as it finishes (a later failure keeps the passes done)."""
    warm(server, a.warmups, a.concurrency, a.max_new_tokens)
    for c in a.concurrency:
        chosen = prompts[:max(c, a.pass_prompts)] if a.pass_prompts else prompts
        passes.append({**run_pass(server, chosen, c, a.max_new_tokens, tel), **tags})
        accept = passes[-1].get("accept_length_tokens_per_verify")
        print(f"{label} c={c}: {passes[-1]['tok_s']:.1f} tok/s" + (f", accept {accept}" if accept else ""),
              flush=True)


def phase_decode(a: argparse.Namespace, prompts: list[dict], out: Path) -> dict:
    tel = out / "decode-telemetry"
    spec = launch_spec(a, "baseline", telemetry_spec(tel), NO_GRAPHS)
    result = {"phase": "decode", "cmd": spec.argv, "passes": []}
    def body(server: Server) -> None:
        concurrency_passes(server, a, prompts, tel, "decode", result["passes"])
        result["extend"] = extend_pass(server, prompts, tel)
    served(spec, out / "logs" / "decode.log", result, body)
    return result


def phase_ngram(a: argparse.Namespace, prompts: list[dict], out: Path) -> dict:
    result = {"phase": "ngram", "configs": []}
    for k in a.ks:
        tel = out / f"ngram-k{k}-telemetry"
        budget_file = out / f"ngram-k{k}-budget.txt"
        budget_file.parent.mkdir(parents=True, exist_ok=True)
        budget_file.write_text(str(a.budgets[0]))
        spec = launch_spec(a, "E", {"num_draft_tokens": k + 1, **NGRAM, **telemetry_spec(tel),
                                    "moe_expert_budget": a.budgets[0]}, NO_GRAPHS)
        spec.env[BUDGET_FILE_ENV] = str(budget_file.resolve())   # read before the fixed budget: B between passes
        cfg = {"k": k, "cmd": spec.argv, "passes": []}
        result["configs"].append(cfg)
        def grid(server: Server, cfg=cfg, tel=tel, budget_file=budget_file, k=k) -> None:
            for b in a.budgets if k == a.budget_k else a.budgets[:1]:
                budget_file.write_text(str(b))
                time.sleep(0.05)
                concurrency_passes(server, a, prompts, tel, f"ngram k={k} B={b}", cfg["passes"], budget=b)
        served(spec, out / "logs" / f"ngram-k{k}.log", cfg, grid)
        write_result(out, result, done=False)
    return result


def phase_graphs(a: argparse.Namespace, prompts: list[dict], out: Path) -> dict:
    result = {"phase": "graphs", "k": a.graph_k, "configs": []}
    for b in a.budgets:
        spec = launch_spec(a, "E", {"num_draft_tokens": a.graph_k + 1, **NGRAM, "moe_expert_budget": b}, [])
        cfg = {"budget": b, "cmd": spec.argv, "passes": []}
        result["configs"].append(cfg)
        served(spec, out / "logs" / f"graphs-B{b}.log", cfg, lambda server, cfg=cfg, b=b: concurrency_passes(
            server, a, prompts, None, f"graphs B={b}", cfg["passes"]))
        write_result(out, result, done=False)
    return result


def write_result(out: Path, result: dict, done: bool = True) -> Path:
    """$OUT/<phase>.json, also after every server of a phase (`complete` false until the phase ends), so that a
    lease that ends mid-phase keeps the configurations measured."""
    path = out / f"{result['phase']}.json"
    path.write_text(json.dumps({**result, "complete": done}, indent=1, default=str))
    return path


def with_copies(prompts: list[dict], copies: int, vocab: int) -> list[dict]:
    """`copies` versions of every prompt, each copy's token ids shifted within the prompt sets' vocabulary so
    that no two share a prefix (SGLang's radix cache would skip their prefill): enough distinct requests to fill
    a high concurrency on a model whose weights are random, where what a prompt says does not matter."""
    out = []
    for i in range(copies):
        out += [{**p, "id": f"{p['id']}#{i}" if i else p["id"],
                 "token_ids": [(t + 7919 * i) % vocab for t in p["token_ids"]]} for p in prompts]
    return out


def measured_and_warmups(prompts: list[dict], copies: int, vocab: int) -> tuple[list[dict], list[dict]]:
    """The `copies` measured versions of every prompt, and one more shifted copy kept for warm-ups: a warm-up
    never shares a prefix with a measured prompt (NGRAM's trie and the radix cache would remember it)."""
    every = with_copies(prompts, copies + 1, vocab)
    return every[:copies * len(prompts)], every[copies * len(prompts):]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the model folder served")
    p.add_argument("--model-config", default="tiny_moe_dsv3", help="conf/model/<name>.yaml describing it")
    p.add_argument("--site", default="h200")
    p.add_argument("--override", dest="overrides", action="append", default=[],
                   help="a Hydra override on top (repeatable), e.g. model.moe.router_skew=1.0")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "moe-h200-out")))
    p.add_argument("--phase", choices=["decode", "ngram", "graphs"], required=True)
    p.add_argument("--ks", type=ints, default=[2, 4, 8], help="draft tokens per verify (NGRAM)")
    p.add_argument("--budgets", type=ints, default=[32, 16, 8, 4, 2], help="first = number of experts")
    p.add_argument("--budget-k", type=int, default=4, help="the k whose server sweeps the budget grid")
    p.add_argument("--graph-k", type=int, default=4)
    p.add_argument("--concurrency", type=ints, default=[1, 4, 8])
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=0, help="first N prompts only")
    p.add_argument("--copies", type=int, default=1, help="shifted copies of every prompt (random-weight models)")
    p.add_argument("--pass-prompts", type=int, default=0,
                   help="each pass sends the first max(concurrency, N) prompts (0: all of them)")
    a = p.parse_args(argv)
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    prompts = prompts[:a.limit] if a.limit else prompts
    prompts, a.warmups = measured_and_warmups(prompts, a.copies, PROMPT_VOCAB)
    a.out.mkdir(parents=True, exist_ok=True)
    run = {"decode": phase_decode, "ngram": phase_ngram, "graphs": phase_graphs}[a.phase]
    t0 = time.time()
    result = run(a, prompts, a.out)
    result.update({"model": str(a.model), "max_new_tokens": a.max_new_tokens, "concurrency": a.concurrency,
                   "seconds": time.time() - t0})
    print(f"wrote {write_result(a.out, result)} in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
