"""Each engine's EAGLE-3 head layout is its adapter's, and the export reads it where OmegaConf is missing."""
from __future__ import annotations

import subprocess
import sys

import pytest

from experiments.config.paths import ROOT
from experiments.engines import adapter_for


def test_each_adapter_reads_aux_ids_its_own_way() -> None:
    assert adapter_for("vllm").head_layout.aux_layer_ids((2, 15, 27)) == [2, 15, 27]
    assert adapter_for("sglang").head_layout.aux_layer_ids((2, 15, 27)) == [1, 14, 26]


def test_an_embedding_feature_has_no_sglang_id() -> None:
    with pytest.raises(ValueError, match="cannot be expressed for sglang"):
        adapter_for("sglang").head_layout.aux_layer_ids((0, 3))


def test_the_export_imports_without_omegaconf() -> None:
    """As on the H200 host and in vLLM's environment: OmegaConf cannot be imported there."""
    code = ("import sys; sys.modules['omegaconf'] = None; from experiments.eagle3.export import head_config_json; "
            "from experiments.eagle3.head import HeadConfig; "
            "c = HeadConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, "
            "head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64, vocab_size=50, "
            "draft_vocab_size=20, aux_layer_ids=(2, 3, 5)); "
            "print(head_config_json(c, 'sglang')['eagle_config']['eagle_aux_hidden_state_layer_ids'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[1, 2, 4]"
