#!/usr/bin/env bash
# The GPU checks in one call, for a session lent a GPU for a few minutes (docs/benchmarks.md "On a GPU"):
# the CUDA tests (bf16 training on the device, the lean decode equal to the HF forward there), then
# benchmarks/vs_trl.py on CUDA in bf16 at SmolLM2's shapes, both trainers, our gradient checkpointing on as
# TRL's is by default. MODEL_DIR: SmolLM2's directory (`projected-grpo get-model smollm2` prints it); only its
# config.json and tokenizer are read (--random-weights), so a copy without model.safetensors will do.
#   bash benchmarks/on_gpu.sh MODEL_DIR        (needs torch with CUDA, trl, peft, psutil: the `bench` extra)
set -uo pipefail
MODEL_DIR=${1:?usage: bash benchmarks/on_gpu.sh MODEL_DIR}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 2
python -m pytest -q -m gpu tests/test_gpu.py
python benchmarks/vs_trl.py --device cuda --dtype bfloat16 --model-dir "$MODEL_DIR" --random-weights \
    --pairings lora16,svd16,full_ref --losses dr_grpo --betas 0.04 --reps 1 --steps 5 --prompts 8 --group 8 \
    --max-new 128 --threads 4 --ckpt 1
