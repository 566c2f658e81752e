#!/usr/bin/env bash
# The benchmarks behind the issues' numbers, on the GPU machine (torch, triton, transformers, peft, cupy
# preinstalled; no network), in stages that each fit one 10-minute command and write at most eight files
# under $OUT (or .gpu-results/):
#
#   bash tools/gpu-bench.sh stream    # full fine-tune 1.5B fp32 + bf16 moments, device/host AdamW, activation offload (~5 min)
#   bash tools/gpu-bench.sh threads   # full1.5b fp32 with the host optimizer on all cores, one fewer, four fewer (~5 min)
#   bash tools/gpu-bench.sh compare   # lora14b at 24 GiB, every engine side by side (needs .whl/, ~9 min)
#   bash tools/gpu-bench.sh kv        # decode8b table, quantized-linear table (~5 min)
#   bash tools/gpu-bench.sh kv-overlap  # profiled decode8b steps: do TidalCache's page copies overlap the decode? (~3 min)
#   bash tools/gpu-bench.sh kv-interleaved  # decode8b's batch-1 engines stepped in turn in one process (~1 min)
#   bash tools/gpu-bench.sh dp        # two GPUs: NCCL tests, peer copy rate, data-parallel scaling (~4 min)
#   bash tools/gpu-bench.sh dp14b     # two GPUs: lora14b at 24 GiB, worlds 1 and 2, with the shared host copy; a 200-step soak (~6 min)
#   bash tools/gpu-bench.sh dp8b      # two GPUs: full8b at 80 GiB, worlds 1 and 2 (~5 min)
#   bash tools/gpu-bench.sh dp72b     # two GPUs: lora72b at 80 GiB per GPU, one host copy, peer pooling off (~6-9 min: rank 0 builds 135 GiB)
#   bash tools/gpu-bench.sh dp72b-pool  # the same with peer pooling auto
#   bash tools/gpu-bench.sh big1      # the two-GPU machine (its 256 GiB host), one GPU visible: lora110b without a budget, lora72b at 80 GiB (~9 min)
#   bash tools/gpu-bench.sh overlap   # weight streaming where compute covers the transfer: 16k and 32k tokens (~2 min)
#   bash tools/gpu-bench.sh quality   # perplexity per storage format (~8 min)
#   bash tools/gpu-bench.sh fp8-compute  # fp8_compute: its GPU tests, the quant table, the recast sweep, NF4-fp8 perplexity (~9 min)
#   bash tools/gpu-bench.sh micro     # the pytest-benchmark micro suites (arena, quant, stream, kv) (~5 min)
#   bash tools/gpu-bench.sh hf        # TidalTrainer LoRA on the Qwen2.5-14B shape at 24 GiB, the DPO example (~5 min)
#
# Every step has its own time limit, so one that hangs or runs long costs its slot, not the stage. The
# peers' wheels (bitsandbytes, TrainStream, DeepSpeed, BlockStreamer) install from .whl/ when present.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${OUT:-$root/.gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
peers=/tmp/tidal-peers
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$peers" .whl/*.whl 2>/dev/null
fi
export PYTHONPATH="$(ls -d "$root"/packages/*/src | paste -sd:):$peers${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step SECONDS LOG -- command...: run with a limit, keep the output, say how it ended
  local limit=$1 log=$2
  shift 3
  echo "== $* (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$log" | tail -n 25
  echo "== exit ${PIPESTATUS[0]}"
}

