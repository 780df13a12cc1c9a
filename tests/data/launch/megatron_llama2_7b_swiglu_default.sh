#!/bin/bash
# Llama-2-7B-shaped run in the style of Megatron-LM examples/llama/train_llama2.sh, but with --swiglu and
# no --ffn-hidden-size: Megatron then uses int((4h * 2/3) / 64) * 64 = 10880 (not 4h = 16384, not 11008).
set -euo pipefail

TOKENIZER_MODEL=/data/llama-2/tokenizer.model
GPUS_PER_NODE=8
NNODES=1

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES"

LLAMA_ARGS="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
    --seq-length 4096 --max-position-embeddings 4096 \
    --position-embedding-type rope --normalization RMSNorm --swiglu \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --attention-dropout 0.0 --hidden-dropout 0.0"

torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
    $LLAMA_ARGS \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 1 \
    --sequence-parallel \
    --use-distributed-optimizer \
    --micro-batch-size 1 \
    --global-batch-size 256 \
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model ${TOKENIZER_MODEL} \
    --bf16 \
    --recompute-activations
