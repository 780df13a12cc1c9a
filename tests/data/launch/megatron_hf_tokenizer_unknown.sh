#!/bin/bash
# A Hugging Face tokenizer from a local folder whose vocabulary check cannot know, and no --vocab-size.
torchrun --nproc_per_node 8 pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 4 --global-batch-size 256 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model /shared/tokenizers/our-bpe-v3 \
    --bf16 --use-distributed-optimizer
