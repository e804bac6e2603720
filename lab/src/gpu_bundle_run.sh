#!/usr/bin/env bash
# headroom's GPU proof, for a machine with an NVIDIA driver, python3 and
# PyTorch but no Rust toolchain (made by `cargo lab gpu-bundle`).
#
#   bash run.sh [GROUP or STEP ...]    (default: every step)
#
# GROUPs: tests, train, oom, resume, small, bench, sanitize, profile; a STEP by its name (train,
# bench, oom-driver, bench-tiny-gpt, ...; the list is in summary.txt). A
# name that is both (train, bench) means the whole group: a call that meant
# the one step ran every bench step, and ran out of time. `=NAME` names
# the step alone (`=train`, `=bench`), never a group.
#
# A lent GPU gives a session 15 to 30 minutes in all (the device tool's
# status says how many are left), its start included, and a command 10:
# one call of `bash run.sh` must say as much as it can. So the
# steps run in order of what the GPU issue needs most (the CUDA tests, the
# default job, the training step beside PyTorch, OOM, bit-exact resume, the
# whole PyTorch job, then the variants and the other trainers), whatever
# order they are named in, and none starts once fewer than MIN_STEP seconds
# (30) are left of DEADLINE (570 s from the start of the script): those are
# recorded as "out of time", and a later call names them. Each step also
# stops at STEP_TIMEOUT seconds (240; TEST_TIMEOUT, 120, for each test
# binary), so a hang costs one step, not the call.
#
# Everything goes into WORK ($BUNDLE/work): each step's output in
# WORK/<step>.log, run directories, the kernel cache. After every step
# report.json, summary.txt and logs.tar.gz (every log, metrics.jsonl and
# bench JSON; no checkpoints) are written into OUT ($BUNDLE/out), three
# files: the device tool brings back at most 8 files of $OUT, so a call
# cut short still brings back what passed, with the figures. A step that
# needs PyTorch with CUDA is recorded as skipped where it has none.
# Fashion-MNIST comes from ./data (if the bundle carries it) or
# $FASHION_MNIST_DIR.
#
# To shrink every job, `cargo lab gpu-bundle --dry-run` runs this script on
# the CPU emulator of the driver with: EXPERIMENT (the config every new job
# starts from; experiments/fashion_mnist.toml), HEADROOM_SETS (`--set K=V`
# overrides added last to every new job), OOM_BUDGET (the oom-budget step's
# device.memory_limit; 40MiB), BENCH_ARGS (`--steps 50`), MODEL_BENCH_ARGS
# (the other trainers' bench steps; `--batch 32 --steps 50`), and GPT_SETS
# and FRAMES_SETS (overrides after HEADROOM_SETS for the text and frame
# models' jobs: the train-gpt, train-frames and small-gpu steps' and their
# bench steps').
set -u
cd "$(dirname "$0")"
BUNDLE=$PWD
OUT=${OUT:-$BUNDLE/out}
WORK=${WORK:-$BUNDLE/work}
mkdir -p "$OUT" "$WORK"
if [ -z "${FASHION_MNIST_DIR:-}" ] && [ -f data/train-images-idx3-ubyte.gz ]; then
    export FASHION_MNIST_DIR=$BUNDLE/data