case "${1:-}" in
  stream)
    step 100 stream.log -- python3 benchmarks/stream/full_finetune.py --budget 24GiB --warmup 3 --steps 6 --json "$out/full1.5b-fp32.json"
    step 80 stream.log -- python3 benchmarks/stream/full_finetune.py --budget 24GiB --warmup 3 --steps 6 --moment-dtype bf16 --json "$out/full1.5b-bf16.json"
    step 60 stream.log -- python3 benchmarks/stream/device_adamw.py --json "$out/device-adamw.json"
    step 90 stream.log -- python3 benchmarks/stream/host_adamw.py --sweep 524288,1048576,2097152,4194304 --hog 2 --json "$out/host-adamw.json"
    step 60 stream.log -- python3 benchmarks/stream/activation_offload.py
    ;;
  threads)
    # does the host AdamW's thread pool starve the thread that dispatches backward? (measured backward
    # 183 ms against a 104 ms compute floor with every core updating)
    cores=$(nproc)
    for t in "$cores" $((cores - 1)) $((cores - 4)); do
      step 100 threads.log -- python3 benchmarks/stream/full_finetune.py --budget 24GiB --warmup 3 --steps 6 --threads "$t" --json "$out/full1.5b-fp32-threads$t.json"
    done
    ;;
  compare)
    step 560 compare.log -- python3 benchmarks/compare.py --scenario lora14b --vram-gb 24 --warmup 2 --steps 3 --deadline-s 540 --timeout 150 --out "$out/compare-lora14b.jsonl"
    ;;
  kv)
    step 260 kv.log -- python3 benchmarks/kv/decode.py --out "$out/decode8b.jsonl"
    step 90 kv.log -- python3 benchmarks/quant/table.py --skip-decode
    ;;
  kv-overlap)
    step 150 kv-overlap.log -- python3 benchmarks/kv/overlap.py --context 32768 --batch 1
    step 150 kv-overlap.log -- python3 benchmarks/kv/overlap.py --context 4096 --batch 1 --engines tidal
    ;;
  kv-interleaved)
    step 200 kv-interleaved.log -- python3 benchmarks/kv/interleaved.py --engines dynamic,tidal,tidal-resident,tidal-fp8 --context 4096 32768 --json "$out/kv-interleaved.jsonl"
    ;;
  dp)
    step 40 dp.log -- python3 benchmarks/distributed/peer_copy.py --json "$out/peer-copy.json"
    step 150 dp.log -- env TIDAL_REQUIRE_GPU=1 python3 -m pytest -m gpu -p tidal_testing.plugin -q packages/tidal-stream/tests/test_distributed.py tests-integration/distributed
    step 200 dp.log -- python3 benchmarks/distributed/scaling.py --worlds 1,2 --json "$out/dp-scaling.json"
    ;;
  dp14b)
    step 390 dp14b.log -- python3 benchmarks/distributed/scaling.py --scenario lora14b --vram-gb 24 --worlds 1,2 --steps 5 --warmup 2 --json "$out/dp-lora14b-24g.json"
    step 150 dp14b.log -- python3 benchmarks/distributed/scaling.py --worlds 2 --soak --steps 200 --warmup 20 --json "$out/dp-soak-w2.json"
    ;;
  dp8b)
    step 330 dp8b.log -- python3 benchmarks/distributed/scaling.py --scenario full8b --vram-gb 80 --threads 16 --steps 3 --warmup 1 --worlds 1,2 --json "$out/dp-full8b.json"
    ;;
  dp72b | dp72b-pool)
    # one run per command: building the 135 GiB base and its shared host copy takes minutes by itself
    pooling=off
    [ "$1" = dp72b-pool ] && pooling=auto
    step 560 dp72b.log -- python3 benchmarks/distributed/scaling.py --scenario lora72b --worlds 2 --placeholders --steps 3 --warmup 1 --peer-pooling "$pooling" --json "$out/dp-lora72b-$pooling.json"
    ;;
  big1)
    # one GPU: the harness builds the model in host memory (lora110b: 207 GiB), which only the two-GPU
    # machine's host holds; a host-RAM refusal is followed by one wrap counting the model's own bytes
    step 330 big1.log -- env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/compare.py --scenario lora110b --warmup 1 --steps 3 --engines tidal-bf16 --timeout 320 --out "$out/compare-lora110b.jsonl"
    step 240 big1.log -- env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/compare.py --scenario lora72b --vram-gb 80 --warmup 1 --steps 4 --engines tidal-bf16 --timeout 230 --out "$out/compare-lora72b-80g.jsonl"
    ;;
  overlap)
    # the overlap score's acceptance range is compute >= transfer: 8,192 tokens at H = 4096 was not there
    step 150 overlap.log -- python3 benchmarks/stream/streaming.py --hidden 4096 8192 --tokens 16384 32768 --prefetch 1 2 --out "$out/streaming-overlap.json"
    ;;
  quality)
    step 560 quality.log -- python3 benchmarks/quality.py --minutes 5 --out "$out/quality.jsonl"
    ;;
  fp8-compute)
    step 90 fp8-compute.log -- env TIDAL_REQUIRE_GPU=1 python3 -m pytest -m gpu -p tidal_testing.plugin -q packages/tidal-quant/tests/test_fp8_compute.py
    step 100 quant-table.md -- python3 benchmarks/quant/table.py --skip-decode
    step 120 fp8-compute-sweep.md -- python3 benchmarks/quant/fp8_compute_sweep.py
    step 250 quality.log -- python3 benchmarks/quality.py --minutes 1 --lora-steps 200 --formats bf16,nf4,nf4-fp8 --out "$out/quality.jsonl"
    ;;
  hf)
    step 360 hf.log -- python3 benchmarks/hf/trainer_lora14b.py --budget-gib 24 --steps 8
    step 120 hf.log -- python3 examples/dpo_lora.py --device cuda --steps 20
    ;;
  micro)
    step 540 micro.log -- python3 -m pytest -p tidal_testing.plugin benchmarks --benchmark-only -q --benchmark-json="$out/micro-h200.json"
    ;;
  *)
    sed -n '2,23p' "$0"
    exit 2
    ;;
esac
