#!/usr/bin/env bash
# The one command for a machine with a GPU: every decoding path and every stage on CUDA, and the GPU
# benchmarks, each under its own time limit, summarised in one Markdown file.
#
# Run as (repository root, on a machine with Python + torch + transformers, no internet needed):
#     make gpu-wheels                         # here, with internet: the wheels the GPU image lacks
#     bash scripts/gpu_check.sh               # there: writes $OUT/summary.md (OUT defaults to gpu-check/)
#     bash scripts/gpu_check.sh --device cpu  # a dry run of the same steps on tiny settings (CPU machine)
#
# Options: --device cuda|cpu (default cuda), --dtype bfloat16|float16|float32 (the demo eval; default
# bfloat16 on CUDA, float32 on the CPU), --workdir DIR (a `make demo` workdir, without train/; default runs/gpu-demo, made by
# `make gpu-demo`), --wheels DIR (default .gpu-wheels), --out DIR (default $OUT or gpu-check),
# --budget SECONDS (default 0: none; else each step's limit is cut to what is left of the budget and a
# step that would start with under 30 s left is skipped, so the summary is written in time),
# --only STEP,STEP,... (run only these steps, by the names of the summary's rows; wheels and
# environment always run), --select EXPR (pytest -k for the gpu tests; default: all of them).
# Without a demo workdir the demo steps are skipped (and say so). On one H100 (2026-11-27) the gpu tests
# took 215 s, bench_attention 66, the demo's eval 99, each captured-step variant 23-37, bench_linear and
# bench_sampling 5-11, the stages 13-28 each, bench_decode with one attention 14-26; the compiled-step
# variants (bench-static-compile, bench-static-inductor) have not run there (up to 8 minutes at their
# limits). With less device time pass --budget, or --only the steps needed.
#
# What it runs, most important first; a failing step is recorded and the next one runs:
#   1. wheels: pip install --no-index --no-deps --target the carried wheels (hydra, omegaconf, datasets, ...)
#   2. gpu tests: pytest -m gpu on tests/gpu and the tree-attention kernels' tests (greedy parity fp32,
#      bf16/fp16 identical fraction, eval stage, the Triton and CUDA kernels against SDPA)
#   3. bench_attention.py: the tree-attention kernels against SDPA and flash attention; then on the layers
#      of Llama 4 (chunks), gpt-oss (sinks), Gemma 2 (softcap) and DeepSeek-V3 (narrower values)
#   4. stage=eval on the demo workdir in --dtype, with the compiled decoders on CUDA (the headline:
#      speed-up against eager and compiled plain greedy, tree forward vs plain step)
#   5. bench_static.py: the static-shape step (CUDA graph) against transformers' compiled static cache,
#      then the captured step with SDPA and with the Triton kernel at 2K and 8K context (8,000: the
#      8B shape holds 8,192 positions), with exact sampling in the step, with heads over a 32K-token
#      draft vocabulary, compiled by inductor (reduce-overhead; then max-autotune with the 32K-token
#      heads); bench_static_profile.py: the step's GPU time by kind of kernel and part of the step;
#      bench_sampling.py: the warping of 64 and 1,024 distributions of 128K
#      against transformers' warpers; bench_linear.py: the 8B shape's products at 1..256 tokens
#   6. stages on the demo backbone, small settings: distill (in-process engine), train Medusa-1,
#      export, custom_generate, train Medusa-2 (LoRA), train Medusa-1 under DeepSpeed ZeRO-2 (one GPU)
#   7. bench_decode.py --llama8b-shape: the eager decoder, and its Medusa step with each tree attention
#      (the three timed in turn over 5 rounds in one process)
set -u
DEVICE=cuda
DTYPE=
WORKDIR=runs/gpu-demo
WHEELS=.gpu-wheels
OUTDIR=${OUT:-gpu-check}
BUDGET=0
ONLY=
SELECT_EXPR=
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --dtype) DTYPE=$2; shift 2 ;;
        --workdir) WORKDIR=$2; shift 2 ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --out) OUTDIR=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --select) SELECT_EXPR=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -u/{/^set -u/d;p}' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}  # PYTHON=.venv/bin/python for the dry run on a development machine
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SUMMARY=$OUTDIR/summary.md
LOG=$OUTDIR/log.txt
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export MEDUSA_GPU_REPORT=$OUTDIR/gpu_tests.jsonl MEDUSA_GPU_TEST_DEVICE=$DEVICE
: >"$LOG"
: >"$MEDUSA_GPU_REPORT"
QUICK=0
[ "$DEVICE" = cpu ] && QUICK=1
[ -z "$DTYPE" ] && { [ $QUICK = 1 ] && DTYPE=float32 || DTYPE=bfloat16; }  # bf16 matmuls crawl on a CPU

