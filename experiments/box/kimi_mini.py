"""Kimi-K2.5 in miniature: the model folder SGLang 0.5.14 serves with `--load-format dummy` (random weights made by
SGLang on the GPU host; nothing big is written here or travels).

    python -m experiments.box.kimi_mini build --out DIR [--layers N]   # seconds; deterministic
    python -m experiments.box.kimi_mini memory [--layers N]            # weight bytes as SGLang holds them

DIR gets config.json (conf/model/kimi_k25_mini.yaml `hf_config`, the one source of truth), generation_config.json,
a fast tokenizer of Kimi's vocabulary size (WordLevel over the words of the workspace's prompt sets, filler words up
to 163,840 ids, Kimi's special tokens at Kimi's ids, a chat template) and DIR/eagle3/config.json: an EAGLE-3 head of
Kimi's drafter shapes. The head has no weights file: SGLang's draft worker loads with the target's --load-format
(scheduler.py: --speculative-draft-load-format unset), so dummy weights are made for it too.
Runs with the H200 host's python3: only the standard library, tokenizers and omegaconf are imported.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

ROOT = Path(__file__).resolve().parents[2]
MODEL_YAML = ROOT / "conf" / "model" / "kimi_k25_mini.yaml"
PROMPT_SETS = ROOT / "experiments" / "prompt_sets"
UNK = "[UNK]"
# Kimi's chat template in outline: <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>, then the assistant's turn.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set role = m['role'] if m['role'] in ['system', 'user', 'assistant'] else 'user' -%}"
    "<|im_{{ role }}|>{{ role }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
ROLE_WORDS = ("system", "user", "assistant")


def model_yaml() -> dict:
    """The miniature's model config (only its plain sections; `path` and friends need the workspace resolvers)."""
    conf = OmegaConf.load(MODEL_YAML)
    return {k: OmegaConf.to_container(conf[k]) for k in ("hf_config", "eagle3_config", "tokenizer")}


def hf_config(layers: int | None = None) -> dict:
    """config.json of the miniature: Kimi-K2.5's text config with `layers` layers (the yaml's default if None)."""
    cfg = model_yaml()["hf_config"]
    if layers is not None:
        if layers <= cfg["first_k_dense_replace"]:
            raise ValueError(f"--layers {layers}: needs more than {cfg['first_k_dense_replace']} (the dense layers) "
                             "to have a MoE layer")
        cfg["num_hidden_layers"] = layers
    return cfg


def aux_layer_ids(layers: int) -> list[int]:
    """Target layers whose inputs the EAGLE-3 head reads. SGLang's default for DeepSeek-V3 targets is
    [2, n // 2, n - 3] ([2, 30, 58] for Kimi's 61 layers); it captures by membership, so a repeated id loses a
    hidden state and the head's fc (3 x hidden) would get 2 x hidden. A list starting with 1 is shifted by one."""
    default = [2, layers // 2, layers - 3]
    if len(set(default)) == 3 and min(default) >= 0:
        return default
    if layers < 3:
        raise ValueError(f"an EAGLE-3 head needs 3 distinct target layers; the miniature has {layers}")
    return [2, 1, 0] if layers == 3 else [2, 1, layers - 1]


def eagle3_config(layers: int) -> dict:
    cfg = model_yaml()["eagle3_config"]
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(layers), "use_aux_hidden_state": True}
    return cfg


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def prompt_texts(folder: Path = PROMPT_SETS) -> list[str]:
    """Every string of every row of the workspace's prompt sets (turns, messages, prompts, contexts)."""
    texts = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                texts += _strings(json.loads(line))
    return texts


def words_of(texts: list[str]) -> list[str]:
    """The pre-tokenizer's words of `texts`, first-seen order, no duplicates."""
    split = pre_tokenizers.Whitespace()
    seen: dict[str, None] = {}
    for text in texts:
        for word, _ in split.pre_tokenize_str(text):
            seen.setdefault(word, None)
    return list(seen)


def vocabulary(words: list[str], vocab_size: int, specials: dict[str, int]) -> dict[str, int]:
    """Words at ids 0.., filler words up to the first special id, specials at their ids, reserved names for the
    ids between and after them: exactly `vocab_size` entries."""
    first_special = min(specials.values())
    words = [w for w in dict.fromkeys([*ROLE_WORDS, *words]) if w not in specials]
    if len(words) > first_special:
        raise ValueError(f"{len(words)} words do not fit below the first special id {first_special}")
    vocab = {w: i for i, w in enumerate(words)}
    filler = 0
    while len(vocab) < first_special:
        name = f"w{filler:06d}"   # one pre-tokenizer word, so generated text re-encodes to the same id
        filler += 1
        vocab.setdefault(name, len(vocab))
    taken = set(specials.values())
    reserved = {f"<|reserved_{i}|>": i for i in range(first_special, vocab_size) if i not in taken}
    vocab.update(specials)
    vocab.update(reserved)
    if sorted(vocab.values()) != list(range(vocab_size)):
        raise ValueError("vocabulary ids are not 0 .. vocab_size - 1")
    return vocab


