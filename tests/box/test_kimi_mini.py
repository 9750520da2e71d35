"""Kimi-K2.5 in miniature: the folder the builder writes (config from the model yaml, tokenizer, EAGLE-3 head config),
read back by transformers and by SGLang 0.5.14's own ModelConfig and compressed-tensors code on the CPU."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg
from transformers import AutoConfig, AutoTokenizer

from experiments.box import kimi_mini
from experiments.config.paths import cache_dir
from experiments.harness.preflight import check_head_fits

SGLANG_0_5_14 = cache_dir() / "sglang-0.5.14"
CHECK = Path(__file__).with_name("sglang_kimi_check.py")
# SGLang 0.5.14's model code imports these; bin/setup's overlay (a parser-only install) lacks them
MODEL_CODE_DEPS = ("einops", "compressed_tensors", "loguru")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kimi") / "mini"
    kimi_mini.build(out)
    return out


def test_config_is_the_yamls_with_the_layers_asked_for(folder: Path, tmp_path: Path) -> None:
    written = json.loads((folder / "config.json").read_text())
    assert written == kimi_mini.hf_config()
    composed = compose_cfg("site=h200-kimi", "+option=baseline").model
    assert written["num_hidden_layers"] == composed.arch.num_hidden_layers == composed.hf_config.num_hidden_layers
    six = kimi_mini.build(tmp_path / "six", layers=6)
    assert six["layers"] == 6 and json.loads((tmp_path / "six" / "config.json").read_text())["num_hidden_layers"] == 6
    with pytest.raises(ValueError, match="MoE layer"):
        kimi_mini.hf_config(1)


def test_kimi_shapes_and_int4_format(folder: Path) -> None:
    c = json.loads((folder / "config.json").read_text())
    assert (c["hidden_size"], c["intermediate_size"], c["moe_intermediate_size"]) == (7168, 18432, 2048)
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]) == (
        1536, 512, 64, 128, 128)
    assert (c["n_routed_experts"], c["n_shared_experts"], c["num_experts_per_tok"], c["first_k_dense_replace"]) == (
        384, 1, 8, 1)
    assert (c["scoring_func"], c["topk_method"], c["vocab_size"]) == ("sigmoid", "noaux_tc", 163840)
    q = c["quantization_config"]
    w = q["config_groups"]["group_0"]["weights"]
    assert (q["quant_method"], q["format"], w["num_bits"], w["symmetric"], w["group_size"]) == (
        "compressed-tensors", "pack-quantized", 4, True, 32)
    hf = AutoConfig.from_pretrained(folder)
    assert hf.model_type == "deepseek_v3" and hf.rope_scaling["factor"] == 64.0


def test_build_is_deterministic(folder: Path, tmp_path: Path) -> None:
    kimi_mini.build(tmp_path / "again")
    for path in folder.rglob("*"):
        if path.is_file():
            assert path.read_bytes() == (tmp_path / "again" / path.relative_to(folder)).read_bytes(), path.name


def test_tokenizer_has_kimis_size_and_special_ids(folder: Path) -> None:
    tok = AutoTokenizer.from_pretrained(folder)
    c = json.loads((folder / "config.json").read_text())
    assert len(tok) == c["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        c["bos_token_id"], c["eos_token_id"], c["pad_token_id"])
    gen = json.loads((folder / "generation_config.json").read_text())
    assert c["eos_token_id"] in gen["eos_token_id"] and max(gen["eos_token_id"]) < c["vocab_size"]


def test_every_workspace_prompt_round_trips(folder: Path) -> None:
    """No prompt word is unknown, and decoding then encoding gives the same ids (text joined with spaces)."""
    tok = AutoTokenizer.from_pretrained(folder)
    texts = kimi_mini.prompt_texts()
    assert len(texts) > 500
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, text[:80]
        assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids, text[:80]


def test_random_ids_round_trip_so_multi_turn_answers_re_encode(folder: Path) -> None:
    tok = AutoTokenizer.from_pretrained(folder)
    ids = random.Random(0).sample(range(min(tok.all_special_ids)), 400)
    assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids


def test_chat_template_renders_turns_and_the_generation_prompt(folder: Path) -> None:
    tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Why?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hello, world!"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>Hi.<|im_end|><|im_user|>user<|im_middle|>Why?"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.unk_token_id not in ids and ids[-3:] == tok.convert_tokens_to_ids(
        ["<|im_assistant|>", "assistant", "<|im_middle|>"])


def test_eagle3_head_fits_the_target_and_reads_three_distinct_layers(folder: Path) -> None:
    head = json.loads((folder / "eagle3" / "config.json").read_text())
    # null: the target's vocabulary and lm_head; the key itself must be there (SGLang's llama_eagle3 reads it)
    assert head["architectures"] == ["LlamaForCausalLMEagle3"] and head["draft_vocab_size"] is None
    check_head_fits(folder / "eagle3", folder)
    for layers in (3, 4, 5, 6, 7, 61):
        ids = kimi_mini.aux_layer_ids(layers)
        assert len(set(ids)) == 3 and all(0 <= i < layers for i in ids) and ids[0] != 1, (layers, ids)
    assert kimi_mini.aux_layer_ids(61) == [2, 30, 58]   # SGLang's own default for a 61-layer DeepSeek-V3 target


def test_weight_bytes_match_sglangs_int4_tensor_shapes() -> None:
    """The routed experts' bytes from the tensors SGLang's CompressedTensorsWNA16MoE creates per layer:
    w13/w2_weight_packed int32 (E, K/8, N), w13/w2_weight_scale bf16 (E, K/32, N)."""
    c = kimi_mini.hf_config()
    e, h, n = c["n_routed_experts"], c["hidden_size"], c["moe_intermediate_size"]
    packed = e * (h // 8) * (2 * n) * 4 + e * (n // 8) * h * 4
    scales = e * (h // 32) * (2 * n) * 2 + e * (n // 32) * h * 2
    sizes = kimi_mini.weight_bytes(c)
    assert sizes["routed_experts_per_moe_layer"] == packed + scales == 9_512_681_472
    parts = (4 * sizes["attention_per_layer"] + sizes["dense_mlp_per_dense_layer"] + sizes["embedding_and_lm_head"]
             + 3 * (sizes["routed_experts_per_moe_layer"] + sizes["shared_expert_and_router_per_moe_layer"]))
    assert sizes["total"] == parts


def test_memory_cli_prints_gib(capsys) -> None:
    assert kimi_mini.main(["memory", "--layers", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["routed_experts_per_moe_layer"] == "8.859 GiB" and "eagle3_head" in out
    assert kimi_mini.main(["build", "--out", "/nonexistent-dir-unused", "--layers", "1"]) == 2


def _sglang_0_5_14(folder: Path) -> dict:
    if not (SGLANG_0_5_14 / "sglang-0.5.14.dist-info").is_dir():
        pytest.fail(f"SGLang 0.5.14 overlay missing ({SGLANG_0_5_14}); run bin/setup")
    path = os.pathsep.join(p for p in (str(SGLANG_0_5_14), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print([m for m in "
                            f"{list(MODEL_CODE_DEPS)} if u.find_spec(m) is None])"], env=env, capture_output=True,
                           text=True)
    if probe.stdout.strip() != "[]":
        pytest.skip(f"SGLang 0.5.14's model code needs {probe.stdout.strip()} importable next to the overlay "
                    "(add them to bin/setup's overlay, or put them on PYTHONPATH)")
    proc = subprocess.run([sys.executable, str(CHECK), str(folder)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sglang_0_5_14_loads_the_folder_as_kimi(folder: Path) -> None:
    """ModelConfig, the quantization config and the scheme choice of SGLang 0.5.14, and its dummy loader's routing."""
    got = _sglang_0_5_14(folder)
    c = json.loads((folder / "config.json").read_text())
    assert got["version"] == "0.5.14" and got["model_class"] == "DeepseekV3ForCausalLM" and got["mla"]
    assert (got["kv_lora_rank"], got["qk_rope_head_dim"], got["qk_nope_head_dim"], got["v_head_dim"]) == (
        512, 64, 128, 128)
    assert got["text"] == {k: c[k] for k in got["text"]}
    assert got["quant_config"] == "CompressedTensorsConfig" and got["quantization"] == "compressed-tensors"
    assert set(got["linear_methods"].values()) == {"UnquantizedLinearMethod"}   # attention, shared, dense stay bf16
    assert {m["scheme"] for m in got["moe"].values()} == {"CompressedTensorsWNA16MoE"}   # Marlin WNA16 by default
    assert got["control_expert_weights"].startswith("num_bits=4 type='int' symmetric=True group_size=32")
    routing = got["dummy_routing"]
    # the dummy loader seeds every parameter alike: every MoE layer routes the same, to a handful of experts
    assert routing["layers_identical"]
    assert all(routing[k]["distinct_experts"] <= 32 for k in ("layer_1", "layer_2"))
    assert routing["layer_1"]["max_abs_sigmoid_minus_half"] < 0.1 * routing["layer_1"]["max_abs_bias"]
