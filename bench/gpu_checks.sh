#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run on a lent machine (what they showed:
# docs/benchmarks.md, "On a GPU"):
#   tests: the test suite (or $TESTS) with every worker on cuda (option.device=auto);
#   swap:  what a preempted sequence costs to bring back, recompute against KV swap;
#   preempt: the real processes on cuda preempting by recompute, by swap into the
#          pinned swap buffer, and by swap with the victims' KV prefetched on a side
#          stream (`bench.preemption_ab`), greedy outputs compared;
#   step:  the worker's packed step in process on cuda, with and without cuDNN's SDPA
#          (`bench.worker_step --device cuda --grow`; STEP_PROFILE=N adds torch.profiler's
#          top N operators and host time against kernel time);
#   peers: seqserve against the HF baselines on cuda, all at once (`bench peers`).
# Such a machine has torch but no package index. Before the call, here:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl transformers==5.23.0 huggingface_hub==2.4.0 \
#     grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
#     protobuf==7.36.2 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
#     typing-inspection typing_extensions openai==3.57.0 jiter httpx2 httpcore2 truststore sniffio
#   mkdir -p .gpu/smollm2 && cp models/smollm2-135m-instruct-bf16/{config.json,\
#     generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/smollm2/
# (both folders in .git/info/exclude), then carry .whl and .gpu. Logs go to $OUT.
# Usage: bash bench/gpu_checks.sh [peers|step|swap|preempt|tests ...]   (default: all)
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
STEPS=${*:-peers step swap preempt tests}  # the timed runs first, on a quiet machine
TEST_SECONDS=${TEST_SECONDS:-180}
TESTS=${TESTS:-tests/}
PEERS=${PEERS:-hf,hf-cb}
PEER_RUNS=${PEER_RUNS:-smollm2-shape:azure-conv smollm2-shape:azure-code mid:azure-conv}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/protos PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'grpcio', grpc.__version__, torch.cuda.get_device_name(0))" || exit 1
lscpu | grep -E "^Model name|^CPU\(s\)" | tr -s ' '

# SmolLM2-135M's shape (config and tokenizer from .gpu/smollm2/) with random weights: its
# real weights are larger than what travels to the machine.
smollm2_shape() {
  python3 - <<'EOF'
import torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
out = Path("models/smollm2-shape-bf16")
if not (out / "model.safetensors").exists():
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(".gpu/smollm2")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(".gpu/smollm2").save_pretrained(out)
print(out)
EOF
}

# A matrix model's directory (bench/matrix_models.py makes it where missing).
resolved() {
  python3 -c "from bench.matrix_models import resolve_model as r; print(r('$1'))" | tail -1
}

for step in $STEPS; do
  case $step in
  tests)
    # Fixtures first, in one process; then the suite over 12 processes, stopped with
    # SIGINT at the cap so that pytest still prints its summary.
    python3 -c "from tests.conftest import tiny_model, ARCHITECTURES, long_context_model
[tiny_model(a) for a in ARCHITECTURES]; long_context_model()" >/dev/null 2>&1
    timeout -s INT "$TEST_SECONDS" python3 -m pytest -q -n 12 -p no:cacheprovider \
      --timeout 180 -rfE $TESTS >"$OUT/tests.log" 2>&1
    echo "pytest exit $?"
    # A suite stopped at the cap leaves its deployments' processes running: end them, or
    # they load the CPUs under whatever runs next.
    pkill -9 -f "scheduler_service|worker_service" 2>/dev/null; sleep 3
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-220 | head -40
    tail -3 "$OUT/tests.log"
    ;;
  peers)
    for run in $PEER_RUNS; do
      m=${run%%:*} w=${run#*:}
      if [ "$m" = smollm2-shape ]; then model=$(smollm2_shape)
      else model=$(resolved "$m")
      fi
      python3 -m bench peers --model "$model" --workload "$w" --peers "$PEERS" --device cuda \
        --no-ceiling --no-floor --plot-dir '' --out "$OUT/peers-$m-$w" \
        >"$OUT/peers-$m-$w.log" 2>&1 || { echo "peers $m $w failed"; tail -5 "$OUT/peers-$m-$w.log"; }
      echo "$m $w"
      sed -n '/^## seqserve and its peers/,/^Latency/p' "$OUT/peers-$m-$w/peers.md" 2>/dev/null \
        | grep '^|'
      grep -h "^Where seqserve" "$OUT/peers-$m-$w/peers.md"
      grep -h "swap space\|warm-up" "$OUT/peers-$m-$w"/logs/*/*.log | cut -c1-200
    done
    ;;
  step)
    # Each step one token longer than the last, as in serving: with cuDNN's SDPA (which
    # the runner turns off on a GPU) and without.
    for sdpa in --cudnn-sdpa ""; do
      python3 -m bench.worker_step "$(smollm2_shape)" --device cuda --rows 1,32,64 \
        --prefill 512 --grow $sdpa --profile "${STEP_PROFILE:-0}" >"$OUT/step$sdpa.log" 2>&1 \
        || tail -5 "$OUT/step$sdpa.log"
      echo "worker_step --grow ${sdpa:-(no cuDNN SDPA)}"
      grep -E "^(decode|prefill) |^host " "$OUT/step$sdpa.log"
    done
    ;;
  preempt)
    python3 -m bench.preemption_ab "$(smollm2_shape)" --modes recompute,swap,prefetch \
      >"$OUT/preempt.log" 2>&1
    echo "preemption_ab exit $?"
    grep -E "^\||identical|KV copies" "$OUT/preempt.log" | cut -c1-200
    ;;
  swap)
    python3 -m bench.swap_cost "$(smollm2_shape)" --lengths 128,512,2048,8192
    python3 -m bench.swap_cost "$(resolved qwen2-gqa)" --lengths 128,512,2048,8192
    ;;
  esac
done