{
    echo "# gpu_check ($(date -u +%FT%TZ), device $DEVICE)"
    echo
    echo "| step | result | seconds | note |"
    echo "|---|---|---|---|"
} >"$SUMMARY"

BEGAN=$(date +%s)
# step NAME LIMIT_S NOTE CMD...: run CMD under a time limit (cut to what is left of --budget), log its
# output, add a summary row.
step() {
    local name=$1 limit=$2 note=$3
    shift 3
    local t0 t1 rc result left
    case "$name" in
        wheels | environment) ;;
        *) if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi ;;
    esac
    if [ "$BUDGET" -gt 0 ]; then
        left=$((BUDGET - ($(date +%s) - BEGAN)))
        if [ $left -lt 30 ]; then
            skip "$name" "not run: ${left}s of the ${BUDGET}s budget left"
            return 0
        fi
        [ $left -lt "$limit" ] && limit=$left
    fi
    echo "===== $name (limit ${limit}s): $*" >>"$LOG"
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    case $rc in
        0) result=pass ;;
        124 | 137) result="TIMEOUT" ;;
        *) result="FAIL (exit $rc)" ;;
    esac
    printf '| %s | %s | %.1f | %s |\n' "$name" "$result" "$(awk "BEGIN {print $t1 - $t0}")" "$note" >>"$SUMMARY"
    echo "===== $name: $result" >>"$LOG"
    return $rc
}
skip() { printf '| %s | skipped | - | %s |\n' "$1" "$2" >>"$SUMMARY"; }
# merge_json PREFIX OUT: $SCRATCH/PREFIX_<name>.json files as one {name: contents} JSON file (the
# device returns at most 8 files).
merge_json() {
    "$PY" - "$SCRATCH" "$1" "$2" <<'PYEOF'
import json, sys
from pathlib import Path
scratch, prefix, out = sys.argv[1:]
runs = {p.stem.removeprefix(prefix + "_"): json.loads(p.read_text()) for p in sorted(Path(scratch).glob(prefix + "_*.json"))}
if runs:
    Path(out).write_text(json.dumps(runs, indent=1))
PYEOF
}

# 1. Wheels the image lacks (hydra, omegaconf, datasets, deepspeed...), installed beside the image's own.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    step wheels 120 "$(ls "$WHEELS" | wc -l) wheels from $WHEELS" \
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SCRATCH/site" "$WHEELS"/*.whl
    export PYTHONPATH=$PWD:$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
else
    skip wheels "no $WHEELS/*.whl: using what the machine has"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
step environment 60 "versions and device" "$PY" -c "
import torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')
for m in ('hydra', 'datasets', 'deepspeed', 'peft', 'triton'):
    try:
        __import__(m); print(m, 'ok')
    except Exception as e:
        print(m, 'missing:', e)
"
grep -E "^(torch|device) " "$LOG" | sed 's/^/    /' >"$OUTDIR/environment.txt"

# 2. The gpu-marked tests (on --device cpu: the same tests on the CPU, a dry run of the test code).
# Every test file holding gpu-marked tests (tests/unit/test_gpu_check.py checks the list is complete).
GPU_TEST_FILES=(
    tests/gpu
    tests/unit/decoding/test_tree_attention.py
    tests/unit/decoding/test_decoding_static.py
    tests/unit/decoding/test_decoding_architectures.py
    tests/unit/training/test_training_losses.py
)
SELECT=()
# The dry run: one architecture, one tree per test function (the CPU is slow at these sizes).
[ $QUICK = 1 ] && SELECT=(-k "llama and not medusa63 and not random or calibration or eval_stage or sequential")
[ -n "$SELECT_EXPR" ] && SELECT=(-k "$SELECT_EXPR")
LIMIT=420  # 76 tests; 56 of the 58 of 2026-11-27 took 215 s on one H100, 58 s of it the CUDA extension's compile
[ $QUICK = 1 ] && LIMIT=900  # the models of these tests are sized for a GPU
# -v: each test's result is in the log as it ends, so a step cut by its limit still says which passed.
step gpu-tests $LIMIT "tests/gpu + kernel tests (figures in gpu_tests.jsonl)" \
    "$PY" -m pytest -v --durations=15 -p no:cacheprovider -m gpu "${GPU_TEST_FILES[@]}" \
    -o addopts="" "${SELECT[@]}"

