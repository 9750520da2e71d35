"""`sm12x_wna16_moe_triton`: on SM 12.x, run INT4 (compressed-tensors WNA16) MoE layers on SGLang's Triton
W4A16 kernel instead of Marlin when the MoE runner backend is left on `auto`.

Why: Kimi-K2.5 INT4 (compressed-tensors, pack-quantized, group 32) on SM 12.1 collapses into repeated
tokens on the Marlin WNA16 MoE path (sglang#23264, open); the non-Marlin fallback PR was closed (sglang#17137).
SGLang 0.5.23 already defaults WNA16 MoE to Triton on SM100/103 (`use_blackwell_triton` in
`CompressedTensorsConfig.get_moe_scheme`) but not on SM120; 0.5.14 never does. Unlike
`--moe-runner-backend triton` (which moves every MoE layer, including unquantised and draft ones, to
Triton), this changes only the WNA16 MoE scheme choice. Whether Triton itself is right on the device is
what the launcher's kernel self-check verifies.
"""
from __future__ import annotations

import functools
import logging

from sglang_patches import Patch, Targets, When, register

SELECT = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors:CompressedTensorsConfig.get_moe_scheme"
SCHEMES = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe"
MARLIN = f"{SCHEMES}:CompressedTensorsWNA16MoE"
TRITON = f"{SCHEMES}:CompressedTensorsWNA16TritonMoE"
BACKEND = "sglang.srt.layers.moe:get_moe_runner_backend"

log = logging.getLogger(__name__)


def triton_can_run(scheme) -> bool:
    """The Triton W4A16 MoE kernel's limits (SGLang's `_is_wna16_triton_moe_supported`)."""
    return (getattr(scheme, "num_bits", None) == 4 and getattr(scheme, "sym", False)
            and getattr(scheme, "group_size", None) in (32, 128) and not getattr(scheme, "actorder", None))


def _apply(t: Targets) -> None:
    original, marlin_cls, triton_cls = t.get(SELECT), t.get(MARLIN), t.get(TRITON)
    get_backend = t.get(BACKEND)

    @functools.wraps(original)
    def get_moe_scheme(self, *args, **kwargs):
        scheme = original(self, *args, **kwargs)
        if type(scheme) is marlin_cls and get_backend().is_auto() and triton_can_run(scheme):
            # Same weights and settings; the subclass only converts them to the Triton layout.
            swapped = triton_cls.__new__(triton_cls)
            swapped.__dict__.update(scheme.__dict__)
            log.info("sm12x_wna16_moe_triton: WNA16 MoE on Triton instead of Marlin (sglang#23264)")
            return swapped
        return scheme

    get_moe_scheme.__specws_patch__ = "sm12x_wna16_moe_triton"
    t.replace(SELECT, get_moe_scheme)


register(Patch(
    name="sm12x_wna16_moe_triton",
    fixes="INT4 WNA16 MoE on SM 12.x runs on Triton W4A16, not Marlin (Kimi-K2.5 + Marlin repeated-token "
          "garbage on SM 12.1; SGLang's Triton auto-default covers SM100/103 only)",
    link="https://github.com/sgl-project/sglang/issues/23264",
    sglang_versions=">=0.5.14,<0.6",
    when=When(capability_major=(12,), quantization=("compressed-tensors",)),
    targets=(SELECT, MARLIN, TRITON, BACKEND),
    apply=_apply,
))
