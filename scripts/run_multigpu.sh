#!/usr/bin/env bash
# Issue 25's multi-GPU runs, in the issue's order: each run is one command with its own markdown
# file of figures (machine and date from the clock) in OUTDIR, and its output in LOGDIR.
#
#   bash scripts/run_multigpu.sh OUTDIR              # every run this machine's GPU count allows
#   bash scripts/run_multigpu.sh OUTDIR RUN [RUN...] # the named runs only (names below)
#
# Needs >= 2 CUDA GPUs (exit 2 otherwise) and the project's packages importable by `python3` (or
# $PYTHON; .venv/bin/python when there is one). Each run is meant to end well inside 10 minutes
# (a device call's limit); the times below are estimates for H200s over NVLink from the 2-GPU
# run of 2026-11-29 and the one-GPU figures in docs/benchmarks.md, not measurements. At most 8
# files come back from a lent machine's $OUT: give LOGDIR another folder there (LOGDIR=/tmp/mg)
# or name a few runs per call. The checkpoint build is cached in $M3_ROLLOUT_CACHE (default
# ~/.cache/m3_rollout): on a fresh machine `ep-logits` and the GRPO runs build it first (~5 min)
# unless `build` ran on the same machine before them.
#
# (1) refit over NCCL, trainer on GPU 0 -> rollout GPU 1 (-> GPUs 1-3 with 3 receivers), atomic
#     and not, against a raw broadcast of the same buckets in the same run, pause per update:
#   ws-10gb       --gb 10 (the 9.96 GB M3-shaped model), 1 receiver                 ~1-2 min
#   ws-real       --real-shapes: the largest slice at the released layer shapes that
#                 fits (~9 MoE layers, ~135 GB; the atomic update stages it in pinned
#                 host memory, ~36 s at the 3.8 GB/s of 2026-11-29), 2 repeats       ~4-6 min
#   ws-10gb-3rx   --gb 10, 3 receivers (4 GPUs)                                       ~2 min
#   ws-real-3rx   --real-shapes --gb 60 (4 MoE layers), 3 receivers (4 GPUs): the
#                 three atomic stages share the host; the largest slice would take
#                 ~3x as long, past the 10-minute call                                ~4-6 min
# (2) EP on GPUs:
#   build         the GPU preset's checkpoint (builtin:m3-gpu-small, SFT warm start)  ~5 min
#   ep-logits     EP=2 logits vs EP=1 on that checkpoint, bf16, one GPU per rank      ~1 min
#   ep-logits-w4  the same at EP=4 (4 GPUs)                                           ~1-2 min
#   ep-real       the real-shape MoE layer (128 experts, H 6144, top-4, I 3072) at
#                 EP=2 vs EP=1 on one GPU: dispatch / expert / combine at 1, 32,
#                 256, 4,096 tokens per rank, outputs vs EP=1                         ~1-2 min
#   ep-real-w4    the same at EP=4 (4 GPUs)                                           ~2 min
# (3) the GRPO loop across GPUs against the one-GPU run, same seed (42), $GRPO_STEPS steps
#     (default 40; the one-GPU job's own 100 would not fit 10 minutes beside EP), per-step time
#     split and learning curve:
#   grpo-1gpu     configs/grpo_h200.yaml on GPU 0 (colocated, CUDA graphs)            ~3 min
#   grpo-ep       configs/grpo_h200_x2.yaml: trainer on GPU 2, EP=2 rollout workers on
#                 GPUs 0-1, NCCL refit (>= 3 GPUs); on 2 GPUs its 2-GPU form: one
#                 rollout worker on GPU 0, trainer on GPU 1                           ~4-8 min
#   grpo-colocated configs/grpo_h200_x2_colocated.yaml: EP=2 rollout workers on GPUs 0-1,
#                 the trainer on GPU 0 beside rank 0, refit through CUDA IPC from the
#                 trainer's compute copy (rank 1 by peer copies; no NCCL refit)       ~4-8 min
#     (The trainer stays one process on one device: no data-parallel trainer shares the
#     other GPUs.)
set -u
cd "$(dirname "$0")/.."
usage="usage: bash scripts/run_multigpu.sh OUTDIR [RUN ...]"
if [ $# -lt 1 ]; then
  echo "$usage" >&2
  exit 2
fi
OUT=$1
shift
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
n=${n:-0}
if [ "$n" -lt 2 ]; then
  echo "run_multigpu.sh: issue 25's runs need >= 2 CUDA GPUs; nvidia-smi -L lists $n here" >&2
  exit 2
fi
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
LOGDIR=${LOGDIR:-$OUT}
STEPS=${GRPO_STEPS:-40}
mkdir -p "$OUT" "$LOGDIR"

if [ $# -gt 0 ]; then
  runs=("$@")
elif [ "$n" -ge 4 ]; then
  runs=(ws-10gb ws-real ws-10gb-3rx ws-real-3rx build ep-logits ep-logits-w4 ep-real ep-real-w4 grpo-1gpu grpo-ep
    grpo-colocated)
else
  runs=(ws-10gb ws-real build ep-logits ep-real grpo-1gpu grpo-ep grpo-colocated)
fi

known=" ws-10gb ws-real ws-10gb-3rx ws-real-3rx build ep-logits ep-logits-w4 ep-real ep-real-w4 grpo-1gpu grpo-ep"
known+=" grpo-colocated "
for r in "${runs[@]}"; do
  if [[ $known != *" $r "* ]]; then
    echo "run_multigpu.sh: unknown run '$r'; $usage; runs:$known" >&2
    exit 2
  fi
done

failed=()
run() { # run NAME CMD...: one run; its figures in $OUT/NAME.md, its output in $LOGDIR/NAME.log
  local name=$1 t0=$SECONDS rc
  shift
  echo "== $name: $*"
  "$@" >"$LOGDIR/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s (figures: $OUT/$name.md, output: $LOGDIR/$name.log)"
  if [ $rc -ne 0 ]; then
    failed+=("$name")
    tail -n 25 "$LOGDIR/$name.log"
  fi
}

ws=(scripts/bench_weight_sync.py --backend nccl)
grpo=(scripts/bench_grpo_step.py --seeds 42 --steps "$STEPS")
for r in "${runs[@]}"; do
  case $r in
    ws-10gb) run "$r" "$PY" "${ws[@]}" --gb 10 --write "$OUT/$r.md" ;;
    ws-real) run "$r" "$PY" "${ws[@]}" --real-shapes --repeats 2 --write "$OUT/$r.md" ;;
    ws-10gb-3rx) run "$r" "$PY" "${ws[@]}" --gb 10 --receivers 3 --write "$OUT/$r.md" ;;
    ws-real-3rx) run "$r" "$PY" "${ws[@]}" --real-shapes --gb 60 --receivers 3 --repeats 2 --write "$OUT/$r.md" ;;
    build) run "$r" "$PY" -c "from m3_rollout.jobs.builtin import resolve_model; print(resolve_model('builtin:m3-gpu-small'))" ;;
    ep-logits) run "$r" "$PY" scripts/bench_ep.py --logits builtin:m3-gpu-small --world 2 --write "$OUT/$r.md" ;;
    ep-logits-w4) run "$r" "$PY" scripts/bench_ep.py --logits builtin:m3-gpu-small --world 4 --write "$OUT/$r.md" ;;
    ep-real) run "$r" "$PY" scripts/bench_ep.py --real-shapes --world 2 --write "$OUT/$r.md" ;;
    ep-real-w4) run "$r" "$PY" scripts/bench_ep.py --real-shapes --world 4 --write "$OUT/$r.md" ;;
    grpo-1gpu) run "$r" "$PY" "${grpo[@]}" --doc "$OUT/$r.md" ;;
    grpo-ep)
      if [ "$n" -ge 3 ]; then
        run "$r" "$PY" "${grpo[@]}" --config configs/grpo_h200_x2.yaml --doc "$OUT/$r.md"
      else
        run "$r" "$PY" "${grpo[@]}" --config configs/grpo_h200_x2.yaml --doc "$OUT/$r.md" \
          policy.generation.expert_parallel_size=1 cluster.device=cuda:1 cluster.gpus_per_node=1
      fi
      ;;
    grpo-colocated) run "$r" "$PY" "${grpo[@]}" --config configs/grpo_h200_x2_colocated.yaml --doc "$OUT/$r.md" ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "run_multigpu.sh: failed: ${failed[*]}" >&2
  exit 1
fi