# 3. The tree-attention kernels against SDPA (alone on the device: nothing else runs meanwhile).
if [ -f scripts/bench_attention.py ]; then
    ARGS=(--device "$DEVICE" --json "$OUTDIR/bench_attention.json")
    [ $QUICK = 1 ] && ARGS+=(--quick)
    step bench-attention 120 "tree attention kernels vs SDPA" "$PY" scripts/bench_attention.py "${ARGS[@]}"
    # The layers of models whose attention the Triton kernel computes more of: Llama 4's chunks, gpt-oss's
    # sinks, Gemma 2's softcap, DeepSeek-V3's narrower values (each at 2K and 8K, 64 nodes, batch 1 and 8).
    ARGS=(--device "$DEVICE" --models llama4 gpt-oss gemma2 deepseek-v3 --json "$OUTDIR/bench_attention_models.json")
    [ $QUICK = 1 ] && ARGS+=(--quick)
    step bench-attention-models 120 "the kernel on chunks, sinks, softcaps, narrower values" \
        "$PY" scripts/bench_attention.py "${ARGS[@]}"
fi

CLI=("$PY" -m medusa_train tracking=disabled "model.device=$DEVICE")
# 4. The demo's eval on the device: speed-up, tree fitted to the device, every table.
if [ -d "$WORKDIR/heads" ]; then
    EWD=$SCRATCH/eval
    mkdir -p "$EWD"
    cp -a "$WORKDIR"/. "$EWD/"
    rm -rf "$EWD/train" "$EWD/eval"
    EXTRA=()
    [ $QUICK = 1 ] && EXTRA=(eval.num_prompts=4 eval.max_new_tokens=24 "eval.batch_sizes=[1,2]" "eval.sweep_tree_sizes=[1,4]")
    [ $QUICK = 0 ] && EXTRA=(eval.compile=true)  # the baseline a GPU user compares with: compiled plain greedy
    LIMIT=240
    [ $QUICK = 1 ] && LIMIT=600
    if ! step eval-demo $LIMIT "stage=eval, $DTYPE ${EXTRA[*]}" "${CLI[@]}" stage=eval "workdir=$EWD" \
        "model.dtype=$DTYPE" "${EXTRA[@]}" && [ $QUICK = 0 ]; then  # the headline without the compiled rows
        step eval-demo-eager $LIMIT "stage=eval, $DTYPE" "${CLI[@]}" stage=eval "workdir=$EWD" "model.dtype=$DTYPE"
    fi
    cp "$EWD/eval/report.md" "$OUTDIR/eval_report.md" 2>/dev/null
    cp "$EWD/eval/report.json" "$OUTDIR/eval_report.json" 2>/dev/null
else
    skip eval-demo "no demo workdir at $WORKDIR"
fi

