"""Option D's data switch: `train.data=sharegpt` composes into the ShareGPT settings, and the split is logged as
MLflow datasets (training, validation, excluded) with the manifest, on a real SQLite store."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SMOLLM2, compose_cfg
from omegaconf import OmegaConf

from experiments.eagle3.sharegpt_data import sharegpt_settings, split_records
from experiments.eagle3.split import build_split, write_manifest


def test_train_data_switch_composes_to_sharegpt_settings(tmp_path: Path):
    import experiments.harness.preflight  # noqa: F401  (registers ws.add)

    assert compose_cfg("+option=D").train.data == "synthetic"
    cfg = compose_cfg("+option=D", "train.data=sharegpt", "train.sharegpt.max_turns=2",
                      f"train.sharegpt.exclude_files=[{tmp_path / 'bench.jsonl'}]")
    (tmp_path / "bench.jsonl").write_text('{"turns": ["hi"]}\n')
    s = sharegpt_settings(str(SMOLLM2), cfg.train.seed, cfg.train.max_new_tokens, "cpu", 64,
                          OmegaConf.to_container(cfg.train.sharegpt, resolve=True))
    assert (s.max_turns, s.split.num_conversations, s.split.exclude_files) == (2, 256, (str(tmp_path / "bench.jsonl"),))
    assert s.key() != sharegpt_settings(str(SMOLLM2), 0, 128, "cpu", 64, {"max_turns": 3}).key()
    with pytest.raises(ValueError, match="unknown sharegpt data settings"):
        sharegpt_settings(str(SMOLLM2), 0, 128, "cpu", 64, {"max_turn": 3})
    from experiments.eagle3.train import train_head

    with pytest.raises(ValueError, match="data='templates'"):
        train_head(tmp_path / "head", data="templates", model_path=SMOLLM2, device="cpu")


def test_split_is_logged_as_mlflow_datasets(tmp_path: Path, store: str):
    from mlflow.tracking import MlflowClient

    from experiments.eagle3.split import SplitSettings
    from experiments.options.train_head import log_data_split

    split = build_split(SplitSettings(num_conversations=40, val_fraction=0.1))
    manifest = write_manifest(split, tmp_path / "data_manifest.json")
    lines = tmp_path / "data_split.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in split_records(split)))
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("d")).info.run_id
    log_data_split(client, run_id, manifest, lines)
    inputs = client.get_run(run_id).inputs.dataset_inputs
    got = {i.tags[0].value: i.dataset for i in inputs}
    assert set(got) == {"training", "validation", "excluded"}
    counts = {ctx: json.loads(d.profile)["num_rows"] for ctx, d in got.items()}
    assert counts == {"training": 40, "validation": split.manifest["val"], "excluded": split.manifest["excluded"]}
    assert got["training"].digest == split.manifest["train_ids_sha256"][:36]
    logged = json.loads(Path(client.download_artifacts(run_id, "data_manifest.json", str(tmp_path))).read_text())
    assert logged["excluded_by_reason"] == split.manifest["excluded_by_reason"]
