# The lease plans' steps (bin/kimi-plan, bin/tp8-plan source this). The plan sets, before its first step:
#   DEST (the bundle's folder), OUT, K (this plan's results: one log per step), BUDGET (seconds), START
#   (`date +%s` at its start), COMMON (the overrides of every runner step); optionally STEP_SHOWS (an extended
#   regex: the lines of a step's log echoed after it) and STEP_LINES (how many of them).
# One override order: `runner NAME OVERRIDES...` passes COMMON first and the step's own OVERRIDES after them.
# Hydra applies command-line overrides in order, so where both set a key the step's value wins.
# PLAN_DRY_RUN=1: each step prints its command line (shell-quoted, after "== dry-run NAME:") instead of running.

STEP_SHOWS="MLflow run|output_tok_s|refused|Refused|Error|error:|tok/s|wrote"
STEP_LINES=12

step() {   # step NAME COMMAND...: run it unless the budget is spent; its output in $K/NAME.log
  local name=$1; shift
  local spent=$(( $(date +%s) - START ))
  if [ "$spent" -ge "$BUDGET" ]; then echo "== $name: skipped, ${spent}s of ${BUDGET}s spent"; return; fi
  if [ "${PLAN_DRY_RUN:-0}" = 1 ]; then echo "== dry-run $name: $(printf '%q ' "$@")"; return; fi
  echo "== $(date +%T) $name (at ${spent}s)"
  "$@" >"$K/$name.log" 2>&1
  local rc=$?   # before any other expansion: $(date) in the echo below would reset $?
  echo "== $(date +%T) $name rc=$rc ($(( $(date +%s) - START ))s)"
  grep -E "$STEP_SHOWS" "$K/$name.log" | tail -n "$STEP_LINES"
}

runner() {  # runner NAME OVERRIDES...: one measured run through the ordinary runner, then the store packed
  local name=$1; shift
  step "$name" python3 -m experiments.run "${COMMON[@]}" "$@" "hydra.run.dir=$DEST/hydra/$name"
  tar czf "$OUT/runs.tar.gz" -C "$DEST" runs 2>/dev/null
  cp "$DEST"/hydra/"$name"/*.log "$K/" 2>/dev/null
}
