#!/usr/bin/env bash
# One whole GPU round in one command: build for this GPU's arch (sm_90a on an H100 or H200: the flash call by wgmma,
# sm_120 on an RTX PRO 6000: read from nvidia-smi's compute capability, GPU_ARCH=sm_NN to name it; an arch-specific
# build is every step's library) and its SASS schedule
# (kdev sass, into round.log), the GPU tests (and the triton peer's, compiled here), kdev verify on the smoke suite
# and a fuzz run (each followed by flash-portable alone with the deploy target's split plan, kdev verify --plan-gpu:
# the target's kernels and grids), and a short bench beside the launch plan of its shapes on this GPU (kdev plan,
# into round.log). Results go under $OUT
# (default ./gpu-results): at most 8 files, the last lines of each step on stdout.
#   usage: scripts/gpu-round.sh [--fuzz N] [--sweep NAME[,NAME...]] [--baseline FILE] [--backend LIST]
#                               [--normalize-by BACKEND] [--skip-tests] [--sanitize]
#                               [--deploy-check | --deploy-only] [--profile SHAPE]... [--profile-loop NAME]...
#                               [--profile-only] [--profile-kernel REGEX] [--profile-backend NAME]
#                               [--kernel-times SWEEP] [--ab KERNELS_DIR]
#                               [--variants KERNELS_DIR[,KERNELS_DIR...]] [--variant-patch FILE[,FILE...]]
#                               [--timeline SHAPE]... [--step-timeout SECONDS] [--graph] [--axis NAME=V1,V2]...
# --backend LIST names the backends of the bench steps; triton among them is timed in a step of its own, beside
# flash-portable, its table in round.log (below: a Triton fault would otherwise take the sweep's timings with it).
# --graph: each sweep's backends are also timed as CUDA-graph replays (kdev bench --graph), the table in round.log.
# --axis page_size=1,64 (repeatable): every bench step of a sweep (the plain one, the A/B, the variants, the kernel
# times) varies that axis over its shapes (kdev bench -a).
# Every step runs under a time limit (--step-timeout, default 600 s): a kernel that never finishes (a barrier
# deadlock) ends its step with "timed out" instead of holding the machine, and the steps after it are
# skipped, since they would launch the same kernel.
# --profile B=1,L=32768,N=64,H=8 (repeatable) ends the round with Nsight Compute on one flash launch at that
# shape (full section set, clocks left alone); the report goes under $OUT as text: sections, raw metrics (CSV)
# and the SASS with per-instruction counters (CSV); --profile-kernel picks which kernel of the call (a regex, default
# verify_attn_flash_(teams_|wgmma_)?kernel: the full-tile kernel, lockstep, teams or wgmma;
# verify_attn_flash_narrow_kernel for the narrow last tiles); --profile-backend the call (default flash;
# flash-portable: the lockstep kernels at every page size, the sm_120 product's).
# --profile-loop 'S+PV 8w +xchg +softmax +gather' (repeatable)
# does the same for one rung of the flash loop ladder (`kdev bench --ceilings --loop NAME`; sections and raw
# metrics in one text file, to stay within the files a round returns): two rungs one piece apart say what that
# piece costs where.
# --profile-only: build and the profiles, nothing else.
# --kernel-times targets: every flash and combine launch of `kdev bench --sweep targets --backend flash`
# under Nsight Compute with one metric (GPU time; caches flushed before each launch, clocks left alone), and
# the median per kernel and grid into kernel-times.txt: what the split-KV combine and the launch gap cost
# beside the main kernel at each shape.
# --ab build/ab-base/kernels: an A/B in this machine start, where the drift between starts (1-3 %) cannot
# blur it. KERNELS_DIR is another kernels/ tree, the base (e.g. `mkdir -p build/ab-base && git archive REV
# kernels | tar -x -C build/ab-base`, carried to the GPU machine); it is built into a library of its own
# (kdev build --kernels), and for each --sweep the base and the working tree's library (the candidate) are
# timed in turn, base then candidate, twice, each candidate judged against the base just before it
# (--normalize-by applies: a candidate SLOW at any shape ends its step with bench's regression exit code, 1; the
# plain bench step takes --normalize-by only beside --baseline, which it needs);
# scripts/ab_summary.py puts the medians and ratios of both pairs into ab-SWEEP.txt. Then the same A/B in one process
# (ab-SWEEP-one-run, its table in round.log): `kdev bench --backend flash,flash@BASE,...` (KERNEL@REF).
# With --kernel-times, the base library's launches are timed too (kernel-times-base.txt). round.log records which
# kernels' machine code the candidate changed (kdev sass --against the base; for --variants, each against the tree).
# --variants build/variants/q2/kernels,build/variants/comb2/kernels: several other kernels/ trees timed beside the
# working tree in this machine start, each built into a library of its own and named by its folder (the one above
# kernels/). Per --sweep the working tree runs first and last (their drift is the noise band) and every variant in
# between; scripts/variants_summary.py puts each variant's medians and its ratio to the tree into
# variants-SWEEP.txt. Each variant is verified first (smoke suite and --fuzz 20, its flash kernel beside the tree's:
# variant-verify-NAME, which also counts the checks where both gave the same bits).
# A variant that does one stage twice prices that stage (the timing method for places inside a call that no counter
# separates); one that changes a stage is a candidate, to confirm with --ab. A variant whose build fails the
# resource gate (spills) is still timed, as NAME-gatefail.
# --variant-patch variants/NAME.patch: a variant made from the working tree's kernels/ with that patch applied
# (scripts/variant-tree.sh), named NAME and timed with the --variants trees; the patches travel with the working tree,
# so nothing needs to be carried. A patch that does not apply to the tree is refused before anything runs.
# --timeline B=16,L=8192,N=32,H=8 (repeatable): the working tree's kernels/ with variants/flash-v24-probe-timeline.patch
# (every flash CTA records its %globaltimer stamps) built into a library of its own, and scripts/cta_timeline.py on it at
# that shape: each CTA's ramp, tile loop and drain, the gap between CTAs on an SM, and what the combine adds after the
# last tile, into timeline-SHAPE.txt. A probe
# patch that no longer applies to the tree is refused before anything runs.
# --deploy-check ends the round with build (all archs) -> verify -> deploy-check, then edits a kernel and
# runs deploy-check again (it must fail, naming the file); both reports go under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# this GPU's arch for every build of the round: compute capability 9.0 -> sm_90 -> the arch `kdev build` targets for
# it (kdev/build.py, build_arch_for: sm_90a, the flash call by wgmma), 12.0 -> sm_120 (the first GPU's); GPU_ARCH=sm_90
# times the mma.sync kernels alone
ARCH="${GPU_ARCH:-}"
if [ -z "$ARCH" ]; then
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')"
  if [[ "$cc" =~ ^([0-9]+)\.([0-9])$ ]]; then ARCH="sm_${BASH_REMATCH[1]}${BASH_REMATCH[2]}"; else ARCH=sm_90; fi
  target="$(python3 -c 'import sys; from kdev.build import build_arch_for; print(build_arch_for(sys.argv[1]))' "$ARCH" \
    2>/dev/null)" && [ -n "$target" ] && ARCH="$target"
