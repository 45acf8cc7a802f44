#!/usr/bin/env bash
# The GPU figures of issue 43 in one call of a lent device (at most ~555 s of runs): each benchmark's
# JSON line to $OUT/figures.jsonl (or ./runs/gpu), its log beside it, and the device named. Run from the
# repository root with a CUDA torch and this project's dependencies importable.
#   bash benchmarks/gpu_session.sh           # the figures (~555 s): the CUDA tests, the step (padded by
#                                            # the SDPA mask and by varlen, packed, compiled), the campaign
#   bash benchmarks/gpu_session.sh campaign  # the padded step and the campaign alone (~160 s)
#   bash benchmarks/gpu_session.sh explore   # a first look (~330 s): compiled and eager (profiled), cuDNN's
#                                            # attention, Geneformer-2048 padded and packed
#   bash benchmarks/gpu_session.sh budget    # token-budget batches (~80 s): scGPT and Geneformer-2048 packed,
#                                            # each batch the cells that fit about what a batch of cells held
#   bash benchmarks/gpu_session.sh again     # what changed since the last GPU figures (~465 s of limits): the
#                                            # CUDA tests, padded rows (padding tails cut in spans), packed and
#                                            # token-budget batches, and the campaign, padded and by tokens
#   bash benchmarks/gpu_session.sh compiled  # compiled (~425 s of limits): the step at full length and in packed
#                                            # rows (whose compilation of varied row counts takes ~100 s), and the
#                                            # campaign (`--compile`, ~150 s)
# Each run has its own time limit, so one that hangs cannot take the others' time; the most wanted
# figures run first. The campaign's atlas is synthesized on the CPUs while the first runs use the GPU.
set -u
PY=${PY:-python3}
out=${OUT:-runs/gpu}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > "$out/device.txt" 2>&1
$PY -c "import torch, lance, numba, zstandard; print(torch.__version__, torch.version.cuda, lance.__version__, numba.__version__)" >> "$out/device.txt" 2>&1
step() {  # NAME LIMIT_S ARGS...: one benchmark run, its output kept, its JSON line appended to figures.jsonl
  name=$1; limit=$2; shift 2
  start=$(date +%s)
  timeout -k 10 "$limit" $PY "$@" > "$out/$name.log" 2>&1; rc=$?
  line=$(grep -E '^\{' "$out/$name.log" | tail -n 1)
  echo "{\"run\": \"$name\", \"rc\": $rc, \"wall_s\": $(( $(date +%s) - start )), \"figures\": ${line:-null}}" >> "$out/figures.jsonl"
  echo "$name rc=$rc $(( $(date +%s) - start ))s"
}
s="benchmarks/train_step.py --preset scgpt --batch 240 --steps 25"
g="benchmarks/train_step.py --preset scgpt --layout geneformer --lengths atlas --max-genes 2048 --batch 64 --steps 20"
if [ "${1:-}" = explore ]; then
  step scgpt_full_compiled 120 $s --full-length --compile
  step scgpt_full_eager 45 $s --full-length --profile "$out/profile_full_eager.txt"
  step scgpt_full_eager_cudnn 35 $s --full-length --sdpa cudnn
  step geneformer2048_padded 50 $g --attention dense
  step geneformer2048_packed_flex 75 $g --attention flex
  cat "$out/device.txt" "$out/figures.jsonl"; head -n 30 "$out/profile_full_eager.txt"
  exit 0
fi
if [ "${1:-}" = budget ]; then  # (scGPT's 240 cells average ~154k tokens, Geneformer-2048's 64 ~96k)
  step scgpt_packed_budget 35 $s --batch 480 --tokens-per-row 8200 --tokens-per-batch 160000
  step geneformer2048_packed_budget 45 $g --batch 128 --tokens-per-row 16392 --tokens-per-batch 98000
  cat "$out/device.txt" "$out/figures.jsonl"
  exit 0
fi
if [ "${1:-}" = compiled ]; then
  $PY -c "from producers.synth import cached_atlas; cached_atlas(${CELLS:-20000})" > "$out/atlas.log" 2>&1 &
  step scgpt_full_compiled 75 $s --full-length --compile
  step scgpt_packed_varlen_compiled 150 $s --packed --tokens-per-row 8200 --compile
  wait
  step campaign_compiled 200 benchmarks/gpu_campaign.py --steps 24 --cells "${CELLS:-20000}" --compile
  cat "$out/device.txt" "$out/figures.jsonl"
  exit 0
fi
cells=${CELLS:-20000}
if [ "${1:-}" = again ]; then  # the campaign first after the tests: the figure most wanted
  $PY -c "from producers.synth import cached_atlas; cached_atlas($cells)" > "$out/atlas.log" 2>&1 &
  step cuda_tests 40 -m pytest -q -n 0 -p no:cacheprovider -rs tests/test_trainer.py -k "cuda or packed_batch or packing"
  wait
  step campaign 120 benchmarks/gpu_campaign.py --steps 30 --cells "$cells"
  step scgpt_padded 35 $s
  step scgpt_packed_varlen 35 $s --packed --tokens-per-row 8200
  step scgpt_packed_budget 35 $s --batch 480 --tokens-per-row 8200 --tokens-per-batch 160000
  step geneformer2048_padded 40 $g
  step geneformer2048_packed_varlen 40 $g --packed --tokens-per-row 16392
  step campaign_packed_budget 120 benchmarks/gpu_campaign.py --steps 30 --cells "$cells" --batch 480 \
    --tokens-per-row 8200 --tokens-per-batch 160000
  cat "$out/device.txt" "$out/figures.jsonl"; tail -n 3 "$out/cuda_tests.log"
  exit 0
fi
$PY -c "from producers.synth import cached_atlas; cached_atlas($cells)" > "$out/atlas.log" 2>&1 &
atlas=$!
if [ "${1:-}" = campaign ]; then  # the padded step and the campaign alone (~160 s)
  step scgpt_padded 35 $s
  wait $atlas
  step campaign 120 benchmarks/gpu_campaign.py --steps 30 --cells "$cells"
  cat "$out/device.txt" "$out/figures.jsonl"
  exit 0
fi
step cuda_tests 40 -m pytest -q -n 0 -p no:cacheprovider -rs tests/test_trainer.py -k "cuda or packed_batch or packing"
step scgpt_full_compiled 70 $s --full-length --compile
step scgpt_padded_dense 35 $s --attention dense
step scgpt_padded 35 $s
step scgpt_packed_varlen 35 $s --packed --tokens-per-row 8200
step geneformer2048_padded_dense 40 $g --attention dense
step geneformer2048_padded 40 $g
step geneformer2048_packed_varlen 40 $g --packed --tokens-per-row 16392
wait $atlas
step campaign 120 benchmarks/gpu_campaign.py --steps 30 --cells "$cells"
step scgpt_packed_varlen_compiled 100 $s --packed --tokens-per-row 8200 --compile
cat "$out/device.txt" "$out/figures.jsonl"; tail -n 3 "$out/cuda_tests.log"; 
