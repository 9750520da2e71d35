"""sglang_patches on the CPU with real SGLang 0.5.23 code: reach into spawned workers, all-or-nothing
refusals, activation conditions, the launcher's report, and the INT4 MoE self-check logic."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from experiments.config.paths import ROOT
from experiments.config.views import typed_run
from sglang_patches import REGISTRY, Context, Patch, PatchRefused, Targets, When, resolve
from sglang_patches import selfcheck as sc
from sglang_patches.applying import applied_tag, apply_patches, parse_log

spec_info = pytest.importorskip("sglang.srt.speculative.spec_info")
MARKER_TARGET = "sglang.srt.speculative.spec_info:SpeculativeAlgorithm.from_string"


def _stored_from_string():
    return inspect.getattr_static(spec_info.SpeculativeAlgorithm, "from_string")


def _wrap_from_string(t: Targets) -> None:
    original = t.get(MARKER_TARGET)
    t.replace(MARKER_TARGET, classmethod(lambda cls, name: original(name)))


def _launcher(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "sglang_patches.launch", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_marker_patch_reaches_a_spawned_worker_and_is_read_back() -> None:
    """The launcher applies reach_marker, then a worker started like SGLang's (multiprocessing spawn)
    runs the scheduler's start-up call through SGLang's module and finds it patched."""
    res = _launcher({"SPECWS_SGLANG_ENTRY": "sglang_patches.probe", "SPECWS_SGLANG_PATCHES": "reach_marker"},
                    "--model-path", str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    assert res.returncode == 0, res.stderr[-3000:]
    probe = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("PROBE_RESULT "))
                       .removeprefix("PROBE_RESULT "))
    parsed = parse_log(res.stderr)
    launcher = parsed["launcher"]
    assert probe["patch"] == "reach_marker" and probe["result"] == "SpeculativeAlgorithm.NGRAM"
    assert probe["pid"] != launcher["pid"] and probe["process"] == "probe_worker"
    spawned = [r for r in parsed["processes"] if r["role"] == "spawned"]
    assert [r["pid"] for r in spawned] == [probe["pid"]]
    assert [a["name"] for a in spawned[0]["applied"]] == ["reach_marker"] and spawned[0]["applied"][0]["check"]
    assert [e["pid"] for e in parsed["events"]] == [probe["pid"]]   # the patched code ran in the worker
    assert applied_tag(parsed) == "reach_marker@sglang0.5.23"


def test_missing_target_is_refused_by_name_and_nothing_is_applied() -> None:
    before = _stored_from_string()
    good = Patch("good", "test", "-", ">=0.5", When(), (MARKER_TARGET,), _wrap_from_string)
    bad = Patch("bad_target", "test", "-", ">=0.5", When(),
                ("sglang.srt.speculative.spec_info:SpeculativeAlgorithm.no_such_method",), lambda t: None)
    with pytest.raises(PatchRefused, match=r"bad_target: target .*no_such_method") as exc:
        apply_patches([good, bad])
    assert "good" not in str(exc.value).replace("nothing", "")
    assert _stored_from_string() is before


def test_missing_module_is_refused_by_name() -> None:
    bad = Patch("bad_module", "test", "-", ">=0.5", When(), ("sglang.srt.no_such_module:f",), lambda t: None)
    with pytest.raises(PatchRefused, match=r"bad_module: target sglang.srt.no_such_module:f missing"):
        apply_patches([bad])


def test_version_outside_the_specifier_is_refused_by_name() -> None:
    before = _stored_from_string()
    good = Patch("good", "test", "-", ">=0.5", When(), (MARKER_TARGET,), _wrap_from_string)
    old = Patch("old_only", "test", "-", "<0.5.14", When(), (MARKER_TARGET,), _wrap_from_string)
    with pytest.raises(PatchRefused, match=r"old_only: written for sglang<0.5.14, installed is 0.5.23"):
        apply_patches([good, old])
    assert _stored_from_string() is before


def test_failing_apply_rolls_back_what_was_applied() -> None:
    before = _stored_from_string()

    def explode(t: Targets) -> None:
        raise RuntimeError("boom")

    good = Patch("good", "test", "-", ">=0.5", When(), (MARKER_TARGET,), _wrap_from_string)
    boom = Patch("boom", "test", "-", ">=0.5", When(), (MARKER_TARGET,), explode)
    with pytest.raises(PatchRefused, match="boom: apply failed"):
        apply_patches([good, boom])
    assert _stored_from_string() is before


def test_applied_patch_checks_and_undoes() -> None:
    before = _stored_from_string()
    [record] = apply_patches([REGISTRY["reach_marker"]])
    try:
        assert record["check"] and _stored_from_string() is not before
        assert spec_info.SpeculativeAlgorithm.from_string("EAGLE3") is spec_info.SpeculativeAlgorithm.EAGLE3
    finally:
        from sglang_patches.applying import APPLIED
        APPLIED.pop("reach_marker").undo()
    assert _stored_from_string() is before


def test_sm12x_patch_is_active_only_on_sm12x_with_compressed_tensors() -> None:
    when = REGISTRY["sm12x_wna16_moe_triton"].when
    assert when.skip_reason(Context(capability=(12, 0), quantization="compressed-tensors")) is None
    assert when.skip_reason(Context(capability=(12, 1), quantization="compressed-tensors")) is None
    assert "device is (9, 0)" in when.skip_reason(Context(capability=(9, 0), quantization="compressed-tensors"))
    assert "device is (10, 0)" in when.skip_reason(Context(capability=(10, 0), quantization="compressed-tensors"))
    assert "no CUDA device" in when.skip_reason(Context(quantization="compressed-tensors"))
    assert "quantization" in when.skip_reason(Context(capability=(12, 0), quantization="fp8"))


def test_launcher_refuses_unknown_patch_before_handing_over() -> None:
    res = _launcher({"SPECWS_SGLANG_PATCHES": "no_such_patch", "SPECWS_SGLANG_ENTRY": "sglang_patches.probe"})
    assert res.returncode == 2
    assert "unknown sglang_patches ['no_such_patch']" in res.stderr and "PROBE_RESULT" not in res.stdout
    assert parse_log(res.stderr)["launcher"]["refused"]


def test_launcher_reports_a_patch_whose_condition_fails_as_skipped() -> None:
    res = _launcher({"SPECWS_SGLANG_PATCHES": "sm12x_wna16_moe_triton", "SPECWS_SGLANG_ENTRY": "sglang.version"},
                    "--model-path", str(ROOT / ".cache/models/SmolLM2-135M-Instruct"), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    launcher = parse_log(res.stderr)["launcher"]
    assert launcher["applied"] == [] and launcher["skipped"][0]["name"] == "sm12x_wna16_moe_triton"
    assert "no CUDA device" in launcher["skipped"][0]["reason"]
    assert launcher["context"]["model_type"] == "llama"


def test_a_forced_patch_is_applied_past_its_condition_and_reported() -> None:
    """No CUDA device here, so the condition fails; forced, the launcher applies it anyway. The CPU install
    cannot import the MoE scheme modules (no tvm_ffi), so applying is refused by target, all or nothing:
    which shows the patch was taken past its condition, not skipped."""
    env = {"SPECWS_SGLANG_PATCHES": "sm12x_wna16_moe_triton", "SPECWS_SGLANG_ENTRY": "sglang.version",
           "SPECWS_SGLANG_PATCHES_FORCED": "sm12x_wna16_moe_triton"}
    res = _launcher(env, "--model-path", str(ROOT / ".cache/models/SmolLM2-135M-Instruct"), timeout=600)
    launcher = parse_log(res.stderr)["launcher"]
    assert launcher["forced"] == ["sm12x_wna16_moe_triton"] and launcher["skipped"] == []
    assert res.returncode == 2 and "get_moe_scheme missing" in launcher["refused"]


def test_forcing_a_patch_that_is_not_requested_is_refused() -> None:
    from sglang_patches.applying import select
    patches = resolve(["sm12x_wna16_moe_triton"])
    with pytest.raises(PatchRefused, match="moe_budget"):
        select(patches, Context(), ["moe_budget"])


def test_resolve_refuses_unknown_names_all_at_once() -> None:
    with pytest.raises(KeyError, match=r"\['x', 'y'\]"):
        resolve(["reach_marker", "x", "y"])


# --- INT4 MoE kernel self-check -------------------------------------------------------------------------

def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int32_along_k, written independently: [E, K//8, rows] int32 -> [E, rows, K] int."""
    words = packed.transpose(1, 2).to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    return nibbles.reshape(*words.shape[:-1], -1) - 8


