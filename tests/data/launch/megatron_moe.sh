#!/bin/bash
# Mixtral-8x7B-shaped MoE in the style of Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
)
torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --max-position-embeddings 32768 --seq-length 4096 \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    "${MOE_ARGS[@]}" \
    --tensor-model-parallel-size 1 --expert-model-parallel-size 8 \
    --micro-batch-size 1 --global-batch-size 256 --bf16 \
    --tokenizer-type Llama2Tokenizer --tokenizer-model /data/mixtral/tokenizer.model