# 5. The static-shape step on the 8B shape (CUDA graph) against transformers' compiled static cache.
if [ -f scripts/bench_static.py ]; then
    # Every static run's JSON is merged into one bench_static.json (main, sdpa, triton, ...): the device
    # returns at most 8 files.
    ARGS=(--device "$DEVICE" --json "$SCRATCH/static_main.json")
    [ $QUICK = 1 ] && ARGS+=(--tiny)
    step bench-static 240 "static-shape step, CUDA graph, vs compiled plain" "$PY" scripts/bench_static.py "${ARGS[@]}"
    # The captured step with each tree attention at long contexts.
    ARGS=(--device "$DEVICE" --contexts 2048 8000 --batch-sizes 1 --nodes 1 64 --hf-static-contexts)
    [ $QUICK = 1 ] && ARGS=(--device cpu --tiny --contexts 64 --batch-sizes 1 --nodes 1 4 --hf-static-contexts)
    PARITY=(--parity-captures cuda_graph)
    [ $QUICK = 1 ] && PARITY=(--parity-captures)  # none: the interpreter is slow, the unit tests cover it
    for a in sdpa triton; do
        step "bench-static-$a" 120 "captured step, attention=$a" "$PY" scripts/bench_static.py "${ARGS[@]}" \
            "${PARITY[@]}" --attention $a --json "$SCRATCH/static_$a.json"
    done
    # What the step's GPU time is made of (kernels by kind, by part of the step), run eagerly under the
    # profiler: the step the captures above replay.
    ARGS=(--device "$DEVICE" --context 2048 --nodes 1 64)
    [ $QUICK = 1 ] && ARGS=(--device cpu --tiny --context 64 --nodes 1 4)
    for a in triton sdpa; do
        [ $QUICK = 1 ] && [ $a = triton ] && continue  # the interpreter's time says nothing
        step "profile-static-$a" 90 "the step's kernels by kind and part, attention=$a" "$PY" \
            scripts/bench_static_profile.py "${ARGS[@]}" --attention $a --json "$SCRATCH/static_profile_$a.json"
    done
    # Exact sampling inside the captured step (warping, top-p's sort over the vocabulary, a draw per node).
    ARGS=(--device "$DEVICE" --contexts 2048 --batch-sizes 1 16 --nodes 1 64 --hf-static-contexts)
    [ $QUICK = 1 ] && ARGS=(--device cpu --tiny --contexts 64 --batch-sizes 2 --nodes 1 4 --hf-static-contexts)
    step bench-static-sample 120 "captured step, exact sampling (T 0.7, top-p 0.9)" "$PY" scripts/bench_static.py \
        "${ARGS[@]}" "${PARITY[@]}" --acceptance sample --top-p 0.9 --json "$SCRATCH/static_sample.json"
    # The warping alone, ours against transformers' warpers: top-p over the vocabulary's sort or the top-k's.
    ARGS=(--device "$DEVICE" --rows 64 1024 --json "$SCRATCH/static_sampling.json")
    [ $QUICK = 1 ] && ARGS=(--device cpu --rows 8 --vocab 4096 --json "$SCRATCH/static_sampling.json")
    step bench-sampling 60 "warping 64 and 1024 distributions of 128K" "$PY" scripts/bench_sampling.py "${ARGS[@]}"
    # The backbone's products at 1..256 tokens: whether a tree step's forward reads its weights slower.
    ARGS=(--device "$DEVICE" --json "$SCRATCH/static_linear.json")
    [ $QUICK = 1 ] && ARGS=(--device cpu --quick --dtype float32 --json "$SCRATCH/static_linear.json")
    step bench-linear 60 "8B linear layers at 1-256 tokens vs copy bandwidth" "$PY" scripts/bench_linear.py "${ARGS[@]}"
    # Two ways to a cheaper tree step: heads over a 32K-token draft vocabulary instead of four 128K ones,
    # then inductor (GEMM autotuning + coordinate-descent tuning) instead of the eager captured step.
    ARGS=(--device "$DEVICE" --contexts 2048 --batch-sizes 1 --head-projection truncated --draft-vocab 32768)
    [ $QUICK = 1 ] && ARGS=(--device cpu --tiny --contexts 64 --batch-sizes 1 --head-projection truncated --draft-vocab 128)
    step bench-static-truncated 120 "captured step, triton, 32K-token heads" "$PY" scripts/bench_static.py \
        "${ARGS[@]}" --attention triton --nodes 1 16 32 64 --hf-static-contexts --parity-captures \
        --json "$SCRATCH/static_truncated.json"
    # The whole step compiled by inductor without autotuning (its norms, RoPE and activations fused: on
    # one H100 the captured eager step spent ~3 ms beyond its weight products), own 128K heads, the
    # Triton kernel as one custom op: against the CUDA-graph rows of bench-static-triton. Cheaper than
    # max-autotune below.
    ARGS=(--device "$DEVICE" --contexts 2048 --batch-sizes 1 --nodes 1 64 --capture compile --compile-mode reduce-overhead)
    [ $QUICK = 1 ] && ARGS=(--device cpu --tiny --contexts 64 --batch-sizes 1 --nodes 1 4 --capture compile)
    CPARITY=(--parity-captures compile)
    [ $QUICK = 1 ] && CPARITY=(--parity-captures)
    step bench-static-compile 180 "compiled step (reduce-overhead), own heads, triton" "$PY" scripts/bench_static.py \
        "${ARGS[@]}" --attention triton --hf-static-contexts "${CPARITY[@]}" --json "$SCRATCH/static_compile.json"
    ARGS=(--device "$DEVICE" --contexts 2048 --batch-sizes 1 --head-projection truncated --draft-vocab 32768)
    [ $QUICK = 1 ] && ARGS=(--device cpu --tiny --contexts 64 --batch-sizes 1 --head-projection truncated --draft-vocab 128)
    step bench-static-inductor 300 "compiled step (max-autotune), 32K-token heads" "$PY" scripts/bench_static.py \
        "${ARGS[@]}" --capture compile --compile-mode max-autotune --inductor-tuning --nodes 1 64 \
        --hf-static-contexts --parity-captures --json "$SCRATCH/static_inductor.json"
    merge_json static "$OUTDIR/bench_static.json"