def test_packing_is_the_compressed_tensors_layout() -> None:
    p = sc.make_problem("cpu", torch.float32)
    packed = sc.pack_int32_along_k(p.q13)
    assert packed.dtype == torch.int32 and packed.shape == (8, 512 // 8, 2 * 256)
    assert torch.equal(_unpack(packed), p.q13.to(torch.int64))


def _wrong_zero_point(p: sc.Problem) -> torch.Tensor:
    """A kernel that decodes the unsigned nibbles without subtracting 8 (a real class of INT4 bug)."""
    shifted = sc.Problem(**{**vars(p), "q13": p.q13 + 8, "q2": p.q2 + 8})
    return sc.reference(shifted)


def _swapped_gate_up(p: sc.Problem) -> torch.Tensor:
    return sc.reference(p, gate_offset=1)


def _one_wrong_group_scale(p: sc.Problem) -> torch.Tensor:
    s2 = p.s2.clone()
    s2[:, :, 0] *= 4
    return sc.reference(sc.Problem(**{**vars(p), "s2": s2}))


def test_selfcheck_passes_the_reference_and_refuses_wrong_kernels_with_numbers() -> None:
    p = sc.make_problem("cpu", torch.float32)
    results = sc.check_kernels({"torch_reference": sc.reference, "wrong_zero_point": _wrong_zero_point,
                                "swapped_gate_up": _swapped_gate_up, "one_wrong_scale": _one_wrong_group_scale},
                               p)
    assert results["torch_reference"]["status"] == "pass" and results["torch_reference"]["max_abs_err"] == 0
    for wrong in ("wrong_zero_point", "swapped_gate_up", "one_wrong_scale"):
        assert results[wrong]["status"] == "fail", (wrong, results[wrong])
    assert sc.refusal(results, ["torch_reference"]) is None
    message = sc.refusal(results, ["one_wrong_scale"])
    r = results["one_wrong_scale"]
    assert message and f"max abs err {r['max_abs_err']:.4g}" in message and "relative L2 err" in message


def test_a_marlin_refusal_names_the_triton_fallback_and_its_cost() -> None:
    from sglang_patches.launch import with_fallback
    p = sc.make_problem("cpu", torch.float32)
    results = sc.check_kernels({"marlin_w4a16": _one_wrong_group_scale, "triton_w4a16": _wrong_zero_point}, p)
    marlin = with_fallback(sc.refusal(results, ["marlin_w4a16"]), "marlin_w4a16")
    assert "marlin_w4a16 disagrees" in marlin and "site.patches=[sm12x_wna16_moe_triton]" in marlin
    assert "~5-6x" in marlin and "sm_90" in marlin
    triton = sc.refusal(results, ["triton_w4a16"])
    assert with_fallback(triton, "triton_w4a16") == triton   # no fallback to name past the patch itself


def test_selfcheck_passes_a_bf16_rounded_kernel() -> None:
    """Tolerance is loose enough for bf16 activations, tight enough to catch the wrong kernels above."""
    p = sc.make_problem("cpu", torch.bfloat16)
    results = sc.check_kernels({"bf16": lambda q: sc.reference(q).to(torch.bfloat16)}, p)
    assert results["bf16"]["status"] == "pass" and results["bf16"]["rel_l2_err"] > 0


def test_selfcheck_never_passes_a_kernel_it_could_not_run() -> None:
    p = sc.make_problem("cpu", torch.bfloat16)
    results = sc.check_kernels(sc.KERNELS, p)
    assert {r["status"] for r in results.values()} <= {"absent", "error"}
    assert "could not be checked" in sc.refusal(results, ["marlin_w4a16"])


def test_selfcheck_cli_reports_no_device_on_cpu(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    out = tmp_path / "selfcheck.json"
    assert sc.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "no CUDA device" in report["skipped"] and report["environment"]["sglang"] == "0.5.23"


@pytest.mark.gpu
def test_selfcheck_on_gpu_every_present_kernel_agrees() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    report = sc.run()
    assert report["summary"], report
    assert "fail" not in report["summary"].values(), json.dumps(report, indent=2)
    assert "pass" in report["summary"].values(), json.dumps(report, indent=2)


# --- workspace integration --------------------------------------------------------------------------------

def test_sglang_launch_spec_goes_through_the_launcher_with_the_site_patches(monkeypatch) -> None:
    from conftest import compose_cfg

    from experiments.harness.launch import build_launch_spec
    monkeypatch.setenv("PYTHONPATH", "/opt/sglang-bundle")
    cfg = compose_cfg("+option=A", "site=blackwell", "site.patches=[sm12x_wna16_moe_triton,reach_marker]")
    spec = build_launch_spec(typed_run(cfg))
    assert spec.argv[1:3] == ["-m", "sglang_patches.launch"]
    assert spec.env["SPECWS_SGLANG_PATCHES"] == "sm12x_wna16_moe_triton,reach_marker"
    assert spec.env["SPECWS_SITE"] == "blackwell"
    assert spec.env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/opt/sglang-bundle"]


def test_the_run_logs_what_the_launcher_really_applied(tmp_path, store) -> None:
    from mlflow.tracking import MlflowClient

    from experiments.harness.launch import LaunchSpec
    from experiments.harness.measure import _read_patches
    from experiments.tracking.export import Measurement, export
    from experiments.tracking.uploads import Uploads
    res = _launcher({"SPECWS_SGLANG_PATCHES": "reach_marker,sm12x_wna16_moe_triton",
                     "SPECWS_SGLANG_ENTRY": "sglang.version"})
    assert res.returncode == 0, res.stderr[-3000:]
    log = tmp_path / "server.log"
    log.write_text(res.stdout + res.stderr)
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("patches")).info.run_id
    spec = LaunchSpec("sglang", sys.executable, "sglang_patches.launch", [], {}, "/health")
    measured = Measurement(tmp_path / "records.jsonl", server_log=log)
    _read_patches(measured, spec)
    uploads = Uploads(client, run_id)
    export(client, run_id, measured, uploads)
    assert uploads.failures == []
    assert client.get_run(run_id).data.tags["sglang_patches.applied"] == "reach_marker@sglang0.5.23"
    with open(client.download_artifacts(run_id, "sglang_patches.json", str(tmp_path / "dl"))) as f:
        report = json.load(f)
    assert report["launcher"]["skipped"][0]["name"] == "sm12x_wna16_moe_triton"
    assert report["launcher"]["selfcheck"]["status"] == "skipped"


def test_selfcheck_runs_for_int4_weight_only_checkpoints_only() -> None:
    from sglang_patches.gpu_check import KIMI_K25_QUANT
    from sglang_patches.launch import is_int4_weight_only
    assert is_int4_weight_only({"quantization_config": KIMI_K25_QUANT})
    assert is_int4_weight_only({"text_config": {"quantization_config": KIMI_K25_QUANT}})   # multimodal layout
    w8 = json.loads(json.dumps(KIMI_K25_QUANT))
    w8["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    w4a8 = json.loads(json.dumps(KIMI_K25_QUANT))
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    assert not any(is_int4_weight_only(c) for c in ({}, {"quantization_config": w8}, {"quantization_config": w4a8}))