fi
[[ "$ARCH" =~ ^sm_[0-9]{2,3}a?$ ]] || { echo "GPU_ARCH=$ARCH: not an arch (e.g. sm_90, sm_120)" >&2; exit 2; }
FUZZ=200 SWEEP=smoke SKIP_TESTS=0 SANITIZE=0 BASELINE= BACKENDS= NORMALIZE= DEPLOY=0 ONLY_DEPLOY=0 GRAPH=0
PROFILES=() LOOP_PROFILES=() ONLY_PROFILE=0 PROFILE_KERNEL='verify_attn_flash_(teams_|wgmma_)?kernel' PROFILE_BACKEND=flash STEP_TIMEOUT=600 HUNG= KERNEL_TIMES= AB_KERNELS= AB_LIB=
VARIANTS=() PATCHES=() TIMELINES=() TIMELINE_TREE= AXIS_ARGS=()
VERIFY_KERNELS=naive,flash,flash-portable,flash-hostplan,flash-portable-hostplan,ddtree,accept,compact  # what the smoke, sanitizer and fuzz steps verify
# the deploy target (configs/gpus.yaml): flash-portable is also verified with its split plan (kdev verify --plan-gpu)
TARGET_GPU=rtx-pro-6000
while [ $# -gt 0 ]; do
  case "$1" in  # an option that takes a value and is given none is refused before anything runs
    --fuzz|--sweep|--baseline|--backend|--normalize-by|--profile|--profile-loop|--profile-kernel|--profile-backend|\
    --kernel-times|--ab|--variants|--variant-patch|--timeline|--step-timeout|--axis)
      [ $# -ge 2 ] || { echo "$1 takes a value" >&2; exit 2; } ;;
  esac
  case "$1" in
    --fuzz) FUZZ="$2"; shift 2 ;;
    --sweep) SWEEP="$2"; shift 2 ;;
    --baseline) BASELINE="$2"; shift 2 ;;
    --backend) BACKENDS="$2"; shift 2 ;;
    --normalize-by) NORMALIZE="$2"; shift 2 ;;
    --skip-tests) SKIP_TESTS=1; shift ;;
    --sanitize) SANITIZE=1; shift ;;
    --deploy-check) DEPLOY=1; shift ;;
    --deploy-only) DEPLOY=1; ONLY_DEPLOY=1; SKIP_TESTS=1; shift ;;
    --profile) PROFILES+=("$2"); shift 2 ;;
    --profile-loop) LOOP_PROFILES+=("$2"); shift 2 ;;
    --profile-only) ONLY_PROFILE=1; shift ;;
    --profile-kernel) PROFILE_KERNEL="$2"; shift 2 ;;
    --profile-backend) PROFILE_BACKEND="$2"; shift 2 ;;
    --kernel-times) KERNEL_TIMES="$2"; shift 2 ;;
    --ab) AB_KERNELS="$2"; shift 2 ;;
    --variants) IFS=, read -ra more <<< "$2"; VARIANTS+=("${more[@]}"); shift 2 ;;
    --variant-patch) IFS=, read -ra more <<< "$2"; PATCHES+=("${more[@]}"); shift 2 ;;
    --timeline) TIMELINES+=("$2"); shift 2 ;;
    --step-timeout) STEP_TIMEOUT="$2"; shift 2 ;;
    --graph) GRAPH=1; shift ;;
    --axis) AXIS_ARGS+=(-a "$2"); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
