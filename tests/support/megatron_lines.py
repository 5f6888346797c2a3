"""Megatron launch lines the translation tests extend: a small Llama-style model with non-default values."""

# a flags-only RoPE / RMSNorm / SwiGLU model, mock data, a global batch of 12: what each test adds flags to
SMALL_LLAMA_LINE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 12 --train-iters 10 "
                    "--lr 2e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 "
                    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
                    "--hidden-dropout 0").split()
