#!/bin/bash
# GPT-3 1.3B with the deepspeed launcher and a DeepSpeed config kept next to the script, in the style of
# Megatron-DeepSpeed examples_deepspeed/rebase/ds_pretrain_gpt_1.3B.sh.
num_layers=24
hidden_size=2048
num_attn_heads=16
seq_len=2048
global_batch_size=512
batch_size=8
mp_size=1
pp_size=1
num_gpus_pernode=8
num_node=2

megatron_options=" \
    --tensor-model-parallel-size ${mp_size} \
    --pipeline-model-parallel-size ${pp_size} \
    --no-pipeline-parallel \
    --num-layers ${num_layers} \
    --hidden-size ${hidden_size} \
    --num-attention-heads ${num_attn_heads} \
    --seq-length ${seq_len} \
    --max-position-embeddings ${seq_len} \
    --micro-batch-size ${batch_size} \
    --global-batch-size ${global_batch_size} \
    --vocab-file gpt2-vocab.json \
    --merge-file gpt2-merges.txt \
    --use-flash-attn-v2 \
    --checkpoint-activations \
    --fp16"

deepspeed_options=" \
    --deepspeed \
    --deepspeed_config ds_config_gpt_1.3B.json \
    --zero-stage 1"

deepspeed --num_gpus ${num_gpus_pernode} --num_nodes ${num_node} pretrain_gpt.py ${megatron_options} ${deepspeed_options} \
    &>> train.log