# triton in --backend is timed in a bench step of its own, beside flash-portable (their ratio from one run): a fault in
# a Triton kernel is sticky in its CUDA context and would take the sweep's flash timings with it. The A/B and variant
# benches leave it out (a peer does not change with the kernels).
PEER_TRITON=0
if [ -n "$BACKENDS" ]; then
  IFS=, read -ra listed <<< "$BACKENDS"
  kept=()
  for b in "${listed[@]}"; do if [ "$b" = triton ]; then PEER_TRITON=1; else kept+=("$b"); fi; done
  BACKENDS="$(IFS=,; echo "${kept[*]}")"
fi
case "$STEP_TIMEOUT" in ''|*[!0-9]*|0) echo "--step-timeout takes a whole number of seconds > 0, not '$STEP_TIMEOUT'" >&2; exit 2 ;; esac
case "$FUZZ" in ''|*[!0-9]*) echo "--fuzz takes a whole number of cases (0: no fuzz run), not '$FUZZ'" >&2; exit 2 ;; esac
[ -z "$AB_KERNELS" ] || [ -d "$AB_KERNELS/include" ] || { echo "--ab $AB_KERNELS: not a copy of kernels/ (no include/ folder)" >&2; exit 2; }
if [ ${#PATCHES[@]} -gt 0 ]; then
  patch_dir="$(mktemp -d)"
  for f in "${PATCHES[@]}"; do
    tree="$(bash scripts/variant-tree.sh "$f" "$patch_dir")" || exit 2
    VARIANTS+=("$tree")
  done
fi
if [ ${#TIMELINES[@]} -gt 0 ]; then
  TIMELINE_TREE="$(bash scripts/variant-tree.sh variants/flash-v24-probe-timeline.patch "$(mktemp -d)")" || exit 2
fi
declare -A VARIANT_DIR
for dir in "${VARIANTS[@]}"; do
  [ -d "$dir/include" ] || { echo "--variants $dir: not a copy of kernels/ (no include/ folder)" >&2; exit 2; }
  name="$(basename "$dir")"; [ "$name" != kernels ] || name="$(basename "$(dirname "$dir")")"
  [ -z "${VARIANT_DIR[$name]:-}" ] || { echo "--variants: two variants named $name (the folder above kernels/)" >&2; exit 2; }
  VARIANT_DIR[$name]="$dir"
done
# kdev's own command line must start: a missing or broken dependency is one line before the round, not a traceback in
# every step of it
if ! err="$(python3 -m kdev --version 2>&1)"; then
  echo "python3 -m kdev does not start here ($(printf '%s' "$err" | tail -n 1)): pip install -e . (kdev's dependencies)" >&2
  exit 3
fi
LOG="$OUT/round.log"
declare -A RC
step() {  # step NAME CMD...: run under the step time limit, log, remember the exit code
  local name="$1"; shift
  if [ -n "$HUNG" ]; then
    echo "--- $name: skipped ($HUNG timed out)" | tee -a "$LOG"; RC[$name]=skipped; return
  fi
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$STEP_TIMEOUT" "$@" 2>&1 | tee -a "$LOG" | tail -n 40
  RC[$name]=${PIPESTATUS[0]}
  if [ "${RC[$name]}" = 124 ] || [ "${RC[$name]}" = 137 ]; then
    HUNG=$name
    echo "--- $name: timed out after $((SECONDS - t0)) s (limit $STEP_TIMEOUT s): a hung kernel, or raise --step-timeout" | tee -a "$LOG"
  else
    echo "--- $name: exit ${RC[$name]} after $((SECONDS - t0)) s" | tee -a "$LOG"
  fi
}
build_kernels() {  # build_kernels STEP KERNELS_DIR JSON [ARCH]: another kernels/ tree into its own library -> $BUILT_LIB
  step "$1" bash -c 'python3 -m kdev build --kernels "$1" --arch "$3" --json > "$2"' _ "$2" "$3" "${4:-$ARCH}"
  BUILT_LIB="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["library"])' "$3" 2>/dev/null)"
}
sass_against() {  # sass_against LIBRARY BASE: which kernels' machine code for this arch differs from BASE's, into round.log
  # (informational, not a step, like the sass table: a round without cuobjdump / nvdisasm only loses the lines)
  { echo "=== sass: python3 -m kdev sass --library $1 --against $2 --arch $ARCH"
    python3 -m kdev sass --library "$1" --against "$2" --arch "$ARCH" 2>&1; } | tee -a "$LOG" | tail -n 20
}
kernel_times() {  # kernel_times NAME [BENCH ARGS...]: ncu GPU times of one bench sweep's flash and combine launches
  local name="$1"; shift
  local csv_path; csv_path="$(mktemp -d)/$name.csv"  # one row per launch: only the summary comes back
  step "$name" ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --kernel-name 'regex:verify_attn_(flash|combine)' --log-file "$csv_path" \
    python3 -m kdev bench --sweep "$KERNEL_TIMES" "${AXIS_ARGS[@]}" --backend flash "$@"
  python3 scripts/kernel_times.py "$csv_path" > "$OUT/$name.txt" 2>&1
  tail -n 30 "$OUT/$name.txt"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv; git log -1 --oneline 2>/dev/null || true; } | tee -a "$LOG"
echo "arch: $ARCH" | tee -a "$LOG"
step build python3 -m kdev build --arch "$ARCH"
# the SASS schedule of the flash kernel just built (accumulator chains, fragment-load lead), for the record
# beside the timings; informational, not a step: a machine without cuobjdump / nvdisasm only loses the table
# (only after a good build: latest.json would still name the previous library)
TREE_LIB=""
if [ "${RC[build]}" = 0 ]; then
  { echo "=== sass: python3 -m kdev sass --arch $ARCH"; python3 -m kdev sass --arch "$ARCH" 2>&1; } | tee -a "$LOG" | tail -n 12
  TREE_LIB="$(python3 -c 'from kdev.build import latest_library; print(latest_library() or "")' 2>/dev/null)"
  # an arch-specific build (sm_90a: the flash call by wgmma) is the library of every later step, the GPU
  # tests' too (tests/gpu/conftest.py takes KDEV_LIB)
  if [[ "$ARCH" == *a ]]; then
    KDEV_LIB="$(python3 -c 'import sys; from kdev.build import latest_library; print(latest_library(archs=[sys.argv[1]]) or "")' "$ARCH" 2>/dev/null)"
    [ -n "$KDEV_LIB" ] && export KDEV_LIB && echo "library of every step: $KDEV_LIB" | tee -a "$LOG"
  fi
fi
if [ "$ONLY_DEPLOY" = 0 ] && [ "$ONLY_PROFILE" = 0 ]; then
if [ "$SKIP_TESTS" = 0 ]; then
  step gpu-tests python3 -m pytest -q -m gpu tests/gpu -rs
  # the triton peer's tests, compiled on this GPU, in a process of their own: a fault in a Triton kernel (sticky in
  # its CUDA context) cannot take the flash kernels' GPU tests with it
  step triton-peer-tests python3 -m pytest -q tests/test_triton_peer.py -rs
fi
step verify-smoke python3 -m kdev verify --suite smoke --kernel "$VERIFY_KERNELS" --repeat 3 --out-json "$OUT/verify-smoke.json"
step verify-smoke-target-plan python3 -m kdev verify --suite smoke --kernel flash-portable --plan-gpu "$TARGET_GPU" --repeat 2
if [ "$SANITIZE" = 1 ] && command -v compute-sanitizer >/dev/null; then
  # the field report's sanitizer cases (kdev/field_report.py: SANITIZER_CASES)
  mapfile -t SAN_CASES < <(python3 -c 'from kdev.field_report import SANITIZER_CASES as c; print("\n".join(c))')
  SAN_ARGS=()
  for c in "${SAN_CASES[@]}"; do SAN_ARGS+=(--case "$c"); done
  for tool in memcheck racecheck; do
    step "sanitize-$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 python3 -m kdev verify --suite smoke \
      "${SAN_ARGS[@]}" --kernel "$VERIFY_KERNELS"
  done
fi
step ceilings python3 -m kdev bench --ceilings
for sw in ${SWEEP//,/ }; do
  # what the flash call launches at each shape on this GPU (splits, CTAs, waves, workspace), beside its timings;
  # informational like the sass table
  { echo "=== plan: python3 -m kdev plan --sweep $sw"; python3 -m kdev plan --sweep "$sw" 2>&1; } | tee -a "$LOG" | tail -n 14
  if [ -n "$BACKENDS" ] || [ "$PEER_TRITON" = 0 ]; then
    step "bench-$sw" python3 -m kdev bench --sweep "$sw" "${AXIS_ARGS[@]}" --out-json "$OUT/bench-$sw.json" --csv "$OUT/bench-$sw.csv" \
      ${BASELINE:+--baseline "$BASELINE"} ${BACKENDS:+--backend "$BACKENDS"} ${BASELINE:+${NORMALIZE:+--normalize-by "$NORMALIZE"}}
  fi
  if [ "$PEER_TRITON" = 1 ]; then  # its table goes to round.log (the files a round returns are few)
    step "bench-$sw-triton" python3 -m kdev bench --sweep "$sw" "${AXIS_ARGS[@]}" --backend flash-portable,triton
  fi
  if [ "$GRAPH" = 1 ]; then  # the same backends timed as CUDA-graph replays (how a server runs decode), into round.log
    step "bench-$sw-graph" python3 -m kdev bench --sweep "$sw" "${AXIS_ARGS[@]}" --graph ${BACKENDS:+--backend "$BACKENDS"}
  fi
done
if [ -n "$AB_KERNELS" ]; then
  ab_dir="$(mktemp -d)"  # the bench documents stay there: only the summaries come back
  build_kernels ab-build "$AB_KERNELS" "$ab_dir/build.json"; AB_LIB="$BUILT_LIB"
  # what the candidate (the working tree) changed in the machine code against the base
  [ -z "$AB_LIB" ] || [ -z "$TREE_LIB" ] || sass_against "$TREE_LIB" "$AB_LIB"
  for sw in ${SWEEP//,/ }; do
    [ -n "$AB_LIB" ] || break
    for pair in 1 2; do
      step "ab-$sw-base-$pair" python3 -m kdev bench --library "$AB_LIB" --sweep "$sw" "${AXIS_ARGS[@]}" --out-json "$ab_dir/base-$sw-$pair.json" \
        ${BACKENDS:+--backend "$BACKENDS"}
      step "ab-$sw-cand-$pair" python3 -m kdev bench --sweep "$sw" "${AXIS_ARGS[@]}" --out-json "$ab_dir/cand-$sw-$pair.json" \
        --baseline "$ab_dir/base-$sw-$pair.json" ${BACKENDS:+--backend "$BACKENDS"} ${NORMALIZE:+--normalize-by "$NORMALIZE"}
    done
    python3 scripts/ab_summary.py ${NORMALIZE:+--normalize-by "$NORMALIZE"} "$ab_dir/base-$sw-1.json" "$ab_dir/cand-$sw-1.json" \
      "$ab_dir/base-$sw-2.json" "$ab_dir/cand-$sw-2.json" > "$OUT/ab-$sw.txt" 2>&1
    tee -a "$LOG" < "$OUT/ab-$sw.txt"
    # the same A/B in one process: each flash backend from both libraries, back to back at every shape (its table,
    # t/t(flash), goes to round.log)
    one_run=
    IFS=, read -ra ab_backends <<< "${BACKENDS:-flash}"
    for b in "${ab_backends[@]}"; do
      case "$b" in flash|flash-portable) one_run+="$b,$b@$AB_LIB," ;; naive) one_run+="naive," ;; esac
    done
    [ -z "$one_run" ] || step "ab-$sw-one-run" python3 -m kdev bench --sweep "$sw" "${AXIS_ARGS[@]}" --backend "${one_run%,}"
  done
fi
if [ ${#VARIANTS[@]} -gt 0 ]; then
  var_dir="$(mktemp -d)"
  declare -A VARIANT_LIB
  for name in "${!VARIANT_DIR[@]}"; do
    build_kernels "variant-build-$name" "${VARIANT_DIR[$name]}" "$var_dir/build-$name.json"
    [ -z "$BUILT_LIB" ] || VARIANT_LIB[$name]="$BUILT_LIB"
    [ -z "$BUILT_LIB" ] || [ -z "$TREE_LIB" ] || sass_against "$BUILT_LIB" "$TREE_LIB"  # what the variant changed
    # checked before it is timed: the smoke suite (page sizes 1 and 64, ragged batches) and a short fuzz, its flash
    # kernel beside the tree's (KERNEL@REF): both against the goldens, and whether the variant gives the same bits
    [ -z "$BUILT_LIB" ] || step "variant-verify-$name" bash -c 'python3 -m kdev verify --suite smoke \
      --kernel "flash,flash@$1" && python3 -m kdev verify --fuzz 20 --kernel "flash,flash@$1"' _ "$BUILT_LIB"
  done
  for sw in ${SWEEP//,/ }; do
    step "variants-$sw-tree-1" python3 -m kdev bench --sweep "$sw" "${AXIS_ARGS[@]}" --out-json "$var_dir/tree-$sw-1.json" ${BACKENDS:+--backend "$BACKENDS"}
    timed=()
    for name in "${!VARIANT_LIB[@]}"; do
      step "variants-$sw-$name" python3 -m kdev bench --library "${VARIANT_LIB[$name]}" --sweep "$sw" "${AXIS_ARGS[@]}" \
        --out-json "$var_dir/$name-$sw.json" ${BACKENDS:+--backend "$BACKENDS"}
      # a build that failed its resource gate (spills) still wrote a library: timed, and named so in the summary
      label="$name"; [ "${RC[variant-build-$name]}" = 0 ] || label="$name-gatefail"
      [ "${RC[variants-$sw-$name]}" != 0 ] || timed+=("$label=$var_dir/$name-$sw.json")
    done
    step "variants-$sw-tree-2" python3 -m kdev bench --sweep "$sw" "${AXIS_ARGS[@]}" --out-json "$var_dir/tree-$sw-2.json" ${BACKENDS:+--backend "$BACKENDS"}
    python3 scripts/variants_summary.py "$var_dir/tree-$sw-1.json" "$var_dir/tree-$sw-2.json" "${timed[@]}" \
      > "$OUT/variants-$sw.txt" 2>&1
    tee -a "$LOG" < "$OUT/variants-$sw.txt"
  done
fi
# last: the longest steps (a killed round keeps everything above); --fuzz 0 leaves them out (kdev verify --fuzz 0
# would run the smoke suite again)
[ "$FUZZ" -eq 0 ] || step verify-fuzz python3 -m kdev verify --fuzz "$FUZZ" --kernel "$VERIFY_KERNELS" \
  --out-json "$OUT/verify-fuzz.json"
[ "$FUZZ" -lt 4 ] || step verify-fuzz-target-plan python3 -m kdev verify --fuzz "$((FUZZ / 4))" --kernel flash-portable \
  --plan-gpu "$TARGET_GPU"
fi
for shape in "${PROFILES[@]}"; do
  name="ncu-$(echo "$shape" | tr -d '=' | tr -c 'A-Za-z0-9\n' '_')"
  rep="$(mktemp -d)/$name"
  step "$name" ncu --clock-control none --set full --import-source no --kernel-name "regex:$PROFILE_KERNEL" \
    --launch-skip 2 --launch-count 1 -o "$rep" --log-file "$OUT/$name.log" \
    python3 -m kdev bench --shape "$shape" --backend "$PROFILE_BACKEND"
  # the report as text: the sections, every raw metric (stall reasons per issued instruction among them),
  # and the SASS with per-instruction counters and stall samples
  ncu --import "$rep.ncu-rep" --print-details all > "$OUT/$name.txt" 2>&1
  ncu --import "$rep.ncu-rep" --page raw --csv > "$OUT/$name-raw.csv" 2>&1
  ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$OUT/$name-sass.csv" 2>&1 || true
done
if [ -n "$TIMELINE_TREE" ]; then
  # for the GPU's own arch (sm_90, not sm_90a): the probe is in the mma.sync kernels, the wgmma kernel carries none
  build_kernels timeline-build "$TIMELINE_TREE" "$(mktemp -d)/timeline-build.json" "${ARCH%a}"
  for shape in "${TIMELINES[@]}"; do
    name="timeline-$(echo "$shape" | tr -d '=' | tr -c 'A-Za-z0-9\n' '_')"
    step "$name" bash -c 'set -o pipefail; python3 scripts/cta_timeline.py --library "$1" --shape "$2" | tee "$3"' \
      _ "$BUILT_LIB" "$shape" "$OUT/$name.txt"
  done
fi
if [ -n "$KERNEL_TIMES" ]; then
  kernel_times kernel-times
  [ -z "$AB_LIB" ] || kernel_times kernel-times-base --library "$AB_LIB"
fi
for loop in "${LOOP_PROFILES[@]}"; do
  name="ncu-loop-$(echo "$loop" | tr -c 'A-Za-z0-9\n' '_')"
  rep="$(mktemp -d)/$name"
  step "$name" ncu --clock-control none --set full --import-source no --kernel-name 'regex:(inner|grouped)_loop_kernel' \
    --launch-count 1 -o "$rep" --log-file "$OUT/$name.log" \
    python3 -m kdev bench --ceilings --loop "$loop"
  # the sections and every raw metric (shared-memory wavefronts by instruction kind among them) in one file
  { ncu --import "$rep.ncu-rep" --print-details all; ncu --import "$rep.ncu-rep" --page raw --csv; } \
    > "$OUT/$name.txt" 2>&1
done
if [ "$DEPLOY" = 1 ]; then
  # deploy-check reads git history; a tree copied without it is checked as a snapshot repository in a
  # temporary folder (the tree itself is left alone)
  if ! git rev-parse -q --verify HEAD >/dev/null 2>&1; then
    SNAP="$(mktemp -d)/kdev" && mkdir -p "$SNAP"
    tar --exclude=./.git --exclude=./build --exclude=./.kdev --exclude=./gpu-results -cf - . | tar -xf - -C "$SNAP"
    git -C "$SNAP" init -q && git -C "$SNAP" add -A &&
      git -C "$SNAP" -c user.email=round@kdev -c user.name=kdev commit -qm "round snapshot"
    cd "$SNAP" && export PYTHONPATH="$SNAP"
  fi
  step deploy-build python3 -m kdev build
  step deploy-verify python3 -m kdev verify --suite smoke
  step deploy-check-clean python3 -m kdev deploy-check
  python3 -m kdev deploy-check > "$OUT/deploy-clean.txt" 2>&1
  cp kernels/verify_attn.cu "$OUT/.verify_attn.cu.bak"
  echo "// edited after the build" >> kernels/verify_attn.cu
  step deploy-check-edited python3 -m kdev deploy-check
  python3 -m kdev deploy-check > "$OUT/deploy-edited.txt" 2>&1
  cp "$OUT/.verify_attn.cu.bak" kernels/verify_attn.cu && rm -f "$OUT/.verify_attn.cu.bak"
  [ "${RC[deploy-check-edited]}" != 0 ] && RC[deploy-check-edited]=0 || RC[deploy-check-edited]=1  # must fail
fi
echo "=== summary" | tee -a "$LOG"
fail=0
for k in "${!RC[@]}"; do
  case "${RC[$k]}" in skipped) echo "$k: skipped" ;; 124|137) echo "$k: timed out" ;; *) echo "$k: exit ${RC[$k]}" ;; esac | tee -a "$LOG"
  [ "${RC[$k]}" = 0 ] || fail=1
done
exit $fail
