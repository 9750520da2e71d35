"""A stand-in for SGLang's offline engine on a machine without a GPU: `sglang.Engine` with the arguments and the
token-in / token-out results of SGLang 0.5.14 (`output_ids` without the matched stop token, `finish_reason`), the
answers from transformers' greedy `generate`. Copied as `<site>/sglang/__init__.py` (`install`), it lets
experiments.eagle3.sglang_regen run its subprocess, files and result parsing end to end here."""
from __future__ import annotations

import shutil
from pathlib import Path

__version__ = "0.5.14-stub"
ENGINE_ARGS = {"model_path", "skip_tokenizer_init", "dtype", "random_seed", "mem_fraction_static", "context_length",
               "log_level", "attention_backend", "sampling_backend", "grammar_backend"}


def install(site: Path) -> Path:
    """`site`/sglang/__init__.py: this module; returns `site` (for --bundle-site)."""
    (site / "sglang").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, site / "sglang" / "__init__.py")
    return site


class Engine:
    def __init__(self, **kwargs) -> None:
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown or not kwargs.get("skip_tokenizer_init"):
            raise TypeError(f"stub sglang.Engine: unexpected arguments {sorted(unknown)} or a tokenizer asked for")
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=torch.float32).eval()
        print(f"stub sglang.Engine: {kwargs['model_path']}, context {kwargs['context_length']}", flush=True)

    def generate(self, input_ids: list[list[int]], sampling_params: dict) -> list[dict]:
        if sampling_params.get("temperature") != 0.0:
            raise ValueError("stub sglang.Engine: greedy only")
        stop = list(sampling_params["stop_token_ids"])
        outs = []
        for ids in input_ids:
            with self.torch.inference_mode():
                seq = self.model.generate(self.torch.tensor([ids]), max_new_tokens=sampling_params["max_new_tokens"],
                                          do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
            new = seq[0, len(ids):].tolist()
            if new and new[-1] in stop:
                outs.append({"output_ids": new[:-1], "meta_info": {"finish_reason": {"type": "stop",
                                                                                     "matched": new[-1]}}})
            else:
                outs.append({"output_ids": new, "meta_info": {"finish_reason": {"type": "length",
                                                                                "length": len(new)}}})
        return outs

    def shutdown(self) -> None:
        print("stub sglang.Engine: shut down", flush=True)
