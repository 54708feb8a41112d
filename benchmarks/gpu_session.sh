#!/usr/bin/env bash
# Every GPU figure the project still needs, as one prepared run for a lent GPU machine.
#
#   bash benchmarks/gpu_session.sh [checks] [mfu] [stream] [sinks]     (default: all four)
#
# Run from the repository root on a machine with CUDA, torch, lightning, transformers and
# tokenizers (the lent H200's image); the project itself is installed with --no-deps.
#   checks  benchmarks/gpu_check.py: bf16 and fused-kernel paths against fp32 eager
#   mfu     benchmarks/train_throughput.py: Pythia-160M, seq 2048, bf16, tokens/s and MFU,
#           eager and compiled, for vanilla / zero_sink / sink_token
#   stream  benchmarks/stream_eval.py: the fast streaming evaluator on Pythia-160M, 4+1020
#   sinks   how fast sinks form with GPU-sized budgets: configs/experiments/tiny-{vanilla,
#           sink_token}.yaml trained for SINK_SECONDS each at a GPU micro-batch, the sink
#           probe every 100 steps, then `sinklm compare` on BOOK. Needs the packed corpus
#           (packed/english_pd_mix-bpe4k, carried) and BOOK (a text file, carried).
#
# Each part writes its log (and the sinks part its report) under OUT (default gpu-results)
# and is cut at its own time limit, so one slow part cannot take the others' time.
# ACCEL=cpu with small SINK_STEPS runs the sinks part on a CPU as a smoke test.
set -uo pipefail

OUT=${OUT:-gpu-results}
ACCEL=${ACCEL:-gpu}
BOOK=${BOOK:-../shared/data/books/a_tale_of_two_cities_dickens_pg98.txt}
SINK_SECONDS=${SINK_SECONDS:-120}
SINK_STEPS=${SINK_STEPS:-100000}
SINK_BATCH=${SINK_BATCH:-64}
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(checks mfu stream sinks)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline

if ! python -c "import sinklm" 2>/dev/null; then
    python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
        { echo "install failed: see $OUT/install.log"; exit 1; }
fi
{ nvidia-smi 2>/dev/null || echo "no nvidia-smi"; python -c "import torch; print(torch.__version__)"; } \
    >"$OUT/machine.txt"

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

sinks() {
    local variant runs=()
    for variant in vanilla sink_token; do
        part "sinks-$variant" $((SINK_SECONDS + 90)) sinklm fit \
            --config "configs/experiments/tiny-$variant.yaml" \
            --trainer.accelerator "$ACCEL" --trainer.max_steps "$SINK_STEPS" \
            --trainer.max_time "00:00:00:$SINK_SECONDS" \
            --trainer.precision "$([ "$ACCEL" = gpu ] && echo bf16-mixed || echo 32-true)" \
            --trainer.default_root_dir "$OUT/sinks/$variant" \
            --trainer.logger.init_args.save_dir "$OUT/sinks/$variant" \
            --data.micro_batch_size "$SINK_BATCH" --sink_probe.every_n_steps 100 \
            --checkpoint.every_n_train_steps 1000000
        runs+=("$OUT/sinks/$variant/checkpoints/last.ckpt")
    done
    # No dense column: past the trained 512 positions it measures extrapolation, at O(n^2).
    part sinks-compare 300 sinklm compare "${runs[@]}" --text "$BOOK" --max-tokens 32768 \
        --cache 0+256,1+255,2+254,4+252 --output "$OUT/sinks/report" --overwrite \
        --device "$([ "$ACCEL" = gpu ] && echo cuda || echo cpu)"
}

for name in "${PARTS[@]}"; do
    case $name in
        checks) part checks 180 python benchmarks/gpu_check.py ;;
        mfu)
            part mfu-eager 240 python benchmarks/train_throughput.py --gpu-only --steps 25 \
                --gpu-variants vanilla,zero_sink,sink_token
            part mfu-compiled 300 python benchmarks/train_throughput.py --gpu-only --steps 25 \
                --gpu-variants vanilla,zero_sink,sink_token --gpu-compile ;;
        stream)
            part stream 180 python benchmarks/stream_eval.py --preset pythia-160m \
                --cache 4+1020 --tokens 200000 --reference-tokens 2000 --rounds 1 ;;
        sinks) sinks ;;
        *) echo "unknown part '$name': choose from checks mfu stream sinks"; exit 2 ;;
    esac
done