fi
export HEADROOM_KERNEL_CACHE=${HEADROOM_KERNEL_CACHE:-$WORK/kernel-cache}
# The test binaries read experiments/*.toml: the bundle's copy, not the
# build machine's workspace (which is not on this machine).
export HEADROOM_EXPERIMENTS=$BUNDLE/experiments
export HEADROOM_REQUIRE_GPU=1
# The programs travel gzipped (a third of their size): unpacked into WORK.
mkdir -p "$WORK/bin/tests"
for packed in bin/xtask.gz bin/tests/*.gz; do
    gunzip -c "$packed" > "$WORK/${packed%.gz}" && chmod +x "$WORK/${packed%.gz}" \
        || { echo "could not unpack $packed into $WORK"; exit 1; }
done
export WORK BUNDLE XTASK=$WORK/bin/xtask HEADROOM_SETS=${HEADROOM_SETS:-}
export EXPERIMENT=${EXPERIMENT:-experiments/fashion_mnist.toml}
OOM_BUDGET=${OOM_BUDGET:-40MiB}
read -r -a BENCH_ARGS <<< "${BENCH_ARGS:---steps 50}"
export MODEL_BENCH_ARGS=${MODEL_BENCH_ARGS:---batch 32 --steps 50}
DEADLINE=${DEADLINE:-570}
MIN_STEP=${MIN_STEP:-30}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
STEPS=" ${*:-all} "
RESULTS=$WORK/results.tsv
: > "$RESULTS"

# hr COMMAND ARGS...: the bundle's `xtask COMMAND` on EXPERIMENT with ARGS,
# then the HEADROOM_SETS overrides.
hr() {
    local extra command=$1; shift
    read -r -a extra <<< "$HEADROOM_SETS"
    "$XTASK" "$command" --config "$EXPERIMENT" "$@" ${extra[@]+"${extra[@]}"}
}

# torch_cuda: whether python3 has PyTorch with a usable GPU (asked once:
# importing torch takes seconds).
if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    export TORCH_CUDA=1
else
    export TORCH_CUDA=0
fi
torch_cuda() { [ "$TORCH_CUDA" = 1 ]; }

# step GROUP NAME COMMAND...: if GROUP or NAME was asked for, runs COMMAND
# (a program or one of the functions here) with its output in
# $WORK/NAME.log and records "NAME<TAB>exit<TAB>seconds" (exit 124: it ran
# past its time); "out of time" instead when too little of DEADLINE is left.
step() {
    local group=$1 name=$2; shift 2
    wants "$group" "$name" || return 0
    local left=$((DEADLINE - SECONDS)) limit=$STEP_TIMEOUT
    [ "$group" = tests ] && limit=$TEST_TIMEOUT
    if [ "$left" -lt "$MIN_STEP" ]; then
        skip "$name" "out of time ($left s of DEADLINE=$DEADLINE left)"
        return 0
    fi
    [ "$limit" -le "$((left - 10))" ] || limit=$((left - 10))
    local started=$SECONDS
    echo "== $name (at most $limit s): $*"
    # timeout runs the step in a process group of its own (its pid). Its
    # TERM at the limit stops the step's shell, and timeout then exits
    # without the KILL, while a job the shell started may still be
    # stopping or hung, holding the GPU through the next steps: whatever
    # of the group outlives the step is killed.
    timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" > "$WORK/$name.log" 2>&1 &
    local pgid=$!
    wait "$pgid"
    local rc=$?
    kill -KILL -- "-$pgid" 2>/dev/null
    record "$name" "$rc" "$((SECONDS - started))"
    echo "   exit $rc after $((SECONDS - started)) s"
}

# skip NAME WHY: records NAME as not run.
skip() {
    echo "== $1: skipped, $2"
    echo "skipped: $2" > "$WORK/$1.log"
    record "$1" skip 0
}

# torch_step GROUP NAME COMMAND...: step, where python3 has PyTorch with
# CUDA; else recorded as skipped.
torch_step() {
    wants "$1" "$2" || return 0
    if torch_cuda; then step "$@"; else skip "$2" "python3 has no PyTorch with CUDA"; fi
}

record() {
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$RESULTS"
    write_report > /dev/null
    publish
}

# publish: the report, the summary and every log into OUT, three files,
# each replaced whole (written beside, then moved).
publish() {
    [ -f "$WORK/report.json" ] && cp "$WORK/report.json" "$OUT/report.json.part" \
        && mv "$OUT/report.json.part" "$OUT/report.json"
    [ -f "$WORK/summary.txt" ] && cp "$WORK/summary.txt" "$OUT/summary.txt.part" \
        && mv "$OUT/summary.txt.part" "$OUT/summary.txt"
    (cd "$WORK" && find . -maxdepth 3 -type f \( -name '*.log' -o -name '*.tsv' -o -name '*.txt' \
        -o -name '*.json' -o -name '*.jsonl' -o -name '*.toml' \) -print0 \
        | tar czf "$OUT/logs.tar.gz.part" --null -T -) \
        && mv "$OUT/logs.tar.gz.part" "$OUT/logs.tar.gz"
}

# wants GROUP NAME: whether the command line named GROUP, NAME or =NAME (or none).
wants() { case "$STEPS" in *" all "* | *" $1 "* | *" $2 "* | *" =$2 "*) return 0 ;; esac; return 1; }

# train_on_auto: device.kind = "auto" must pick the GPU and train the
# default job (5 epochs) as device.kind = "cuda" does.
train_on_auto() {
    hr train --no-install --set device.kind=auto \
        --set "run.output_dir=$WORK/default-auto" || return 1
    grep -q "device: cuda" "$WORK/train-auto.log" \
        || { echo "device.kind=auto did not train on the GPU"; return 1; }
}

# train_mlp: the SiLU MLP experiment (flatten, linear, SiLU and its
# low-memory profile on the GPU), one epoch, then the same on the CPU: the
# two must reach the same accuracy within noise.
train_mlp() {
    EXPERIMENT=experiments/mlp_silu.toml hr train --no-install --set device.kind=cuda \
        --set train.epochs=1 --set "run.output_dir=$WORK/mlp-silu" || return 1
    EXPERIMENT=experiments/mlp_silu.toml hr train --no-install --set device.kind=cpu \
        --set train.epochs=1 --set "run.output_dir=$WORK/mlp-silu-cpu"
}

# train_gpt: token models on the GPU. tiny_gpt for one epoch on the
# licence texts lora_finetune reads (/usr/share/common-licenses, in Debian's
# and Ubuntu's essential base-files), then LoRA fine-tuning of that base
# (batch 1 x accumulation 8, blocks recomputed), then the full fine-tune
# of it, for their tensor peaks on the device.
train_gpt() {
    python3 - "$WORK" <<'EOF' || return 1
import re, sys
out = sys.argv[1]
corpus = re.compile(r"^package = .*?^\]\n", re.S | re.M)
gpt = open("experiments/tiny_gpt.toml").read()
lora = open("experiments/lora_finetune.toml").read()
gpt = corpus.sub(lambda _: corpus.search(lora).group(0), gpt)
open(out + "/gpt_licences.toml", "w").write(gpt)
lora = re.sub(r"^base = .*$", 'base = "%s/gpt-base"' % out, lora, flags=re.M)
open(out + "/lora_gpu.toml", "w").write(lora)
EOF
    local HEADROOM_SETS="$HEADROOM_SETS ${GPT_SETS:-}"
    EXPERIMENT=$WORK/gpt_licences.toml hr train --no-install --set device.kind=cuda \
        --set train.epochs=1 --set "run.output_dir=$WORK/gpt-base" || return 1
    EXPERIMENT=$WORK/lora_gpu.toml hr train --no-install --set device.kind=cuda \
        --set "run.output_dir=$WORK/lora" || return 1
    EXPERIMENT=$WORK/lora_gpu.toml hr train --no-install --set device.kind=cuda \
        --set finetune.train=full --set "run.output_dir=$WORK/lora-full"
}

# train_frames: the UNet-ConvLSTM frame model (experiments/conv_lstm.toml)
# for one epoch on the GPU.
train_frames() {
    local HEADROOM_SETS="$HEADROOM_SETS ${FRAMES_SETS:-}"
    EXPERIMENT=experiments/conv_lstm.toml hr train --no-install --set device.kind=cuda \
        --set train.epochs=1 --set "run.output_dir=$WORK/frames"
}

# bench_model NAME [ARGS...]: experiments/NAME.toml's training step on the GPU,
# beside PyTorch's (bench/torch/torch_models.py builds the same model: SDPA
# attention, cuDNN's LSTM, a step-by-step ConvLSTM) when it has CUDA, then
# layer by layer (conv_lstm's step was 0.90x PyTorch's on an H100).
bench_model() {
    local args frames
    read -r -a args <<< "$MODEL_BENCH_ARGS"
    case $1 in
        conv_lstm) read -r -a frames <<< "${FRAMES_SETS:-}" ;;
        char_lm | tiny_gpt | lora*) read -r -a frames <<< "${GPT_SETS:-}" ;;
        *) frames=() ;;
    esac
    args+=("${frames[@]}")
    if torch_cuda; then args+=(--compare-torch); fi
    EXPERIMENT=experiments/$1.toml hr bench --device cuda --profile "${args[@]}" "${@:2}" \
        --json-out "$WORK/bench-$1${2:+-variant}.json"
}

# bench_baseline: the bench step's command (graphs, no PyTorch) with the
# earlier build in bin/baseline-xtask.gz, its convolutions as this build's
# default has them (device.conv_algorithm=auto, which that build had, but
# not as its default).
# Its arguments: BENCH_ARGS (an array does not reach a step's shell).
bench_baseline() {
    gunzip -c "$BUNDLE/bin/baseline-xtask.gz" > "$WORK/bin/baseline-xtask" \
        && chmod +x "$WORK/bin/baseline-xtask" || return 1
    XTASK=$WORK/bin/baseline-xtask hr bench --device cuda "$@" --set device.conv_algorithm=auto
}

# hog_and_train: another process holds all but HOG_LEAVES_MIB of the GPU;
# a job that needs far more (batch 4096), with a budget that does not bind,
# must meet the driver's own out-of-memory and adapt, never crash or hang.
hog_and_train() {
    start_hog "${HOG_LEAVES_MIB:-768}" "$WORK/hog.log" || return 1
    hr train --no-install --set device.kind=cuda --set device.memory_limit=64GiB \
        --set train.batch_size=4096 --set train.epochs=1 --set data.train_samples=16384 \
        --set "run.output_dir=$WORK/oom-driver"
    local rc=$?
    stop_hog
    return $rc
}

# start_hog LEAVE_MIB LOG: another process (PyTorch) holds all but
# LEAVE_MIB of the GPU until stop_hog (its pid in HOG_PID), its line in LOG;
# fails, saying why, if it is not holding within 90 s.
start_hog() {
    HOG_LEAVES_MIB=$1 python3 - > "$2" 2>&1 <<'PY' &
import os, time, torch
free, _ = torch.cuda.mem_get_info()
leave = int(os.environ["HOG_LEAVES_MIB"]) << 20
hold = torch.empty(max(free - leave, 0), dtype=torch.uint8, device="cuda")
free_now, total = torch.cuda.mem_get_info()
print("holding", hold.numel() >> 20, "MiB;", free_now >> 20, "MiB of", total >> 20, "MiB free", flush=True)
time.sleep(900)
PY
    HOG_PID=$!
    local waited=0
    until grep -q holding "$2" 2>/dev/null; do
        sleep 1; waited=$((waited + 1))
        if [ $waited -ge 90 ] || ! kill -0 "$HOG_PID" 2>/dev/null; then
            echo "the memory hog did not start:"; cat "$2"; kill "$HOG_PID" 2>/dev/null; return 1
        fi
    done
    cat "$2"
}

stop_hog() { kill "$HOG_PID" 2>/dev/null; wait "$HOG_PID" 2>/dev/null; }

# small_gpu LEAVE_MIB: every trainer in experiments/ for one epoch on the
# GPU under the automatic profile (run.profile = "auto", device.memory_limit
# unset), while another process (PyTorch) holds all but LEAVE_MIB of it, as
# on a 4 or 2 GiB laptop card; LEAVE_MIB = all: nothing held, the reference.
# Each run must finish (no crash, no hang); the table at the end gives each
# one's profile, micro-batch, OOM events, tensor peak and wall time.
# char_lm, tiny_gpt and its LoRA and full fine-tunes read the licence texts
# of base-files (fortunes-min is not on the GPU machine).
small_gpu() {
    local leave=$1 failed=0 dir=$WORK/small-gpu-$1
    mkdir -p "$dir"
    python3 - "$dir" <<'PY' || return 1
import re, sys
out = sys.argv[1]
corpus = re.compile(r"^package = .*?^\]\n", re.S | re.M)
lora = open("experiments/lora_finetune.toml").read()
licences = corpus.search(lora).group(0)
for name in ("tiny_gpt", "char_lm"):
    text = corpus.sub(lambda _: licences, open("experiments/%s.toml" % name).read())
    open("%s/%s.toml" % (out, name), "w").write(text)
lora = re.sub(r"^base = .*$", 'base = "%s/tiny_gpt"' % out, lora, flags=re.M)
open(out + "/lora_finetune.toml", "w").write(lora)
PY
    if [ "$leave" != all ]; then
        start_hog "$leave" "$dir/hog.log" || return 1
    fi
    local name config extra started rc sets
    while read -r name config extra; do
        started=$SECONDS
        case $name in
            conv_lstm) sets=${FRAMES_SETS:-} ;;
            char_lm | tiny_gpt | lora*) sets=${GPT_SETS:-} ;;
            *) sets= ;;
        esac
        # shellcheck disable=SC2086
        HEADROOM_SETS="$HEADROOM_SETS $sets" EXPERIMENT=$config hr train --no-install \
            --set device.kind=cuda --set run.profile=auto --set train.epochs=1 \
            --set "run.output_dir=$dir/$name" $extra > "$dir/$name.log" 2>&1
        rc=$?
        echo "$name: exit $rc after $((SECONDS - started)) s"
        [ $rc -eq 0 ] || { failed=1; tail -n 5 "$dir/$name.log"; }
    done <<LIST
default $EXPERIMENT
mlp_silu experiments/mlp_silu.toml
conv_lstm experiments/conv_lstm.toml
char_lm $dir/char_lm.toml
tiny_gpt $dir/tiny_gpt.toml
lora $dir/lora_finetune.toml
lora_full $dir/lora_finetune.toml --set finetune.train=full
LIST
    [ "$leave" = all ] || stop_hog
    python3 - "$dir" "$leave" <<'PY'
import re, sys, os
out, leave = sys.argv[1], sys.argv[2]
print("\nnothing held:" if leave == "all" else "\nall but %s MiB held by another process:" % leave)
print("%-10s %-9s %-6s %-9s %-7s %-11s %-8s %s" % (
    "trainer", "profile", "micro", "refusals", "splits", "peak", "wall", "result"))
for name in ("default", "mlp_silu", "conv_lstm", "char_lm", "tiny_gpt", "lora", "lora_full"):
    try:
        log = open(os.path.join(out, name + ".log"), errors="replace").read()
    except OSError:
        continue
    peak = re.findall(r"tensor memory\s+peak ([0-9.]+ \w+)", log)
    micro = re.findall(r"micro-batch ([0-9]+)", log)
    wall = re.findall(r"wall time\s+([0-9.]+ s)", log)
    result = re.findall(r"^(test accuracy|test loss|validation loss)\s+(\S+)", log, re.M)
    print("%-10s %-9s %-6s %-9d %-7d %-11s %-8s %s" % (
        name, "low_mem" if "applying the low_memory profile" in log else "default",
        micro[-1] if micro else "-",
        len(re.findall(r"\(over the [^)]* budget\)|device itself had no room", log)),
        len(re.findall(r"splitting the batch", log)),
        peak[-1] if peak else "-", wall[-1] if wall else "-",
        " ".join(result[0]) if result else "no result"))
PY
    return $failed
}

# SANITIZER: CUDA's compute-sanitizer, where the machine has it (or as set).
SANITIZER=${SANITIZER-$(command -v compute-sanitizer \
    || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)}
export SANITIZER

# sanitize_step TOOL: the kernel parity tests under compute-sanitizer's
# TOOL, which sees what the emulator cannot: memcheck, an access outside
# a device allocation or misaligned on the GPU itself; racecheck, two
# threads of a block at one shared-memory word between barriers (the
# emulator runs them in one order and shows no race); synccheck, a barrier
# that not every thread of a block reaches.
sanitize_step() {
    local tool=$1 name=sanitize-$1
    wants sanitize "$name" || return 0
    if [ -z "$SANITIZER" ]; then
        skip "$name" "compute-sanitizer not found"
        return 0
    fi
    if [ "$tool" = racecheck ]; then
        step sanitize "$name" racecheck_ours
        return 0
    fi
    step sanitize "$name" "$SANITIZER" --tool "$tool" --error-exitcode 86 --print-limit 20 \
        "$WORK/bin/tests/cuda_parity" --test-threads=1
}

# racecheck_ours: cuda_parity under racecheck, failing on a hazard in one
# of our kernels. On an H100 racecheck reports hazards inside cuBLAS's own
# GEMM kernels (nvjet_*), which are not ours to fix, and leaving them out
# (--kernel-name-exclude) makes the sanitizer itself fail ("failed to
# handle a hardware exception"): so every hazard is printed and judged by
# the kernels it names.
racecheck_ours() {
    local log=$WORK/racecheck-raw.log ours
    "$SANITIZER" --tool racecheck --print-limit 10000 "$WORK/bin/tests/cuda_parity" \
        --test-threads=1 > "$log" 2>&1
    local rc=$?
    cat "$log"
    [ "$rc" = 0 ] && grep -q '^test result: ok' "$log" && grep -q 'RACECHECK SUMMARY' "$log" \
        || { echo "racecheck: the tests did not pass under it (exit $rc)"; return 1; }
    ours=$(hazard_kernels "$log" | grep -vE "$CUBLAS_KERNELS" | sort -u)
    echo "racecheck: $(hazard_kernels "$log" | grep -cE "$CUBLAS_KERNELS") hazard reports in cuBLAS's kernels"
    if [ -n "$ours" ]; then
        echo "racecheck: hazards in our kernels: $(echo $ours)"
        return 86
    fi
    echo "racecheck: no hazard in our kernels"
}

# hazard_kernels LOG: the kernel of each access racecheck reported, a line
# each ("Read access at KERNEL+0xb20 ... and Write access at KERNEL+0x30c0").
hazard_kernels() {
    grep -oE '(Read|Write) access at [A-Za-z_][A-Za-z0-9_]*' "$1" | awk '{print $4}'
}
# Kernel names of cuBLAS and the libraries it calls.
CUBLAS_KERNELS='^(nvjet_|cutlass|sm[0-9]+_xmma|gemm|gemv|cublas|splitKreduce)'

# kernel_profile: one training step of the default model at batch 512,
# eager, each convolution by its shape (device.conv_algorithm=auto, the
# default: the implicit, narrow and im2col + cuBLAS kernels), under Nsight
# Compute: every kernel's duration and how near it ran to the memory and
# compute roofs, summed by kernel name, longest first. The layer-by-layer
# profile says which layer costs; this says which kernel and why.
kernel_profile() {
    local csv=$WORK/ncu.csv
    "$NCU" --csv --page raw --launch-count 2000 --metrics "$NCU_METRICS" \
        "$XTASK" bench-step --config "$EXPERIMENT" --batch 512 --threads 1 --warmup 1 --steps 1 \
        --set device.kind=cuda --set device.graphs=false \
        > "$csv" 2> "$WORK/ncu.err"
    local rc=$?
    tail -n 5 "$WORK/ncu.err"
    [ "$rc" = 0 ] || { echo "ncu exited with $rc"; return 1; }
    python3 - "$csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if len(rows) < 3:
    sys.exit("ncu printed no kernel rows")
head, units, data = rows[0], rows[1], rows[2:]
col = {name: i for i, name in enumerate(head)}
def num(r, name):
    try:
        return float(r[col[name]].replace(",", ""))
    except (KeyError, ValueError):
        return 0.0
by = {}
for r in data:
    k = by.setdefault(r[col["Kernel Name"]], [0, 0.0, 0.0, 0.0])
    unit = units[col["gpu__time_duration.sum"]]
    ns = num(r, "gpu__time_duration.sum") * {"usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit, 1.0)
    k[0] += 1
    k[1] += ns
    k[2] += ns * num(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed")
    k[3] += ns * num(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed")
total = sum(k[1] for k in by.values())
print(f"ncu kernels: {len(data)} launches over the warm-up and one timed step, {total / 1e6:.3f} ms on the GPU")
print(f"{'ms':>8} {'share':>6} {'runs':>5} {'dram%':>6} {'sm%':>5}  kernel (time-weighted % of peak)")
for name, (runs, ns, dram, sm) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"{ns / 1e6:8.3f} {100 * ns / total:5.1f}% {runs:5d} {dram / ns if ns else 0:6.1f} {sm / ns if ns else 0:5.1f}  {name[:90]}")
PY
}
NCU=${NCU-$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)}
NCU_METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
export NCU NCU_METRICS

# rerun_failed BINARY LOG: each test that BINARY's run in LOG failed, again
# in a process of its own. A kernel fault leaves a sticky CUDA error that
# fails every later test of its process: this tells the test that faulted
# from those that failed after it.
rerun_failed() {
    local binary=$1 log=$2 name failed=0
    # libtest's last "failures:" section lists the failed tests, indented.
    for name in $(awk '/^failures:$/ { list = ""; on = 1; next }
                       on && /^    [A-Za-z_][A-Za-z0-9_:]*$/ { list = list " " $1; next }
                       on && /^$/ { on = 0 }
                       END { print list }' "$log"); do
        if timeout -k 5 60 "$binary" --exact "$name" --test-threads=1 --nocapture > "$log.one" 2>&1; then
            echo "ok alone:     $name"
        else
            echo "FAILED alone: $name"; failed=1
            { grep -m 1 -A 8 "panicked at" "$log.one" || tail -n 20 "$log.one"; } | sed 's/^/    /'
        fi
    done
    rm -f "$log.one"
    return $failed
}

# step_reached LOG: the run's global step by its last progress line in LOG
# ("epoch E/EE step B/BPE"), then its batches per epoch; "0 0" before one.
step_reached() {
    local line e b n
    line=$(grep -oE 'epoch [0-9]+/[0-9]+ step [0-9]+/[0-9]+' "$1" 2>/dev/null | tail -n 1)
    read -r e b n <<< "$(echo "$line" | sed -E 's#epoch ([0-9]+)/[0-9]+ step ([0-9]+)/([0-9]+)#\1 \2 \3#')"
    if [ -n "$n" ]; then echo "$(((e - 1) * n + b)) $n"; else echo "0 0"; fi
}

# kill_at PID LOG N: SIGKILL PID a random few milliseconds after its LOG
# shows step N; fails if PID ends first (then nothing was interrupted).
kill_at() {
    local pid=$1 log=$2 n=$3 reached
    while kill -0 "$pid" 2>/dev/null; do
        read -r reached _ <<< "$(step_reached "$log")"
        if [ "$reached" -ge "$n" ]; then
            sleep "0.0$((RANDOM % 50))"
            kill -9 "$pid"; wait "$pid" 2>/dev/null
            echo "== SIGKILL at step $(step_reached "$log" | cut -d' ' -f1) (aimed at $n)"
            return 0
        fi
        sleep 0.01
    done
    wait "$pid"
    echo "the run ended before step $n: nothing was interrupted"
    return 1
}

RESUME_EPOCHS=2
# Every step logged, so that kill_at sees each one.
RESUME_JOB="--no-install --set device.kind=cuda --set train.epochs=$RESUME_EPOCHS \
    --set data.train_samples=30000 --set checkpoint.every_steps=20 --set run.log_every=1"

# resume_reference: the job uninterrupted.
resume_reference() {
    # shellcheck disable=SC2086
    hr train $RESUME_JOB --set "run.output_dir=$WORK/resume-a"
}

# resume_killed: the same job, SIGKILLed at a random step of its first half
# (before or after a checkpoint, maybe during one), resumed, killed again at
# a random later step, and resumed to the end. Each process's log is in
# $WORK/resume-b-N.log.
resume_killed() {
    local dir=$WORK/resume-b extra reached per_epoch total first second pid
    read -r -a extra <<< "$HEADROOM_SETS"
    # shellcheck disable=SC2086
    "$XTASK" train --config "$EXPERIMENT" $RESUME_JOB --set "run.output_dir=$dir" \
        ${extra[@]+"${extra[@]}"} > "$WORK/resume-b-1.log" 2>&1 &
    pid=$!
    per_epoch=0
    while [ "$per_epoch" -eq 0 ] && kill -0 "$pid" 2>/dev/null; do
        sleep 0.01
        read -r reached per_epoch <<< "$(step_reached "$WORK/resume-b-1.log")"
    done
    total=$((RESUME_EPOCHS * per_epoch))
    if [ "$total" -lt 4 ]; then
        kill -9 "$pid" 2>/dev/null; cat "$WORK/resume-b-1.log"
        echo "$total steps are too few to kill twice"; return 1
    fi
    first=$((2 + RANDOM % (total / 2 - 1)))
    second=$((first + 1 + RANDOM % (total - first - 1)))
    echo "$total steps; SIGKILL at step $first, then at step $second"
    kill_at "$pid" "$WORK/resume-b-1.log" "$first" || return 1
    "$XTASK" train --resume "$dir" > "$WORK/resume-b-2.log" 2>&1 &
    kill_at $! "$WORK/resume-b-2.log" "$second" || return 1
    "$XTASK" train --resume "$dir" > "$WORK/resume-b-3.log" 2>&1
    local rc=$?
    grep -h "resuming from" "$WORK"/resume-b-[23].log
    tail -n 15 "$WORK/resume-b-3.log"
    return $rc
}

# resume_compare A B: the step losses, gradient norms and epoch figures of
# the two runs' metrics, bit for bit.
resume_compare() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
def figures(path):
    steps, epochs = {}, []
    for line in open(path):
        record = json.loads(line)
        if record["kind"] == "step":
            data = record["data"]
            steps[data["step"]] = (data["loss"], data["grad_norm"])
        elif record["kind"] == "epoch":
            epochs.append((record["data"]["test_loss"], record["data"]["test_accuracy"]))
    return steps, epochs
a, b = figures(sys.argv[1]), figures(sys.argv[2])
print("steps", len(a[0]), len(b[0]), "epochs", a[1], b[1])
differ = [s for s in sorted(set(a[0]) | set(b[0])) if a[0].get(s) != b[0].get(s)]
if differ:
    print("steps that differ:", differ[:20], "..." if len(differ) > 20 else "")
sys.exit(0 if a == b and a[0] else 1)
EOF
}

# weights_equal A B: the two runs' final weights (their last checkpoints,
# exported as safetensors) hold the same tensors, bit for bit.
weights_equal() {
    local run last
    for run in "$1" "$2"; do
        last=$(ls "$run"/checkpoint-step*.ckpt 2>/dev/null | sort | tail -n 1)
        [ -n "$last" ] || { echo "no checkpoint in $run"; return 1; }
        "$XTASK" export --checkpoint "$last" --output "$run.safetensors" || return 1
    done
    python3 - "$1.safetensors" "$2.safetensors" <<'EOF'
import json, struct, sys
def tensors(path):
    raw = open(path, "rb").read()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    data = raw[8 + size:]
    return {name: (t["dtype"], t["shape"], data[t["data_offsets"][0]:t["data_offsets"][1]])
            for name, t in header.items()}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
differ = sorted(name for name in set(a) | set(b) if a.get(name) != b.get(name))
print(f"{len(a)} tensors; differ: {differ}" if differ else f"the final weights are identical ({len(a)} tensors)")
sys.exit(1 if differ or not a else 0)
EOF
}

write_report() {
    python3 - "$WORK" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def read(name):
    try:
        return open(os.path.join(out, name)).read()
    except OSError:
        return ""
steps = {}
for line in read("results.tsv").splitlines():
    name, rc, seconds = line.split("\t")
    steps[name] = {"step": name, "exit": rc if rc == "skip" else int(rc), "seconds": int(seconds)}
report = {"gpu": read("gpu.txt").strip(), "steps": list(steps.values())}
train = read("train.log")
found = re.findall(r"test accuracy\s+([0-9.]+)%", train)
if found:
    report["default_run"] = {
        "test_accuracy_percent": float(found[-1]),
        "summary": [l for l in train.splitlines() if re.match(r"^(test |epochs|wall|train speed|peak|tensor|loader)", l)],
    }
def wall(log):
    found = re.findall(r"wall time\s+([0-9.]+) s", log)
    return float(found[-1]) if found else None
report["whole_job_seconds"] = {
    "headroom": wall(train),
    "headroom_data_on_host": wall(read("train-host-data.log")),
    "headroom_implicit_gemm": wall(read("train-implicit-gemm.log")),
    "headroom_im2col": wall(read("train-im2col.log")),
}
for name in ("train-no-amp", "train-bf16", "train-auto", "train-implicit-gemm", "train-im2col"):
    found = re.findall(r"test accuracy\s+([0-9.]+)%", read(name + ".log"))
    if found:
        report[name + "_test_accuracy_percent"] = float(found[-1])
# train-mlp's log holds the GPU run's summary, then the CPU run's.
mlp_log = read("train-mlp.log")
mlp = dict(zip(("gpu", "cpu"), re.findall(r"test accuracy\s+([0-9.]+)%", mlp_log)))
mlp_wall = dict(zip(("gpu", "cpu"), re.findall(r"wall time\s+([0-9.]+) s", mlp_log)))
# train-gpt's log: tiny_gpt's summary, then LoRA's, then the full fine-tune's.
gpt_log = read("train-gpt.log")
gpt = [l for l in gpt_log.splitlines() if re.match(r"^(test |wall|train speed|peak|tensor)", l)]
if gpt:
    report["tiny_gpt_then_lora_then_full"] = gpt
frames = [l for l in read("train-frames.log").splitlines()
          if re.match(r"^(test |wall|train speed|peak|tensor|validation|baseline|copy)", l)]
if frames:
    report["conv_lstm_one_epoch"] = frames
if mlp:
    report["mlp_silu_one_epoch"] = {k: {"test_accuracy_percent": float(v), "wall_seconds": float(mlp_wall[k]) if k in mlp_wall else None} for k, v in mlp.items()}
torch_job = [l for l in read("torch-job.log").splitlines() if l.startswith("{")]
if torch_job:
    try:
        job = json.loads(torch_job[-1])
        report["torch_job"] = job
        report["whole_job_seconds"]["pytorch"] = job["wall_seconds"]
    except ValueError:
        report["torch_job"] = "unparsed; see torch-job.log"
for name in ("oom-budget", "oom-budget-reactive", "oom-driver"):
    log = read(name + ".log")
    auto = re.findall(r'micro_batch = "auto": ([0-9]+)', log)
    final = re.findall(r"; micro-batch ([0-9]+)", log)
    report[name] = {
        "auto_micro_batch": int(auto[-1]) if auto else None,
        "final_micro_batch": int(final[-1]) if final else None,
        "budget_refusals": len(re.findall(r"\(over the [^)]* budget\)", log)),
        "device_refusals": len(re.findall(r"device itself had no room", log)),
        "splits": len(re.findall(r"splitting the batch", log)),
        "cache_releases": len(re.findall(r"released .* of cached blocks", log)),
        "low_memory_profile": "applying the low_memory profile" in log,
        "graphs_turned_off": "CUDA graphs off" in log,
        "finished": "test accuracy" in log,
    }
report["resume"] = {
    "kills": read("resume-killed.log").count("== SIGKILL"),
    "resumed_from_a_checkpoint": read("resume-killed.log").count("resuming from"),
    "plan": [l for l in read("resume-killed.log").splitlines() if "SIGKILL at step" in l],
    "compare": read("resume-compare.log").strip().splitlines()[-3:],
    "weights": read("resume-weights.log").strip().splitlines()[-1:],
}
try:
    report["bench"] = json.load(open(os.path.join(out, "bench.json")))
except (OSError, ValueError):
    pass
json.dump(report, open(os.path.join(out, "report.json"), "w"), indent=2)
lines = [report["gpu"], ""]
def status(s):
    if s["exit"] == "skip":
        return read(s["step"] + ".log").strip() or "skipped"
    return "ok" if s["exit"] == 0 else "TIMED OUT" if s["exit"] == 124 else "FAILED (exit %d)" % s["exit"]
lines += [f'{s["step"]:<28} {s["seconds"]:>4} s  {status(s)}' for s in report["steps"]]
if "default_run" in report:
    lines += [""] + report["default_run"]["summary"]
jobs = report["whole_job_seconds"]
lines += ["", "whole default job, wall seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in jobs.items() if v is not None)]
if isinstance(report.get("torch_job"), dict):
    lines += [f'pytorch test accuracy {100 * report["torch_job"]["test_accuracy"]:.2f}%']
for name in ("train-no-amp", "train-bf16", "train-auto", "train-implicit-gemm", "train-im2col"):
    if name + "_test_accuracy_percent" in report:
        lines += [f"{name} test accuracy {report[name + '_test_accuracy_percent']:.2f}%"]
if "mlp_silu_one_epoch" in report:
    lines += ["mlp_silu, one epoch: " + json.dumps(report["mlp_silu_one_epoch"])]
if "conv_lstm_one_epoch" in report:
    lines += ["", "conv_lstm, one epoch on the GPU:"] + report["conv_lstm_one_epoch"]
if "tiny_gpt_then_lora_then_full" in report:
    lines += ["", "tiny_gpt (1 epoch), then LoRA, then the full fine-tune, on the GPU:"]
    lines += report["tiny_gpt_then_lora_then_full"]
for name in ("oom-budget", "oom-budget-reactive", "oom-driver"):
    if name in steps:
        lines += [f"{name}: {json.dumps(report[name])}"]
if "resume-killed" in steps:
    lines += ["resume: " + json.dumps(report["resume"])]
for tool in ("memcheck", "racecheck", "synccheck"):
    found = re.findall(r"ERROR SUMMARY: .*|^racecheck: .*", read("sanitize-" + tool + ".log"), re.M)
    for line in found[-3:] if tool == "racecheck" else found[-1:]:
        lines += [f"compute-sanitizer {tool}: {line}"]
if read("bench.log").strip():
    lines += ["", read("bench.log").strip()]
ncu = read("ncu-kernels.log")
if "ncu kernels:" in ncu:
    lines += ["", ncu[ncu.index("ncu kernels:"):].strip()]
for name, what in (("bench-no-graphs", "without CUDA graphs (device.graphs=false)"),
                   ("bench-keep-outputs", "keeping batch norm + ReLU and block outputs (device.recompute=false)"),
                   ("bench-bf16", "bf16 activations and compute weights (device.precision=bf16) against the bench step's f16"),
                   ("bench-workspace-64", "with a 64 MiB im2col workspace (device.conv_workspace=64MiB)"),
                   ("bench-workspace-4", "with a 4 MiB im2col workspace (device.conv_workspace=4MiB)"),
                   ("bench-torch-graphs", "beside PyTorch with CUDA graphs (torch.compile mode=\"reduce-overhead\")"),
                   ("bench-profile", "the default step layer by layer (--profile), without PyTorch"),
                   ("bench-implicit-gemm", "with the implicit-GEMM convolution kernel (device.conv_algorithm=implicit_gemm)"),
                   ("bench-im2col", "every convolution through im2col + cuBLAS (device.conv_algorithm=im2col)"),
                   ("bench-tune", "each convolution's products timed both ways on this GPU, the faster kept (device.conv_algorithm=tune)"),
                   ("bench-baseline", "the same step built from the bundle's bin/baseline-xtask.gz, an earlier build (the A of an A/B on this GPU)")):
    if read(name + ".log").strip():
        lines += ["", what + ":", read(name + ".log").strip()]
open(os.path.join(out, "summary.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

export -f start_hog stop_hog small_gpu hr torch_cuda rerun_failed kernel_profile racecheck_ours hazard_kernels train_on_auto train_mlp train_gpt train_frames bench_model bench_baseline hog_and_train step_reached kill_at \
    resume_reference resume_killed resume_compare weights_equal
export RESUME_EPOCHS RESUME_JOB

{
    nvidia-smi -L 2>&1 || echo "nvidia-smi failed"
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    "$XTASK" doctor 2>&1
} > "$WORK/gpu.txt"
echo "$(head -n 1 "$WORK/gpu.txt"); steps: $STEPS; DEADLINE=$DEADLINE s"

# 1. Correctness: every CUDA test binary, skipping turned into failure.
for t in "$WORK"/bin/tests/*; do
    # The implicit-GEMM kernels' tests (their first run on a GPU) go in a
    # process of their own: a fault there leaves a sticky CUDA error that
    # would fail every later test of the binary.
    step tests "test-$(basename "$t")" "$t" --test-threads=1 --nocapture --skip implicit
    if grep -q "^test result: FAILED" "$WORK/test-$(basename "$t").log" 2>/dev/null; then
        step tests "test-$(basename "$t")-alone" rerun_failed "$t" "$WORK/test-$(basename "$t").log"
    fi
    if "$t" --list 2>/dev/null | grep -q implicit; then
        step tests "test-$(basename "$t")-implicit" "$t" --test-threads=1 --nocapture implicit
    fi
done

# 2. The default experiment (5 epochs) on the GPU, its training set held
# there (data.on_device), batches made on the device.
step train train hr train --no-install --set device.kind=cuda --set "run.output_dir=$WORK/default"

# 3. The training step beside PyTorch (AMP, channels_last, fused AdamW,
# torch.compile) on this GPU, batch 128 and 512; then 10 more steps timed
# layer by layer (--profile), to say what holds a ratio back.
if torch_cuda; then
    step bench bench hr bench --device cuda --compare-torch --profile "${BENCH_ARGS[@]}" --json-out "$WORK/bench.json"
else
    step bench bench hr bench --device cuda --profile "${BENCH_ARGS[@]}" --json-out "$WORK/bench.json"
fi

# 4. A budget below what a batch-128 step needs: the run must adapt and
# finish. Under 4 GiB the low_memory profile applies (recompute, and the
# micro-batch found by a trial step). Then another process holds all but
# 768 MiB of the GPU and the driver itself must refuse, and be handled.
step oom oom-budget hr train --no-install --set device.kind=cuda \
    --set "device.memory_limit=$OOM_BUDGET" --set train.batch_size=128 --set train.epochs=1 \
    --set data.train_samples=8192 --set "run.output_dir=$WORK/oom-budget"
torch_step oom oom-driver hog_and_train

# 5. SIGKILL twice at random steps and resume: the step losses, the epoch
# figures and the final weights must equal an uninterrupted run's.
step resume resume-reference resume_reference
step resume resume-killed resume_killed
step resume resume-compare resume_compare "$WORK/resume-a/metrics.jsonl" "$WORK/resume-b/metrics.jsonl"
step resume resume-weights weights_equal "$WORK/resume-a" "$WORK/resume-b"

# 5b. A 4 and a 2 GiB GPU, made by another process holding the rest: every
# trainer under the automatic profile, beside the same runs with nothing held.
step small small-gpu-free small_gpu all
torch_step small small-gpu-4g small_gpu 4096
torch_step small small-gpu-2g small_gpu 2048
# The kernel report test again, the compiled-kernel cache now warm.
step tests test-cuda_ptx-warm "$WORK/bin/tests/cuda_ptx" --test-threads=1 --nocapture

# 6. The default job in PyTorch (AMP, channels_last, fused AdamW,
# torch.compile, DataLoader with 4 workers), for the whole-job wall time.
torch_step train torch-job python3 "$BUNDLE/bench/torch/torch_fashion_mnist.py" --device cuda \
    --data "${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"

# 6b. The training step beside PyTorch given CUDA graphs too
# (torch.compile mode="reduce-overhead"), as headroom's step replays one.
torch_step bench bench-torch-graphs hr bench --device cuda --compare-torch \
    --torch-compile-mode reduce-overhead "${BENCH_ARGS[@]}" --json-out "$WORK/bench-torch-graphs.json"

# 7. Variants of the default job: device.kind = "auto" must pick the GPU;
# f32 (--no-amp) must learn as mixed precision does; batches staged from
# the host give the same bits, and the wall time shows what residency is
# worth; without the low_memory profile (run.profile=none) the step itself
# runs out of the budget and the batch is split.
step train train-auto train_on_auto
step train train-no-amp hr train --no-install --set device.kind=cuda --no-amp \
    --set train.epochs=1 --set "run.output_dir=$WORK/default-no-amp"
# bf16 (device.precision = "bf16": bf16 activations, f32 masters, no loss
# scaling) must learn as f16 does; bench-bf16 (below) times its step.
step train train-bf16 hr train --no-install --set device.kind=cuda --set device.precision=bf16 \
    --set train.epochs=1 --set "run.output_dir=$WORK/default-bf16"
step train train-host-data hr train --no-install --set device.kind=cuda \
    --set data.on_device=false --set "run.output_dir=$WORK/default-host-data"
step oom oom-budget-reactive hr train --no-install --set device.kind=cuda --set run.profile=none \
    --set "device.memory_limit=$OOM_BUDGET" --set train.batch_size=128 --set train.epochs=1 \
    --set data.train_samples=8192 --set "run.output_dir=$WORK/oom-budget-reactive"

# 8. What the step's choices cost or give: CUDA graphs off, outputs kept
# instead of recomputed, bf16 storage, and our tensor-core convolution (conv_mma.cu)
# against im2col + cuBLAS, layer by layer (bench-profile: the default's
# layers, a few seconds where the bench step with PyTorch takes minutes);
# bench-tune times each convolution's products both ways on this GPU and
# keeps the faster (device.conv_algorithm=tune), and prints what it chose:
# the figures to set auto's rule by.
step bench bench-no-graphs hr bench --device cuda "${BENCH_ARGS[@]}" --set device.graphs=false
step bench bench-keep-outputs hr bench --device cuda "${BENCH_ARGS[@]}" --set device.recompute=false
# bf16 against the bench step's f16: which is the faster on this GPU (the
# default is to be the faster of the two, measured).
step bench bench-bf16 hr bench --device cuda "${BENCH_ARGS[@]}" --set device.precision=bf16
step bench bench-profile hr bench --device cuda --profile "${BENCH_ARGS[@]}"
step bench bench-implicit-gemm hr bench --device cuda --profile "${BENCH_ARGS[@]}" \
    --set device.conv_algorithm=implicit_gemm
step bench bench-im2col hr bench --device cuda --profile "${BENCH_ARGS[@]}" \
    --set device.conv_algorithm=im2col
step bench bench-tune hr bench --device cuda --profile "${BENCH_ARGS[@]}" \
    --set device.conv_algorithm=tune
# An A/B on this GPU: the bench of an earlier build (bin/baseline-xtask.gz,
# where the bundle carries one) beside this build's (the bench step's).
if [ -f "$BUNDLE/bin/baseline-xtask.gz" ]; then
    step bench bench-baseline bench_baseline "${BENCH_ARGS[@]}"
fi

# 8b. Data parallel over NCCL (train --devices N, one process per GPU)
# with one rank: what the ranked step (launched, not captured; gradients
# summed through NCCL in rank order; the ranks' agreement before the
# optimizer) costs beside the default job of step 2, and its weights,
# which must be that job's bits. NCCL is PyTorch's pip wheel here.
step train train-devices-1 hr train --no-install --devices 1 --set device.kind=cuda \
    --set "run.output_dir=$WORK/devices-1"
step train devices-1-weights weights_equal "$WORK/default" "$WORK/devices-1"

# 9. The other trainers on the GPU, then their steps beside PyTorch's.
step train train-mlp train_mlp
step train train-gpt train_gpt
step train train-frames train_frames
step bench bench-tiny-gpt bench_model tiny_gpt
step bench bench-char-lm bench_model char_lm
step bench bench-conv-lstm bench_model conv_lstm
# Every convolution through im2col (its 17 -> 1 head in 27 im2col groups,
# where the default runs conv_narrow.cu's direct kernels).
step bench bench-conv-lstm-im2col bench_model conv_lstm --set device.conv_algorithm=im2col
# LoRA's epoch ran at 538 samples/s on an H100 against the full
# fine-tune's 850: where do its adapters' steps go?
step bench bench-lora bench_model lora_finetune

# 10. Least needed: the default job with implicit-GEMM convolutions and
# with im2col alone (each must reach the default's accuracy), and the
# im2col workspace at 64 and 4 MiB against 16.
step train train-implicit-gemm hr train --no-install --set device.kind=cuda \
    --set device.conv_algorithm=implicit_gemm --set "run.output_dir=$WORK/default-implicit-gemm"
step train train-im2col hr train --no-install --set device.kind=cuda \
    --set device.conv_algorithm=im2col --set "run.output_dir=$WORK/default-im2col"
step bench bench-workspace-64 hr bench --device cuda "${BENCH_ARGS[@]}" --set device.conv_workspace=64MiB
step bench bench-workspace-4 hr bench --device cuda "${BENCH_ARGS[@]}" --set device.conv_workspace=4MiB

# 11. Every kernel of a batch-512 step under Nsight Compute (where the
# machine has it), for the next round of kernel work.
if [ -z "$NCU" ]; then
    wants profile ncu-kernels && skip ncu-kernels "ncu (Nsight Compute) not found"
else
    step profile ncu-kernels kernel_profile
fi

# 12. The kernel tests again under compute-sanitizer (each kernel runs many
# times slower there; a second call names `sanitize` when the first had
# no time left, or when a test failed and the cause is in doubt).
for tool in memcheck racecheck synccheck; do
    sanitize_step "$tool"
done

write_report
publish
