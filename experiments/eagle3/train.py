"""EAGLE-3 training with training-time test (TTT), on the CPU or a CUDA GPU (`device`).

Step 0 is vLLM's first draft pass: at anchor position i the head gets fc(aux hidden states of i) and the
embedding of token i+1 (the proposer shifts the input ids by one and puts the target's sampled token last)
and predicts token i+2. Step k>0 feeds the head's own pre-norm output of step k-1 at the same anchor, the
token at i+k+1 and position i+k; attention sees step 0's keys up to i plus steps 1..k's keys at i — what the
draft KV cache holds while vLLM drafts (head.Attention). Loss: cross-entropy to the target's distribution
restricted to the draft vocabulary (softmax of the target's logits over those ids), weighted 0.8^k. Accuracy
is against the token the target actually produced next (its greedy choice), i.e. what verification accepts.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.eagle3.batches import Batches, split_sequences  # noqa: F401  (offline_eval imports Batches here)
from experiments.eagle3.features import Features
from experiments.eagle3.head import Eagle3Head, HeadConfig, select_draft_vocab

Log = Callable[[str, float, int], None]


@dataclass
class TrainSettings:
    ttt_steps: int = 3
    draft_vocab_size: int = 4096
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    batch_tokens: int = 2048
    steps: int | None = None          # optimizer steps; None: `epochs`, else planned from the time budget
    epochs: float | None = None
    time_budget_s: float = 600.0      # hard cap on the training loop
    warmup_steps: int = 30
    loss_decay: float = 0.8
    val_fraction: float = 0.05
    eval_every: int = 100
    shuffle_labels: bool = False      # control: targets permuted across positions
    init_from_target: bool = True     # lm_head ← target output rows of the draft vocab, norm ← final norm
    bf16: bool = True                 # autocast: AMX bf16 matmuls, fp32 master weights
    compile: bool = False             # torch.compile the unroll and loss: minutes of compiling on 2 cores, no gain
    seed: int = 0
    device: str = "cpu"               # where the head trains; the features must already be there
    keep_best: bool = True            # end with the weights of the best validation accept length seen


def _shift(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x[:, i + k] at i (padded with `fill`)."""
    pad = torch.full((x.shape[0], k, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, k:], pad], 1)


