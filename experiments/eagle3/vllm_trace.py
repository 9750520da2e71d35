"""Record what vLLM's EAGLE-3 proposer feeds the draft head, then replay the same inputs through our trainer's
head (experiments/eagle3/head.py) and compare tensor by tensor — the train/serve consistency check.

Usage (inside vLLM's venv; CPU is enough):
    <vllm python> -m experiments.eagle3.vllm_trace TARGET_DIR HEAD_DIR [--prompts N] [--out trace.pt]
Prints one JSON line per prompt with: the target's aux hidden states vs transformers' `hidden_states[k]`
(fp32 and bf16), fc output, each draft step's pre-norm output and draft token, ours vs vLLM's.
vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with hooks on `SpecDecodeBaseProposer.propose` and
`Eagle3LlamaForCausalLM.forward`; nothing in vLLM is changed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from experiments.tracking.records import read_jsonl


def record(target: str, head: str, prompts: list[list[int]], steps: int, max_tokens: int) -> list[dict]:
    """Run vLLM offline on `prompts` (token ids) and return, per proposer call, the inputs and draft tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")     # GiB; the default takes most of a shared machine
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models import llama_eagle3
    from vllm.v1.spec_decode import llm_base_proposer

    calls: list[dict] = []
    forwards: list[dict] = []
    orig_propose = llm_base_proposer.SpecDecodeBaseProposer.propose
    orig_forward = llama_eagle3.Eagle3LlamaForCausalLM.forward
    orig_combine = llama_eagle3.Eagle3LlamaForCausalLM.combine_hidden_states

    def cpu(x):
        return x.detach().to("cpu").clone() if isinstance(x, torch.Tensor) else x

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, *args, **kwargs):
        start = len(forwards)
        call = {"target_token_ids": cpu(target_token_ids), "target_positions": cpu(target_positions),
                "target_hidden_states": cpu(target_hidden_states).float(), "next_token_ids": cpu(next_token_ids),
                "token_indices_to_sample": cpu(token_indices_to_sample)}
        out = orig_propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                           next_token_ids, token_indices_to_sample, *args, **kwargs)
        call["draft_tokens"] = cpu(out)
        call["forwards"] = forwards[start:]
        calls.append(call)
        return out

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        normed, prenorm = orig_forward(self, input_ids, positions, hidden_states, inputs_embeds)
        forwards.append({"input_ids": cpu(input_ids), "positions": cpu(positions),
                         "hidden_in": cpu(hidden_states).float(), "prenorm": cpu(prenorm).float(),
                         "normed": cpu(normed).float()})
        return normed, prenorm

    def combine(self, hidden_states):
        out = orig_combine(self, hidden_states)
        forwards.append({"fc_out": cpu(out).float()})
        return out

    llm_base_proposer.SpecDecodeBaseProposer.propose = propose
    llama_eagle3.Eagle3LlamaForCausalLM.forward = forward
    llama_eagle3.Eagle3LlamaForCausalLM.combine_hidden_states = combine
    llm = LLM(model=target, dtype="bfloat16", max_model_len=2048, enforce_eager=True, seed=0,
              speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": steps})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    traces = []
    for ids in prompts:                       # one request at a time: every proposer call belongs to it
        calls.clear()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        traces.append({"prompt": ids, "output": list(out.outputs[0].token_ids), "calls": list(calls)})
    return traces


def compare(target: str, head_dir: str, traces: list[dict]) -> list[dict]:
    """Replay each trace's first proposer call (the prefill) through our head; report the differences."""
    import torch
    from transformers import AutoModelForCausalLM

    from experiments.eagle3.export import load_head

    hf32 = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    head = load_head(Path(head_dir), hf32.get_input_embeddings().weight.detach()).eval()
    ids_aux = head.config.aux_layer_ids
    reports = []
    for tr in traces:
        call = tr["calls"][0]
        fwd = [f for f in call["forwards"] if "input_ids" in f]
        fc_vllm = next(f["fc_out"] for f in call["forwards"] if "fc_out" in f)
        prompt = call["target_token_ids"].tolist()
        n = len(prompt)
        drafts = call["draft_tokens"].view(-1).tolist()
        rep: dict = {"n_prompt": n, "vllm_drafts": drafts, "vllm_output_head": tr["output"][: len(drafts) + 1]}
        with torch.no_grad():
            x = torch.tensor([prompt])
            for name, m in (("fp32", hf32), ("bf16", hf16)):
                hs = m.model(input_ids=x, output_hidden_states=True).hidden_states
                aux = torch.cat([hs[k][0] for k in ids_aux], -1).float()
                v = call["target_hidden_states"]
                rep[f"aux_rel_err_vs_hf_{name}"] = float((aux - v).norm() / v.norm())
                per_layer = [float(torch.nn.functional.cosine_similarity(hs[k][0].float(), v[:, j * 576:(j + 1) * 576],
                                                                         -1).min()) for j, k in enumerate(ids_aux)]
                rep[f"aux_min_cos_per_layer_{name}"] = per_layer
            # vLLM's shifted first-pass input ids: prompt[1:] + next token
            rep["input_shift_ok"] = fwd[0]["input_ids"].tolist() == prompt[1:] + call["next_token_ids"].tolist()
            rep["positions_ok"] = fwd[0]["positions"].tolist() == list(range(n))
            seq = prompt + call["next_token_ids"].tolist() + drafts[:-1]
            aux_in = torch.cat([call["target_hidden_states"], torch.zeros(len(seq) - n, fc_vllm.shape[-1] * 3)], 0)
            fc_ours = head.fc(call["target_hidden_states"])
            rep["fc_rel_err"] = float((fc_ours - fc_vllm).norm() / fc_vllm.norm())
            outs = head.unroll(torch.tensor([seq]), aux_in[None], len(drafts))
            ours_drafts, rel = [], []
            for k, h in enumerate(outs):
                hk = h[0, n - 1]
                ours_drafts.append(int(head.draft_ids[head.logits(hk).argmax()]))
                vk = fwd[k]["prenorm"][n - 1] if k == 0 else fwd[k]["prenorm"][0]
                rel.append(float((hk - vk).norm() / vk.norm()))
            rep["step0_prenorm_rel_err_all_positions"] = float(
                (outs[0][0, :n] - fwd[0]["prenorm"][:n]).norm() / fwd[0]["prenorm"][:n].norm())
            rep["prenorm_rel_err_per_step"] = rel
            rep["ours_drafts"] = ours_drafts
            rep["drafts_match"] = ours_drafts == drafts
            rep.update(_decode_calls(head, hf32, tr))
        reports.append(rep)
    return reports


def _decode_calls(head, hf32, tr: dict) -> dict:
    """Every later proposer call (after a verification) replayed from scratch: our head over the whole
    sequence so far with transformers' fp32 aux states, the draft chain at vLLM's anchor. Also the
    acceptance vLLM's drafts actually got (a draft is accepted while it equals the target's greedy token)."""
    import torch

    full = tr["prompt"] + tr["output"]
    n0 = len(tr["prompt"])
    with torch.no_grad():
        hs = hf32.model(input_ids=torch.tensor([full]), output_hidden_states=True).hidden_states
        aux_all = torch.cat([hs[k][0] for k in head.config.aux_layer_ids], -1).float()
    same = [0, 0, 0, 0, 0, 0]
    counted, accepted = 0, [0] * 8
    for call in tr["calls"][1:]:
        tis = int(call["token_indices_to_sample"].view(-1)[0])
        anchor = int(call["target_positions"].view(-1)[tis])
        drafts = call["draft_tokens"].view(-1).tolist()
        if anchor + 2 > len(full):
            continue
        seq = full[: anchor + 2] + drafts[:-1]
        aux = torch.cat([aux_all[: anchor + 1], torch.zeros(len(seq) - anchor - 1, aux_all.shape[-1])], 0)
        with torch.no_grad():
            outs = head.unroll(torch.tensor([seq]), aux[None], len(drafts))
        ours = [int(head.draft_ids[head.logits(h[0, anchor]).argmax()]) for h in outs]
        counted += 1
        for k, (x, y) in enumerate(zip(ours, drafts, strict=True)):
            same[k] += int(x == y)
        for k, d in enumerate(drafts):            # the target's greedy tokens after anchor + 1
            if anchor + 2 + k >= n0 + len(tr["output"]) or d != full[anchor + 2 + k]:
                break
            accepted[k] += 1
    return {"decode_calls": counted,
            "decode_same_draft_per_step": [x / max(counted, 1) for x in same[: len(drafts)]],
            "vllm_acceptance_per_position": [x / max(counted, 1) for x in accepted[: len(drafts)]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("target")
    p.add_argument("head")
    p.add_argument("--prompt-set", default="experiments/prompt_sets/chat.jsonl")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="save the raw trace (torch.save)")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.target)
    rows = read_jsonl(a.prompt_set)[: a.prompts]
    prompts = []
    for r in rows:
        ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
        prompts.append([int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])])
    traces = record(a.target, a.head, prompts, a.steps, a.max_tokens)
    if a.out:
        import torch
        torch.save(traces, a.out)
    for rep in compare(a.target, a.head, traces):
        print(json.dumps(rep), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
