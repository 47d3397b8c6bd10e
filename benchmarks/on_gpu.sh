#!/usr/bin/env bash
# The GPU checks in one call, for a session lent a GPU for a few minutes (docs/benchmarks.md "On a GPU"):
# the CUDA tests (bf16 training on the device, the lean decode equal to the HF forward there), then
# benchmarks/roofline.py on CUDA (the device's own bound, fp32 and bf16 weights), then benchmarks/vs_trl.py on
# CUDA in bf16 at SmolLM2's shapes, both trainers, our gradient checkpointing on as TRL's is by default and
# our decode replayed from a CUDA graph.
# MODEL_DIR: SmolLM2's directory (`projected-grpo get-model smollm2` prints it); only its config.json and
# tokenizer are read (seeded random weights: vs_trl.random_like), so a copy without model.safetensors will do.
#   bash benchmarks/on_gpu.sh MODEL_DIR        (needs torch with CUDA; vs_trl also trl, peft, psutil: the
#                                               `bench` extra; without trl that part says so and is not run)
set -uo pipefail
MODEL_DIR=${1:?usage: bash benchmarks/on_gpu.sh MODEL_DIR}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src:benchmarks${PYTHONPATH:+:$PYTHONPATH}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 2
python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_graphed.py
RW=$(mktemp -d)
for dt in float32 bfloat16; do
    python -c "import sys, vs_trl; vs_trl.random_like(sys.argv[1], sys.argv[2], sys.argv[3])" "$MODEL_DIR" "$RW/$dt" $dt
    # 1 prompt x 64 samples x 128 tokens (+ a teacher row), the model's own weights in its dtype: the lean
    # decode step, then the same step replayed from a CUDA graph (rollout.cuda_graph), that one profiled
    for graph in --rollout.no-cuda-graph "--rollout.cuda-graph --profile 20"; do
        python benchmarks/roofline.py --preset smollm2-gpu --model "$RW/$dt" --rounds 3 --new 128 --prompts 1 \
            --model.dtype $dt --rollout.sample-dtype model --rollout.group-size 64 --rollout.mix 0.0 $graph
    done
done
if python -c "import trl" 2>/dev/null; then
    python benchmarks/vs_trl.py --device cuda --dtype bfloat16 --model-dir "$MODEL_DIR" --random-weights \
        --pairings lora16,svd16,full_ref --losses dr_grpo --betas 0.04 --reps 1 --steps 5 --prompts 8 \
        --group 8 --max-new 128 --threads 4 --ckpt 1 --cuda-graph 1
else
    echo "vs_trl.py not run: trl is not installed here (pip install -e '.[bench]')"
fi
