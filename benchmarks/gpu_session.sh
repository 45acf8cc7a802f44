#!/usr/bin/env bash
# The GPU figures in one call of a lent device (at most 590 s of runs): each benchmark's JSON line to
# $OUT (or ./runs/gpu), and the device named. Run from the repository root, in a venv with this project
# and a CUDA torch. Each run has its own time limit, so one that hangs cannot take the others' time.
#   bash benchmarks/gpu_session.sh
set -u
out=${OUT:-runs/gpu}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$out/device.txt" 2>&1
step() {  # NAME LIMIT_S ARGS...: one benchmark run, its output kept, its JSON line appended to figures.jsonl
  name=$1; limit=$2; shift 2
  timeout -k 10 "$limit" python "$@" > "$out/$name.log" 2>&1; rc=$?
  line=$(grep -E '^\{' "$out/$name.log" | tail -n 1)
  echo "{\"run\": \"$name\", \"rc\": $rc, \"figures\": ${line:-null}}" >> "$out/figures.jsonl"
}
s="benchmarks/train_step.py --preset scgpt --batch 240 --steps 30"
step eager 50 $s --full-length
step compiled 150 $s --full-length --compile
step ragged_padded 50 $s
step ragged_packed 50 $s --packed
step ragged_packed_flex 90 $s --flex   # (FlexAttention's block mask, compiled: the dense mask's rival)
# 20k cells: a bare machine synthesizes the atlas first, and 40 steps of 240 cells read 9,600 of them
step campaign 200 benchmarks/gpu_campaign.py --steps 40 --cells 20000   # (the limits add up to 590 s)
cat "$out/device.txt" "$out/figures.jsonl"