def build_tokenizer(vocab: dict[str, int], specials: dict[str, int]) -> Tokenizer:
    """WordLevel over `vocab`, whitespace pre-tokenizer, no decoder (tokenizers then joins tokens with spaces)."""
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def tokenizer_files(tokens: dict, max_length: int) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json; `tokens` names bos/eos/pad/unk."""
    named = {f"{k}_token": tokens[k] for k in ("bos", "eos", "pad", "unk")}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **named, "chat_template": CHAT_TEMPLATE,
              "model_max_length": max_length, "clean_up_tokenization_spaces": False,
              "add_bos_token": False, "add_eos_token": False}
    return {"tokenizer_config.json": config, "special_tokens_map.json": named}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def build(out: Path, layers: int | None = None, prompt_folder: Path = PROMPT_SETS) -> dict:
    """Write the miniature's folder into `out` (and `out`/eagle3); returns what was built."""
    cfg = hf_config(layers)
    tok_spec = model_yaml()["tokenizer"]
    specials = {name: int(i) for name, i in tok_spec["special_ids"].items()}
    for key in ("bos", "eos", "pad"):
        if specials[tok_spec[key]] != cfg[f"{key}_token_id"]:
            raise ValueError(f"tokenizer {key} {tok_spec[key]} is not at config.json's {key}_token_id")
    words = words_of(prompt_texts(prompt_folder))
    vocab = vocabulary(words, cfg["vocab_size"], specials)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": cfg["bos_token_id"], "pad_token_id": cfg["pad_token_id"],
        "eos_token_id": [cfg["eos_token_id"], specials[tok_spec["end_of_turn"]]]})
    build_tokenizer(vocab, specials).save(str(out / "tokenizer.json"))
    files = tokenizer_files({k: tok_spec[k] for k in ("bos", "eos", "pad")} | {"unk": UNK},
                            cfg["max_position_embeddings"])
    for name, data in files.items():
        _write_json(out / name, data)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    head = out / "eagle3"
    head.mkdir(exist_ok=True)
    _write_json(head / "config.json", eagle3_config(cfg["num_hidden_layers"]))
    record = {"layers": cfg["num_hidden_layers"], "vocab_size": len(vocab), "prompt_words": len(words),
              "aux_layer_ids": aux_layer_ids(cfg["num_hidden_layers"]),
              "model_yaml_sha256": hashlib.sha256(MODEL_YAML.read_bytes()).hexdigest(),
              "weights": "none: served with --load-format dummy (SGLang initialize_dummy_weights)"}
    _write_json(out / "specws_kimi_mini.json", record)
    return record


def weight_bytes(cfg: dict) -> dict[str, int]:
    """Bytes of the weights as SGLang 0.5.14 holds them on one GPU (TP 1), by group: bf16 except the routed experts
    (INT4 packed, 8 per int32, plus one bf16 scale per 32 weights along K). MLA also keeps w_kc/w_vc, a second copy of
    kv_b_proj made after loading."""
    h, heads, bf16 = cfg["hidden_size"], cfg["num_attention_heads"], 2
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kv_b = cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    attn = (h * (cfg["q_lora_rank"] + cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])   # fused q_a + kv_a
            + cfg["q_lora_rank"] * heads * qk + 2 * kv_b + heads * cfg["v_head_dim"] * h
            + cfg["q_lora_rank"] + cfg["kv_lora_rank"] + 2 * h) * bf16                 # norms
    moe_n, experts = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    group = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    expert = 3 * h * moe_n // 2 + (2 * moe_n * (h // group) + h * (moe_n // group)) * bf16
    sizes = {"attention_per_layer": attn,
             "dense_mlp_per_dense_layer": 3 * h * cfg["intermediate_size"] * bf16,
             "routed_experts_per_moe_layer": experts * expert,
             "shared_expert_and_router_per_moe_layer": (3 * h * moe_n * cfg["n_shared_experts"] + experts * h) * bf16
             + experts * 4,   # fp32 e_score_correction_bias
             "embedding_and_lm_head": 2 * cfg["vocab_size"] * h * bf16 + h * bf16}
    dense = cfg["first_k_dense_replace"]
    moe = cfg["num_hidden_layers"] - dense
    sizes["total"] = (cfg["num_hidden_layers"] * attn + dense * sizes["dense_mlp_per_dense_layer"]
                      + moe * (sizes["routed_experts_per_moe_layer"] + sizes["shared_expert_and_router_per_moe_layer"])
                      + sizes["embedding_and_lm_head"])
    return sizes


def eagle3_weight_bytes(head: dict, target_hidden: int) -> int:
    """The head's own bf16 weights (embed_tokens and lm_head are the target's: no draft_vocab_size)."""
    h, inter = head["hidden_size"], head["intermediate_size"]
    q = head["num_attention_heads"] * head["head_dim"]
    kv = head["num_key_value_heads"] * head["head_dim"]
    fc = 3 * target_hidden * h
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * inter + 3 * h
    return (fc + layer + h) * 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.box.kimi_mini", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the model folder (config, tokenizer, EAGLE-3 head config)")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--layers", type=int, default=None, help="layers (default: the yaml's, 4): 1 dense + N-1 MoE")
    m = sub.add_parser("memory", help="weight bytes per group as SGLang holds them")
    m.add_argument("--layers", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(json.dumps(build(args.out, args.layers), indent=2))
        else:
            cfg = hf_config(args.layers)
            sizes = weight_bytes(cfg) | {"eagle3_head": eagle3_weight_bytes(model_yaml()["eagle3_config"],
                                                                             cfg["hidden_size"])}
            print(json.dumps({k: f"{v / 2**30:.3f} GiB" for k, v in sizes.items()}, indent=2))
    except ValueError as exc:
        print(f"kimi_mini: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
