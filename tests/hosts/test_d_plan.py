"""The option-D plan (experiments/plans/d.py) as `bin/h200 d` starts it: the trainer's flags parse and the second
data size reuses the full run's cached answers, and the whole lease rehearsed here from a carried work tree: the
trainer on the CPU (tiny; SGLang's offline engine stood in for by tests/helpers/sglang_stub.py, reached the way the
host reaches the bundle's), `bin/h200 head` returning the head, then every runner step dry-run against the head it
trained and the committed one (SGLang 0.5.14's parser, check_head on both), so that a lease is not spent on a step
refused at its start."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from experiments.config.paths import cache_dir
from experiments.eagle3.gpu import _data_settings, parser
from tests.helpers import sglang_stub
from tests.helpers.plans import dry_runs, host_stage, planned_steps

SMOLLM2 = cache_dir() / "models" / "SmolLM2-135M-Instruct"
STEPS = ["train", "train-fallback", "q25", "B-new", "t07-new", "t07-committed", "B-committed"]
# tiny trainer runs for the CPU rehearsal (appended to every trainer run: the last flag wins)
TINY = ("--device cpu --num-conversations 4 --val-fraction 0.4 --max-turns 2 --max-context-tokens 384 "
        "--max-new-tokens 6 --gen-batch 8 --steps 2 --eval-every 1 --batch-tokens 1024 --warmup-steps 1 --ttt-steps 4")


def trainer_args(argv: list[str]):
    """The parsed flags of a trainer step (`env -u PYTHONPATH python3 -m experiments.eagle3.gpu ...`)."""
    assert argv[:3] == ["env", "-u", "PYTHONPATH"], argv
    return parser().parse_args(argv[argv.index("experiments.eagle3.gpu") + 1:])


def test_the_second_data_size_reuses_the_served_heads_answers(tmp_path: Path) -> None:
    """The plan's trainer runs, as it plans them: SGLang regenerates every training conversation; the quarter
    run has that run's data key (its answers come from the cache, its held-out conversations are the same) and
    takes as many steps. Where the first run left no head, the fallback (transformers, 2,000 conversations)
    trains the served head, and the quarter run follows its data flags instead."""
    head = tmp_path / "cache" / "eagle3" / "heads" / "smollm2_135m-gpu"
    head.mkdir(parents=True)
    (head / "specws_eagle3.json").write_text(json.dumps({"steps": 1234}))
    steps = planned_steps("d", tmp_path)
    assert list(steps) == [s for s in STEPS if s != "train-fallback"]
    full, q25 = trainer_args(steps["train"]), trainer_args(steps["q25"])
    assert (full.data, full.regen, full.num_conversations, full.train_fraction) == ("sharegpt", "sglang", None, 1.0)
    assert full.eval_sets == [] and full.minutes == 3 and full.eval_every == 200 and full.name == "smollm2_135m-gpu"
    assert (full.max_turns, full.max_context_tokens, full.max_new_tokens, full.batch_tokens) == (4, 1536, 192, 32768)
    assert (q25.train_fraction, q25.name, q25.minutes, q25.steps) == (0.25, "smollm2_135m-gpu-q25", 3.5, 1234)
    assert _data_settings(q25, "cuda").key() == _data_settings(full, "cuda").key()
    for name in ("B-new", "B-committed", "t07-new", "t07-committed"):
        served = [a for a in steps[name] if a.startswith("spec.draft_model=")]
        assert served == [f"spec.draft_model={tmp_path}/cache/eagle3/heads/smollm2_135m"
                          f"{'-gpu' if name.endswith('new') else ''}-sglang"], (name, steps[name])

    (head / "specws_eagle3.json").unlink()
    steps = planned_steps("d", tmp_path)
    assert list(steps) == STEPS
    fallback, q25 = trainer_args(steps["train-fallback"]), trainer_args(steps["q25"])
    assert (fallback.regen, fallback.num_conversations, fallback.name) == ("transformers", 2000, full.name)
    assert _data_settings(q25, "cuda").key() == _data_settings(fallback, "cuda").key() != _data_settings(
        full, "cuda").key()
    # a fresh host after a lost one: the carried head is served, nothing trained (no answers are cached there)
    steps = planned_steps("d", tmp_path, "skip_train=true")
    assert list(steps) == ["B-new", "t07-new", "t07-committed", "B-committed"]


def test_the_knobs_reach_the_trainer_and_the_runs(tmp_path: Path) -> None:
    steps = planned_steps("d", tmp_path, "minutes=6", "q25_minutes=2", "prompts=32", "workloads=sharegpt",
                          "train_extra=--device cpu", "--", "run.dry_run=true")
    full, q25 = trainer_args(steps["train"]), trainer_args(steps["q25"])
    assert (full.minutes, q25.minutes, full.device, q25.device) == (6, 2, "cpu", "cpu")
    assert "workload.num_prompts=32" in steps["B-new"] and "workload=sharegpt" in steps["B-new"]
    assert steps["B-new"][-2:] == ["run.name=B-new-${workload.name}", f"hydra.sweep.dir={tmp_path}/sweeps/B-new"]
    assert steps["t07-new"].index("run.dry_run=true") < steps["t07-new"].index("workload=sharegpt")


def test_h200_d_stage_rehearses_the_lease(tmp_path: Path, embedded_ready) -> None:
    """`bin/h200 d`, `bin/h200 head`, `bin/h200 wait` as the lease's calls make them, with the trainer tiny on the
    CPU and run.dry_run=true for the runner: the head and its files come back with the log, the second data size
    trains on a quarter of the same answers against the same held-out turns, and every runner step passes the dry
    run with the new head and the committed one at c = 1 and 16 on both workloads (temperature 0.7 on ShareGPT's
    seed 1)."""
    site = sglang_stub.install(tmp_path / "stub-site")
    tree, dest, env = host_stage(tmp_path, SMOLLM2)
    started = subprocess.run(["bin/h200", "d", f"train_extra={TINY} --work {tmp_path / 'work'} --bundle-site {site}",
                              "--", "run.dry_run=true"], cwd=tree, env=env, capture_output=True, text=True,
                             timeout=300)
    assert started.returncode == 0 and "d: started" in started.stdout, started.stdout + started.stderr
    back = tmp_path / "out-head"
    head = subprocess.run(["bin/h200", "head", "600"], cwd=tree, env={**env, "OUT": str(back)}, capture_output=True,
                          text=True, timeout=660)
    assert head.returncode == 0, head.stdout[-3000:] + head.stderr[-3000:]
    assert sorted(p.name for p in (back / "head").iterdir()) == [
        "config.json", "data_manifest.json", "data_split.jsonl", "model.safetensors", "specws_eagle3.json",
        "train_curve.jsonl"]
    log = (back / "train.log").read_text()
    assert "stub sglang.Engine" in log and "eagle3 regen (sglang)" in log and "done: held-out" in log, log[-3000:]
    assert len(list(back.rglob("*"))) <= 8 + 1     # a call brings back at most 8 files (and the folder head/)
    curve = [json.loads(line) for line in (back / "head" / "train_curve.jsonl").open()]
    assert {"train/loss", "val/acc_0", "val/accept_length_est_3"} <= {c["name"] for c in curve}
    waited = subprocess.run(["bin/h200", "wait", "900"], cwd=tree, env={**env, "OUT": str(tmp_path / "out-wait")},
                            capture_output=True, text=True, timeout=960)
    plan_log = (dest / "plan.log").read_text()
    assert "plan: done" in waited.stdout, plan_log[-4000:]
    for step in ("train", "B-new", "B-committed", "q25", "t07-new", "t07-committed"):
        assert re.search(rf"== \S+ {re.escape(step)} rc=0 ", plan_log), (step, plan_log[-4000:])
    assert "train-fallback" not in plan_log
    full = json.loads((back / "head" / "specws_eagle3.json").read_text())
    q25 = json.loads((dest / "out" / "d" / "q25" / "specws_eagle3.json").read_text())
    assert q25["train_share"]["train_fraction"] == 0.25 and q25["data_key"] == full["data_key"]
    assert q25["val_sequences"] == full["val_sequences"] and q25["train_sequences"] < full["train_sequences"]
    assert "eagle3 regen" not in (dest / "out" / "d" / "q25.log").read_text()     # the answers came from the cache
    runs = dry_runs(dest / "runs")
    heads = {"new": str(dest / "cache/eagle3/heads/smollm2_135m-gpu-sglang"),
             "committed": str(dest / "cache/eagle3/heads/smollm2_135m-sglang")}
    seen = {(r.data.tags["mlflow.runName"], r.data.params["spec.draft_model"], r.data.params["workload.name"],
             r.data.params["workload.num_prompts"], r.data.params["workload.concurrency"],
             r.data.params["workload.temperature"], r.data.params["workload.seed"]) for r in runs}
    want = {(f"B-{h}-{w}", path, w, "64", "[1, 16]", "0.0", "0") for h, path in heads.items()
            for w in ("sharegpt", "mixed")}
    want |= {(f"B-{h}-sharegpt-t07", path, "sharegpt", "64", "[1, 16]", "0.7", "1") for h, path in heads.items()}
    assert seen == want, seen ^ want
    for run in runs:
        assert run.data.tags["specws.site"] == "h200" and run.data.tags["specws.engine_version"] == "0.5.14"
