#!/usr/bin/env bash
# headroom's GPU proof, for a machine with an NVIDIA driver, python3 and
# PyTorch but no Rust toolchain (made by `cargo xtask gpu-bundle`).
#
#   bash run.sh [tests] [train] [oom] [resume] [bench]    (default: all five)
#
# Each step's output goes to $OUT/<step>.log (OUT defaults to ./out); every
# step runs even if an earlier one failed; report.json and summary.txt say
# what passed, with the figures. Fashion-MNIST comes from ./data (if the
# bundle carries it) or $FASHION_MNIST_DIR.
set -u
cd "$(dirname "$0")"
BUNDLE=$PWD
OUT=${OUT:-$BUNDLE/out}
mkdir -p "$OUT"
if [ -z "${FASHION_MNIST_DIR:-}" ] && [ -f data/train-images-idx3-ubyte.gz ]; then
    export FASHION_MNIST_DIR=$BUNDLE/data
fi
export HEADROOM_KERNEL_CACHE=${HEADROOM_KERNEL_CACHE:-$OUT/kernel-cache}
export HEADROOM_REQUIRE_GPU=1
XTASK=$BUNDLE/bin/xtask
STEPS=${*:-tests train oom resume bench}
RESULTS=$OUT/results.tsv
: > "$RESULTS"

# step NAME COMMAND...: runs it with its output in $OUT/NAME.log, records
# "NAME<TAB>exit<TAB>seconds".
step() {
    local name=$1; shift
    local started=$SECONDS
    echo "== $name: $*"
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >> "$RESULTS"
    echo "   exit $rc after $((SECONDS - started)) s"
    return $rc
}

# last_line FILE PATTERN: the last line of FILE that matches.
last_line() { grep -E "$2" "$1" 2>/dev/null | tail -n 1; }

wants() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

nvidia-smi -L > "$OUT/gpu.txt" 2>&1 || echo "nvidia-smi failed" >> "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >> "$OUT/gpu.txt" 2>&1
"$XTASK" doctor >> "$OUT/gpu.txt" 2>&1

