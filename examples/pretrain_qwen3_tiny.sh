#!/usr/bin/env bash
# A MindSpeed-LLM style pretraining script for a tiny Qwen3, run on CPU ranks by the FSDP2 backend.
# Usage: examples/pretrain_qwen3_tiny.sh MODEL_DIR DATA_PREFIX SAVE_DIR [extra flags...]
# Only the entry point differs from a MindSpeed script (pretrain_gpt.py -> pretrain_fsdp2.py).
set -euo pipefail
MODEL_DIR=$1; DATA_PATH=$2; CKPT_SAVE_DIR=$3; shift 3
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-40}

GPT_ARGS="
    --use-mcore-models
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --sequence-parallel
    --use-distributed-optimizer
    --num-layers 4
    --hidden-size 128
    --ffn-hidden-size 384
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 32
    --qk-layernorm
    --seq-length 256
    --max-position-embeddings 1024
    --micro-batch-size 2
    --global-batch-size 8
    --make-vocab-size-divisible-by 1
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path ${MODEL_DIR}
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-base 10000
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --use-fused-rmsnorm
    --use-fused-rotary-pos-emb
    --use-flash-attn
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --train-iters ${TRAIN_ITERS}
    --lr 3e-3
    --min-lr 3e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.1
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --initial-loss-scale 4096
    --seed 1234
    --no-gradient-accumulation-fusion
    --no-masked-softmax-fusion
"
DATA_ARGS="
    --data-path ${DATA_PATH}
    --split 98,2,0
"
OUTPUT_ARGS="
    --log-interval 5
    --save-interval 20
    --eval-interval 20
    --eval-iters 2
"
${LAUNCHER:-torchrun --nproc_per_node ${NPROC}} pretrain_fsdp2.py \
    ${GPT_ARGS} ${DATA_ARGS} ${OUTPUT_ARGS} \
    --load "${MODEL_DIR}" --save "${CKPT_SAVE_DIR}" \
    --distributed-backend gloo \
    "$@"