def _head_loss(head: Eagle3Head, h: torch.Tensor, tp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft-target cross-entropy of the head's draft-vocab logits at the selected anchors, and its argmax."""
    logits = head.logits(h).float()
    return F.cross_entropy(logits, tp), logits.detach().argmax(-1)


class Compute:
    """The head's unroll and loss, eager or through torch.compile (dynamic shapes). Measured on the 2-core
    box: 200 s to compile plus a 120 s recompile for the second batch length, then no faster per step — so
    eager is the default; the option stays for machines where the element-wise ops dominate less."""

    def __init__(self, head: Eagle3Head, compile: bool) -> None:
        self.head, self.compiled = head, compile
        self.unroll = torch.compile(head.unroll, dynamic=True) if compile else head.unroll
        self.loss = torch.compile(_head_loss, dynamic=True) if compile else _head_loss

    def eager(self) -> Compute:
        return Compute(self.head, False)


def step_losses(c: Compute, batch: dict[str, torch.Tensor], teacher_w: torch.Tensor, steps: int,
                bf16: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per TTT step, over the anchors whose step has a target: mean loss, hit mask, anchor mask [B, T].
    Vocabulary-sized work only where there is a target: the teacher once per batch at the valid positions
    (row-major, so step k's anchors i ↦ targets at i+k+1 select rows in the same order), the head's lm_head
    per step at its anchors."""
    valid = batch["valid"]
    with torch.autocast(valid.device.type, dtype=torch.bfloat16, enabled=bf16):
        with torch.no_grad():
            t_prob = torch.softmax((batch["final"][valid].float() @ teacher_w.T).float(), -1)
        rowmap = torch.full(valid.shape, -1, dtype=torch.int64, device=valid.device)
        rowmap[valid] = torch.arange(t_prob.shape[0], device=valid.device)
        hidden = c.unroll(batch["ids"], batch["aux"] if bf16 else batch["aux"].float(), steps)
        draft_ids = c.head.draft_ids
        losses, hits, masks = [], [], []
        for k, h in enumerate(hidden):
            m = _shift(valid, k + 1, False)
            rows = _shift(rowmap, k + 1, -1)[m]
            tp = t_prob if rows.numel() == t_prob.shape[0] else t_prob[rows]   # increasing subset: all ⇒ identity
            if not m.any():
                losses.append(h.sum() * 0)
                hits.append(torch.zeros_like(m))
                masks.append(m)
                continue
            loss, pred = c.loss(c.head, h[m], tp)
            losses.append(loss)
            hit = torch.zeros_like(m)
            hit[m] = draft_ids[pred] == _shift(batch["next"], k + 1, -1)[m]
            hits.append(hit)
            masks.append(m)
    return losses, hits, masks


@torch.no_grad()
def evaluate(c: Compute, batches: Batches, teacher_w: torch.Tensor, steps: int, bf16: bool) -> dict:
    """Per-step top-1 accuracy and loss, and the expected accept length of a chain of `steps` drafts:
    1 + Σ_k P(drafts 0..k all right) over anchors where step 0 has a target (+1: the bonus token)."""
    c.head.eval()
    correct, counted, loss_sum = [0] * steps, [0] * steps, [0.0] * steps
    chain_hits, anchors = [0] * steps, 0
    for i in range(len(batches)):
        losses, hits, masks = step_losses(c, batches.get(i), teacher_w, steps, bf16)
        alive = masks[0].clone()
        anchors += int(alive.sum())
        for k in range(steps):
            correct[k] += int(hits[k].sum())
            counted[k] += int(masks[k].sum())
            loss_sum[k] += float(losses[k]) * int(masks[k].sum())
            alive &= hits[k]
            chain_hits[k] += int(alive.sum())
    c.head.train()
    out = {f"acc_{k}": correct[k] / max(counted[k], 1) for k in range(steps)}
    out.update({f"loss_{k}": loss_sum[k] / max(counted[k], 1) for k in range(steps)})
    out["accept_length_est"] = 1.0 + sum(h / max(anchors, 1) for h in chain_hits)
    for k in range(1, steps):                  # the same estimate for a chain of k drafts (a shorter serving chain)
        out[f"accept_length_est_{k}"] = 1.0 + sum(h / max(anchors, 1) for h in chain_hits[:k])
    return out


def _build_head(f: Features, cfg: HeadConfig, embed: torch.Tensor, lm_head_w: torch.Tensor, final_norm: torch.Tensor,
                s: TrainSettings, train_seqs: list[int]) -> tuple[Eagle3Head, torch.Tensor, torch.Tensor]:
    """The head on `s.device`, its draft vocabulary (from the training answers) and the teacher's rows for it."""
    draft_ids = select_draft_vocab(f.response_token_counts(cfg.vocab_size, train_seqs), cfg.draft_vocab_size)
    head = Eagle3Head(cfg, embed)
    head.set_vocab(draft_ids)
    if s.init_from_target:
        head.init_from_target(final_norm)
    head.to(s.device)
    teacher_w = lm_head_w.float().to(s.device)[head.draft_ids]
    return head, draft_ids, teacher_w


def _label_permutation(f: Features, s: TrainSettings) -> torch.Tensor | None:
    """The shuffle control's permutation of target positions, or None."""
    if not s.shuffle_labels:
        return None
    g = torch.Generator().manual_seed(s.seed + 2)
    return torch.randperm(f.ids.numel(), generator=g)


def _learning_rate(s: TrainSettings, step: int, total: int | None) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak over the (planned) step count."""
    if step < s.warmup_steps:                 # the plan (step 10) lands inside the warm-up: same lr either way
        return s.learning_rate * (step + 1) / s.warmup_steps
    done = min(1.0, (step - s.warmup_steps) / max(1, (total or step + 1) - s.warmup_steps))
    return s.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


class _StepBudget:
    """The step count `total`: fixed, or planned from the measured step time to fit the time budget."""

    def __init__(self, s: TrainSettings, total: int | None, progress: Callable[[str], None]) -> None:
        self.s, self.total, self.progress = s, total, progress
        self.planned = total is None
        self.t0, self.planned_at, self.planned_from = time.time(), 0.0, 2

    def elapsed(self) -> float:
        return time.time() - self.t0

    def more_steps(self, step: int) -> bool:
        return self.total is None or step < self.total

    def before_step(self, step: int) -> bool:
        """Re-plan where due; False once the time budget is spent."""
        # plan the schedule from the measured step time at step 10, and again at step 100: on the H200 the first
        # steps ran at 0.19 s, the rest at 0.10 s, and the loop stopped after 100 s of its 180 s budget
        if self.planned and step in (10, 100):
            per_step = (time.time() - self.planned_at) / (step - self.planned_from)
            self.total = max(step + 1, int(0.97 * (self.s.time_budget_s - (time.time() - self.t0)) / per_step) + step)
            self.progress(f"eagle3 train: {per_step:.2f}s/step → {self.total} steps in the "
                          f"{self.s.time_budget_s:.0f}s budget")
            self.planned_at, self.planned_from = time.time(), step
        if step == 2:
            self.planned_at = time.time()
        return not time.time() - self.t0 > self.s.time_budget_s


def _optimizer_step(comp: Compute, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                    teacher_w: torch.Tensor, s: TrainSettings, lr: float, progress: Callable[[str], None]
                    ) -> tuple[Compute, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One optimizer step on the weighted TTT loss: the Compute to go on with, the loss, hit and anchor masks."""
    for group in opt.param_groups:
        group["lr"] = lr
    try:
        losses, hits, masks = step_losses(comp, batch, teacher_w, s.ttt_steps, s.bf16)
    except Exception as exc:                   # torch.compile unavailable here: eager is correct, slower
        if not comp.compiled:
            raise
        progress(f"eagle3 train: torch.compile failed ({type(exc).__name__}: {exc}); eager")
        comp = comp.eager()
        losses, hits, masks = step_losses(comp, batch, teacher_w, s.ttt_steps, s.bf16)
    weights = [s.loss_decay ** k for k in range(s.ttt_steps)]
    loss = sum(w * x for w, x in zip(weights, losses, strict=True))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(comp.head.parameters(), 1.0)
    opt.step()
    return comp, loss, hits, masks


def _log_train_step(log: Log, loss: torch.Tensor, lr: float, run_acc: list[float], hits: list[torch.Tensor],
                    masks: list[torch.Tensor], step: int) -> None:
    """Update the running per-step accuracy (EMA, in place) and log the step's training metrics."""
    for k in range(len(run_acc)):
        a = float(hits[k].sum()) / max(1, int(masks[k].sum()))
        run_acc[k] = 0.95 * run_acc[k] + 0.05 * a if step > 1 else a
    log("train/loss", float(loss.detach()), step)
    log("train/lr", lr, step)
    for k in range(len(run_acc)):
        log(f"train/acc_{k}", run_acc[k], step)


Best = tuple[float, int, dict[str, torch.Tensor]]   # val accept length, step, head weights


def _validate(comp: Compute, val_b: Batches, teacher_w: torch.Tensor, s: TrainSettings, step: int,
              loss: torch.Tensor, best: Best | None, budget: _StepBudget, log: Log,
              progress: Callable[[str], None]) -> Best | None:
    """Log and report a validation; returns `best`, updated when these weights are better (`keep_best`)."""
    ev = evaluate(comp.eager(), val_b, teacher_w, s.ttt_steps, s.bf16)
    for name, v in ev.items():
        log(f"val/{name}", v, step)
    if s.keep_best and (best is None or ev["accept_length_est"] > best[0]):
        best = (ev["accept_length_est"], step, {k: v.detach().clone() for k, v in comp.head.state_dict().items()})
    progress(f"eagle3 train: step {step}/{budget.total} {budget.elapsed():.0f}s loss {float(loss.detach()):.3f} "
             "val acc "
             + "/".join(f"{ev[f'acc_{k}']:.3f}" for k in range(s.ttt_steps))
             + f" accept≈{ev['accept_length_est']:.2f}")
    return best


def _train_loop(comp: Compute, opt: torch.optim.Optimizer, train_b: Batches, val_b: Batches,
                teacher_w: torch.Tensor, s: TrainSettings, budget: _StepBudget, log: Log,
                progress: Callable[[str], None]) -> tuple[Compute, int, bool, list[float], Best | None]:
    """Steps over shuffled epochs until the step count or the time budget is reached: the Compute in use,
    steps done, whether the budget stopped it, running per-step accuracy, best validated weights."""
    g = torch.Generator().manual_seed(s.seed)
    order: list[int] = []
    step, stopped = 0, False
    run_acc = [0.0] * s.ttt_steps
    best: Best | None = None
    while budget.more_steps(step):
        if not budget.before_step(step):
            stopped = True
            break
        if not order:
            order = torch.randperm(len(train_b), generator=g).tolist()
        batch = train_b.get(order.pop())
        lr = _learning_rate(s, step, budget.total)
        comp, loss, hits, masks = _optimizer_step(comp, opt, batch, teacher_w, s, lr, progress)
        step += 1
        _log_train_step(log, loss, lr, run_acc, hits, masks, step)
        if step % s.eval_every == 0:
            best = _validate(comp, val_b, teacher_w, s, step, loss, best, budget, log, progress)
    return comp, step, stopped, run_acc, best


def _final_evaluation(comp: Compute, val_b: Batches, teacher_w: torch.Tensor, s: TrainSettings, step: int,
                      best: Best | None, progress: Callable[[str], None]) -> tuple[dict, int]:
    """Validate the final weights, back to the best earlier ones if better (over-fitted since): metrics, step."""
    ev = evaluate(comp.eager(), val_b, teacher_w, s.ttt_steps, s.bf16)
    best_step = step
    if best is not None and best[0] > ev["accept_length_est"]:
        comp.head.load_state_dict(best[2])
        best_step = best[1]
        ev = evaluate(comp.eager(), val_b, teacher_w, s.ttt_steps, s.bf16)
        progress(f"eagle3 train: kept the weights of step {best_step} (val accept≈{ev['accept_length_est']:.2f})")
    return ev, best_step


def _train_val_sequences(f: Features, s: TrainSettings) -> tuple[list[int], list[int]]:
    """Held-out sequences: those the data marks (kind `<source>/val`: whole conversations held out by the
    split, so no turn of a validation conversation is trained on), else a seeded `val_fraction` of them."""
    marked = [i for i, k in enumerate(f.kinds) if k.endswith("/val")]
    if marked and len(marked) < f.num_sequences:
        held = set(marked)
        return [i for i in range(f.num_sequences) if i not in held], marked
    return split_sequences(f.num_sequences, s.val_fraction, s.seed)


def train(f: Features, cfg: HeadConfig, embed: torch.Tensor, lm_head_w: torch.Tensor, final_norm: torch.Tensor,
          s: TrainSettings, log: Log | None = None, progress: Callable[[str], None] = print) -> tuple[Eagle3Head, dict]:
    """Train a head on cached features. `embed` / `lm_head_w` / `final_norm`: the target's input embeddings,
    output projection and final norm weight."""
    torch.manual_seed(s.seed)
    log = log or (lambda name, value, step: None)
    train_seqs, val_seqs = _train_val_sequences(f, s)
    head, draft_ids, teacher_w = _build_head(f, cfg, embed, lm_head_w, final_norm, s, train_seqs)
    train_b = Batches(f, train_seqs, s.batch_tokens, _label_permutation(f, s))
    val_b = Batches(f, val_seqs, s.batch_tokens)
    n_resp = int(f.response_token_counts(cfg.vocab_size, train_seqs).sum())
    coverage = float(f.response_token_counts(cfg.vocab_size, val_seqs)[draft_ids].sum()) / max(
        1, int(f.response_token_counts(cfg.vocab_size, val_seqs).sum()))
    comp = Compute(head, s.compile)
    opt = torch.optim.AdamW(head.parameters(), lr=s.learning_rate, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    budget = _StepBudget(s, s.steps or (int(math.ceil(s.epochs * len(train_b))) if s.epochs else None), progress)
    progress(f"eagle3 train: {len(train_seqs)} train / {len(val_seqs)} val sequences, {n_resp} answer tokens, "
             f"{len(train_b)} batches/epoch, draft vocab {cfg.draft_vocab_size} covers {coverage:.3f} of val tokens")
    comp, step, stopped, run_acc, best = _train_loop(comp, opt, train_b, val_b, teacher_w, s, budget, log, progress)
    ev, best_step = _final_evaluation(comp, val_b, teacher_w, s, step, best, progress)
    for name, v in ev.items():
        log(f"val/{name}", v, step)
    metrics = {"best_step": best_step, **{f"val_{k}": v for k, v in ev.items()},
               **{f"train_acc_{k}": v for k, v in enumerate(run_acc)},
               "steps": step, "train_seconds": budget.elapsed(), "stopped_by_budget": stopped,
               "draft_vocab_coverage": coverage, "train_sequences": len(train_seqs), "val_sequences": len(val_seqs),
               "train_answer_tokens": n_resp, "settings": asdict(s)}
    return head, metrics


def resolve_device(device: str) -> str:
    """"auto" → "cuda" when torch sees a GPU, else "cpu"; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def train_head(out_dir: Path, *, seed: int = 0, steps: int | None = None, epochs: float | None = None,
               ttt_steps: int = 3, time_budget_s: float = 600.0, draft_vocab_size: int = 4096,
               learning_rate: float = 1e-3, aux_layer_ids: tuple[int, ...] | None = None, num_prompts: int = 512,
               max_new_tokens: int = 128, synthetic_prompts: int = 0, model_path: str | Path | None = None,
               shuffle_labels: bool = False, data: str = "synthetic", sharegpt: dict | None = None,
               batch_tokens: int = 2048, compile: bool = False, device: str = "auto", val_fraction: float = 0.05,
               log: Log | None = None,
               progress: Callable[[str], None] = print) -> dict:
    """data → features → train → export into `out_dir` (vLLM layout; `<out_dir>-sglang` is SGLang's copy).
    Data and features are cached by their settings; `time_budget_s` caps the training loop only. With
    `steps` and `epochs` both None the step count is planned from the budget (not bit-reproducible across
    machines: the returned `steps` reproduces the run). `device`: "auto" trains on CUDA when present (data and
    features are then computed there too). Returns the final metrics."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from experiments.config.paths import cache_dir
    from experiments.eagle3.data import DataSettings
    from experiments.eagle3.export import export_head
    from experiments.eagle3.features import FeatureSettings, build_features
    from experiments.eagle3.sharegpt_data import copy_data_manifest, sharegpt_settings

    device = resolve_device(device)
    if device == "cpu":
        torch.set_num_threads(2)
    model_path = str(model_path or cache_dir() / "models" / "SmolLM2-135M-Instruct")
    target_cfg = AutoConfig.from_pretrained(model_path)
    cfg = HeadConfig.from_target(target_cfg, draft_vocab_size, aux_layer_ids)
    t0 = time.time()
    gpu = device != "cpu"
    if data == "sharegpt":
        ds = sharegpt_settings(model_path, seed, max_new_tokens, device, 512 if gpu else 64, dict(sharegpt or {}))
    elif data == "synthetic":
        ds = DataSettings(model_path, num_prompts=num_prompts, seed=seed, max_new_tokens=max_new_tokens,
                          batch_size=512 if gpu else 64, device=device, synthetic_prompts=synthetic_prompts)
    else:
        raise ValueError(f"data={data!r}: use synthetic (templates + self-written prompts) or sharegpt")
    fs = FeatureSettings(ds, cfg.aux_layer_ids, tokens_per_batch=65536 if gpu else 4096, device=device)
    feats = Features.load(build_features(fs, progress)).to(device)
    t_data = time.time() - t0
    target = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    embed = target.get_input_embeddings().weight.detach().clone()
    lm_head_w = target.get_output_embeddings().weight.detach().clone()
    final_norm = target.get_decoder().norm.weight.detach().clone()
    del target
    s = TrainSettings(ttt_steps=ttt_steps, draft_vocab_size=cfg.draft_vocab_size, learning_rate=learning_rate,
                      steps=steps, epochs=epochs, time_budget_s=time_budget_s, shuffle_labels=shuffle_labels,
                      batch_tokens=batch_tokens, compile=compile, seed=seed, device=device, val_fraction=val_fraction)
    head, metrics = train(feats, cfg, embed, lm_head_w, final_norm, s, log, progress)
    head.cpu()
    metrics.update(data_and_features_seconds=t_data, data=data, data_key=fs.data.key(), features_key=fs.key(),
                   aux_layer_ids=list(cfg.aux_layer_ids), target=model_path)
    paths = export_head(head, Path(out_dir))
    if data == "sharegpt":
        metrics["data_files"] = copy_data_manifest(fs.data.build(progress), Path(out_dir))
    metrics["exported"] = {k: str(v) for k, v in paths.items()}
    Path(out_dir, "specws_eagle3.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    return metrics