if wants tests; then
    for t in "$BUNDLE"/bin/tests/*; do
        step "test-$(basename "$t")" "$t" --test-threads=1 --nocapture
    done
fi

if wants train; then
    # (b) The default experiment (5 epochs, batch 128) on the GPU.
    step train "$XTASK" train --no-install --set device.kind=cuda \
        --set "run.output_dir=$OUT/default"
    # The same job with every batch staged from the host instead of made
    # from the training set held on the GPU (data.on_device): same bits,
    # the wall time shows what residency is worth.
    step train-host-data "$XTASK" train --no-install --set device.kind=cuda \
        --set data.on_device=false --set "run.output_dir=$OUT/default-host-data"
    # f32 training on the GPU (--no-amp), one epoch: it must learn as the
    # mixed-precision run does (its test accuracy is in the log).
    step train-no-amp "$XTASK" train --no-install --set device.kind=cuda --no-amp \
        --set train.epochs=1 --set "run.output_dir=$OUT/default-no-amp"
    # The same job in PyTorch (AMP, channels_last, fused AdamW,
    # torch.compile, DataLoader with 4 workers), for the whole-job wall time.
    step torch-job python3 "$BUNDLE/bench/torch_fashion_mnist.py" --device cuda \
        --data "${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
fi

if wants oom; then
    # (c1) A budget below what a batch-128 step needs: the run must adapt
    # (split the micro-batch) and finish.
    step oom-budget "$XTASK" train --no-install --set device.kind=cuda \
        --set device.memory_limit=40MiB --set train.epochs=1 \
        --set data.train_samples=8192 --set "run.output_dir=$OUT/oom-budget"
    # (c2) Another process holds all but ~300 MiB of the GPU: a real driver
    # out-of-memory must be handled the same way (never a crash or a hang).
    python3 - > "$OUT/hog.log" 2>&1 <<'EOF' &
import time, torch
free, _ = torch.cuda.mem_get_info()
hold = torch.empty(max(free - (300 << 20), 0), dtype=torch.uint8, device="cuda")
print("holding", hold.numel() >> 20, "MiB", flush=True)
time.sleep(900)
EOF
    HOG=$!
    sleep 20
    step oom-driver timeout 300 "$XTASK" train --no-install --set device.kind=cuda \
        --set train.batch_size=4096 --set train.epochs=1 --set data.train_samples=16384 \
        --set "run.output_dir=$OUT/oom-driver"
    kill "$HOG" 2>/dev/null
    wait "$HOG" 2>/dev/null
fi

if wants resume; then
    # (c3) SIGKILL twice at different moments and resume: the step losses
    # and final figures must equal an uninterrupted run's, bit for bit.
    job=(--no-install --set device.kind=cuda --set train.epochs=2 \
        --set data.train_samples=30000 --set checkpoint.every_steps=20)
    step resume-reference "$XTASK" train "${job[@]}" --set "run.output_dir=$OUT/resume-a"
    resumed() {
        local dir=$OUT/resume-b
        "$XTASK" train "${job[@]}" --set "run.output_dir=$dir" & local pid=$!
        sleep 6; kill -9 "$pid"; wait "$pid"
        "$XTASK" train --resume "$dir" & pid=$!
        sleep 4; kill -9 "$pid"; wait "$pid"
        "$XTASK" train --resume "$dir"
        echo "resumes that continued a killed run: $(grep -c 'resuming from' "$OUT/resume-killed.log")"
    }
    step resume-killed resumed
    step resume-compare python3 - "$OUT/resume-a/metrics.jsonl" "$OUT/resume-b/metrics.jsonl" <<'EOF'
import json, sys
def figures(path):
    steps, epochs = {}, []
    for line in open(path):
        record = json.loads(line)
        if record["kind"] == "step":
            data = record["data"]
            steps[data["step"]] = (data["loss"], data["grad_norm"])
        else:
            epochs.append((record["data"]["test_loss"], record["data"]["test_accuracy"]))
    return steps, epochs
a, b = figures(sys.argv[1]), figures(sys.argv[2])
print("steps", len(a[0]), len(b[0]), "epochs", a[1], b[1])
sys.exit(0 if a == b else 1)
EOF
fi

if wants bench; then
    # (d) The training step beside PyTorch (AMP, channels_last, fused AdamW,
    # torch.compile) on this GPU, batch 128 and 512.
    step bench "$XTASK" bench --device cuda --compare-torch --steps 50 --json
    step bench-table "$XTASK" bench --device cuda --compare-torch --steps 50
    # What CUDA graphs give: the same step launched kernel by kernel.
    step bench-no-graphs "$XTASK" bench --device cuda --steps 50 --set device.graphs=false
fi

python3 - "$OUT" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def read(name):
    try:
        return open(os.path.join(out, name)).read()
    except OSError:
        return ""
steps = []
for line in read("results.tsv").splitlines():
    name, rc, seconds = line.split("\t")
    steps.append({"step": name, "exit": int(rc), "seconds": int(seconds)})
report = {"gpu": read("gpu.txt").strip(), "steps": steps}
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
}
torch_job = [l for l in read("torch-job.log").splitlines() if l.startswith("{")]
if torch_job:
    try:
        job = json.loads(torch_job[-1])
        report["torch_job"] = job
        report["whole_job_seconds"]["pytorch"] = job["wall_seconds"]
    except ValueError:
        report["torch_job"] = "unparsed; see torch-job.log"
for name in ("oom-budget", "oom-driver"):
    log = read(name + ".log")
    report[name] = {
        "splits": len(re.findall(r"splitting the batch", log)),
        "cache_releases": len(re.findall(r"released .* of cached blocks", log)),
    }
bench = read("bench.log")
start = bench.find("{")
if start >= 0:
    try:
        report["bench"] = json.loads(bench[start:])
    except ValueError:
        report["bench"] = "unparsed; see bench.log"
json.dump(report, open(os.path.join(out, "report.json"), "w"), indent=2)
lines = [report["gpu"], ""]
lines += [f'{s["step"]:<28} {"ok" if s["exit"] == 0 else "FAILED (exit %d)" % s["exit"]:<16} {s["seconds"]} s' for s in steps]
if "default_run" in report:
    lines += [""] + report["default_run"]["summary"]
jobs = report["whole_job_seconds"]
lines += ["", "whole default job, wall seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in jobs.items() if v is not None)]
if isinstance(report.get("torch_job"), dict):
    lines += [f'pytorch test accuracy {100 * report["torch_job"]["test_accuracy"]:.2f}%']
lines += ["", read("bench-table.log").strip()]
lines += ["", "without CUDA graphs (device.graphs=false):", read("bench-no-graphs.log").strip()]
open(os.path.join(out, "summary.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
