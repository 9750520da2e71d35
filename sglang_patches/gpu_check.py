"""Everything about sglang_patches that needs a GPU host with SGLang installed (the H200 host runs 0.5.14):

1. the INT4 MoE kernel self-check on every W4A16 MoE kernel that exists there (Triton, Marlin);
2. the launcher + reach_marker patch reaching a spawned worker that imports SGLang's real scheduler module;
3. sm12x_wna16_moe_triton against that SGLang's own scheme selection: forced on (its SM 12.x guard bypassed),
   a Kimi-K2.5-style compressed-tensors INT4 config must select the Triton WNA16 MoE scheme instead of
   Marlin, and undone it must select Marlin again.

    PYTHONPATH=<sglang bundle>:<workspace> python -m sglang_patches.gpu_check --out DIR     # DIR/gpu_check.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Kimi-K2.5's quantization_config (compressed-tensors, pack-quantized INT4, symmetric, group 32).
KIMI_K25_QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "observer": "minmax"}}},
    "ignore": ["lm_head"], "kv_cache_scheme": None,
}


def kernel_selfcheck() -> dict:
    from sglang_patches import selfcheck
    report = selfcheck.run()
    report["ok"] = bool(report.get("summary")) and "fail" not in report["summary"].values()
    return report


def worker_reach() -> dict:
    env = {**os.environ, "SPECWS_SGLANG_ENTRY": "sglang_patches.probe", "SPECWS_SGLANG_PATCHES": "reach_marker",
           "SPECWS_SGLANG_SELFCHECK": "off",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "sglang_patches.launch"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    from sglang_patches.applying import parse_log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("PROBE_RESULT ")]
    probe = json.loads(lines[0].removeprefix("PROBE_RESULT ")) if lines else None
    parsed = parse_log(res.stderr)
    ok = (res.returncode == 0 and probe is not None and probe["patch"] == "reach_marker"
          and probe["module"] == "sglang.srt.managers.scheduler"
          and any(e["pid"] == probe["pid"] for e in parsed["events"]))
    return {"ok": ok, "returncode": res.returncode, "probe": probe, "log": parsed,
            "stderr_tail": res.stderr[-3000:]}


def sm12x_patch_selects_triton() -> dict:
    import torch
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from sglang_patches import REGISTRY
    from sglang_patches.applying import APPLIED, apply_patches
    fused_moe = type("FusedMoE", (torch.nn.Module,), {})()   # matched by class name, as SGLang's FusedMoE

    def chosen() -> str:
        config = CompressedTensorsConfig.from_config(json.loads(json.dumps(KIMI_K25_QUANT)))
        return type(config.get_moe_scheme(fused_moe, "model.layers.1.mlp.experts")).__name__

    before = chosen()
    record = apply_patches([REGISTRY["sm12x_wna16_moe_triton"]])
    try:
        patched = chosen()
    finally:
        APPLIED.pop("sm12x_wna16_moe_triton").undo()
    after = chosen()
    ok = (before == after == "CompressedTensorsWNA16MoE" and patched == "CompressedTensorsWNA16TritonMoE")
    return {"ok": ok, "without_patch": before, "with_patch": patched, "after_undo": after, "applied": record}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for gpu_check.json")
    args = ap.parse_args(argv)
    report: dict = {}
    for name, step in (("kernel_selfcheck", kernel_selfcheck), ("worker_reach", worker_reach),
                       ("sm12x_patch_selects_triton", sm12x_patch_selects_triton)):
        try:
            report[name] = step()
        except Exception as exc:  # one step failing must not hide the others' results
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {'ok' if report[name].get('ok') else 'FAILED'}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v.get("summary", v.get("ok")) for k, v in report.items()}, default=str))
    return 0 if all(v.get("ok") for v in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
