#!/bin/bash
# One script for three sizes, chosen by MODEL_SIZE from the environment (set by the job submitter).
set -euo pipefail

case ${MODEL_SIZE} in
    7B)
        HIDDEN_SIZE=4096; FFN_HIDDEN_SIZE=11008; NUM_LAYERS=32; NUM_HEADS=32; NUM_KV_HEADS=32
        TP=1; PP=1
        ;;
    13B)
        HIDDEN_SIZE=5120; FFN_HIDDEN_SIZE=13824; NUM_LAYERS=40; NUM_HEADS=40; NUM_KV_HEADS=40
        TP=2; PP=1
        ;;
    70B)
        HIDDEN_SIZE=8192; FFN_HIDDEN_SIZE=28672; NUM_LAYERS=80; NUM_HEADS=64; NUM_KV_HEADS=8
        TP=8; PP=1
        ;;
    *)
        echo "unknown MODEL_SIZE=${MODEL_SIZE}"; exit 1
        ;;
esac

GPT_ARGS=(
    --num-layers ${NUM_LAYERS}
    --hidden-size ${HIDDEN_SIZE}
    --ffn-hidden-size ${FFN_HIDDEN_SIZE}
    --num-attention-heads ${NUM_HEADS}
    --group-query-attention --num-query-groups ${NUM_KV_HEADS}
    --swiglu --normalization RMSNorm --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0
    --max-position-embeddings 4096 --seq-length 4096
)

torchrun --nproc_per_node 8 pretrain_gpt.py "${GPT_ARGS[@]}" \
    --tensor-model-parallel-size ${TP} --pipeline-model-parallel-size ${PP} \
    --micro-batch-size 1 --global-batch-size 64 --bf16 --use-distributed-optimizer --sequence-parallel \
    --tokenizer-type Llama2Tokenizer --tokenizer-model /data/llama2/tokenizer.model