fi

# 6. Every stage on the device, small settings, on copies of the demo workdir.
if [ -d "$WORKDIR/pretrain" ] && [ -d "$WORKDIR/heads" ]; then
    WD=$SCRATCH/stages
    mkdir -p "$WD"
    cp -a "$WORKDIR/pretrain" "$WD/"
    step distill 120 "in-process engine, 24 records" "${CLI[@]}" stage=distill "workdir=$WD" \
        data.max_records=24 distill.max_new_tokens=32
    step train-medusa1 150 "Medusa-1, 30 steps" "${CLI[@]}" stage=train "workdir=$WD" \
        training.max_steps=30 training.max_minutes=2 tree.max_nodes=16
    if [ ! -d "$WD/heads" ]; then  # training was not run here (--only): the demo's own data and heads
        cp -a "$WORKDIR/distill" "$WORKDIR/heads" "$WD/"
    fi
    step export 60 "serving layouts + card" "${CLI[@]}" stage=export "workdir=$WD"
    if [ ! -d "$WD/export" ] && [ -d "$WORKDIR/export" ]; then  # not exported here (--only): the demo's export
        cp -a "$WORKDIR/export" "$WD/"
    fi
    if [ -f scripts/check_custom_generate.py ]; then
        step custom-generate 240 "model.generate(custom_generate=export), static cache included" "$PY" scripts/check_custom_generate.py \
            --export "$WD/export" --model "$WD/pretrain" --device "$DEVICE"
    fi
    WD2=$SCRATCH/m2
    mkdir -p "$WD2"
    cp -a "$WORKDIR/pretrain" "$WD/distill" "$WD2/" 2>/dev/null
    step train-medusa2-lora 150 "Medusa-2 with LoRA, 20 steps" "${CLI[@]}" stage=train "workdir=$WD2" \
        training=medusa2 training.backbone_tuning=lora training.lora_r=8 "training.init_heads=$WD/heads" training.max_steps=20 training.max_minutes=2 tree.max_nodes=16
    WD3=$SCRATCH/zero2
    mkdir -p "$WD3"
    cp -a "$WORKDIR/pretrain" "$WD/distill" "$WD3/" 2>/dev/null
    step train-zero2 180 "Medusa-1 under DeepSpeed ZeRO-2, one process" "${CLI[@]}" stage=train "workdir=$WD3" \
        deepspeed=zero2 training.max_steps=20 training.max_minutes=2 tree.max_nodes=16
else
    skip stages "no demo workdir at $WORKDIR (make gpu-demo)"
fi

# 7. The eager decoder on the 8B shape: the N-tree-tokens table, then a Medusa step with each tree
#    attention at context 2048 (merged into one bench_decode.json: the device returns at most 8 files).
if [ $QUICK = 1 ]; then
    step bench-decode 180 "random tiny model (dry run)" "$PY" scripts/bench_decode.py --random --device cpu \
        --num-prompts 2 --max-new-tokens 16 --repeats 1 --contexts 32 --json "$OUTDIR/bench_decode.json"
else
    step bench-decode 150 "Llama-3-8B shape, bf16, random weights" "$PY" scripts/bench_decode.py --llama8b-shape \
        --device cuda --dtype bfloat16 --contexts 512 2048 --repeats 3 --json "$SCRATCH/decode_table.json"
    # The three tree attentions in one process, timed in turn over 5 rounds (separate processes moved
    # by more than their differences on one H100).
    step bench-decode-attention 180 "8B shape, context 2048, sdpa / triton / cuda in rounds" "$PY" \
        scripts/bench_decode.py --llama8b-shape --device cuda --dtype bfloat16 --contexts 2048 --skip-overhead \
        --attention sdpa triton cuda --repeats 5 --json "$SCRATCH/decode_attention.json"
    merge_json decode "$OUTDIR/bench_decode.json"
fi
{
    echo
    echo "Environment:"
    cat "$OUTDIR/environment.txt" 2>/dev/null
    echo
    echo "GPU test figures (bf16/fp16 parity, tree vs sequential error): gpu_tests.jsonl; eval: eval_report.md;"
    echo "benchmarks: bench_*.json; every step's output: log.txt."
    if [ -f "$OUTDIR/eval_report.md" ]; then
        echo
        sed -n '1,40p' "$OUTDIR/eval_report.md"
    fi
} >>"$SUMMARY"
rm -f "$OUTDIR/environment.txt"
cat "$SUMMARY"
