#!/bin/bash
# --group-query-attention without --num-query-groups: Megatron uses one key/value group (multi-query).
torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
    --group-query-attention \
    --ffn-hidden-size 11008 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --max-position-embeddings 4096 \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 \
    --tensor-model-parallel-size 4 --sequence-parallel \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Llama-2-7b-hf \
    --bf16 --use-distributed-optimizer
