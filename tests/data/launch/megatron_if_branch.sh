#!/bin/bash
# The model size depends on an if whose condition the environment decides.
if [ "${BIG:-}" = "1" ]; then
    MODEL="--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --ffn-hidden-size 28672"
else
    MODEL="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008"
fi
if [ -n "${DEBUG:+x}" ]; then
    echo "debug run"
fi

torchrun --nproc_per_node 8 pretrain_gpt.py $MODEL \
    --swiglu --normalization RMSNorm --position-embedding-type rope --max-position-embeddings 4096 \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --seq-length 4096 --micro-batch-size 1 --global-batch-size 32 \
    --tensor-model-parallel-size 8 --sequence-parallel --use-distributed-optimizer \
    --tokenizer-type Llama2Tokenizer --tokenizer-model /data/llama2/tokenizer.model --bf16
