"""Megatron launch lines the tests extend: small Llama-style models with non-default values, on mock data."""

# a flags-only RoPE / RMSNorm / SwiGLU model, mock data, a global batch of 12: what each test adds flags to
SMALL_LLAMA_LINE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 12 --train-iters 10 "
                    "--lr 2e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 "
                    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
                    "--hidden-dropout 0").split()

# the runs the process tests start, stop and resume: a global batch of 2, a cosine decay, a save interval far off
FAULT_RUN_FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
                   "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --min-lr 1e-4 "
                   "--lr-decay-style cosine --lr-decay-iters 1000 --mock-data --tokenizer-type NullTokenizer "
                   "--vocab-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
                   "--position-embedding-type rope --hidden-dropout 0 --log-interval 1 --save-interval 1000 "
                   "--eval-iters 0").split()

# A small model trained from scratch on mock data: translates with nothing declined.
TRANSLATE_BASE_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 10 "
                        "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100").split()

# the resume tests' run: GQA, untied embeddings, a warmup and cosine decay, a save every 3 iterations
RESUME_RUN_FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
                    "--group-query-attention --num-query-groups 2 --seq-length 32 --max-position-embeddings 64 "
                    "--micro-batch-size 2 --global-batch-size 4 --train-iters 12 --lr 1e-3 --min-lr 1e-4 "
                    "--lr-decay-style cosine --lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer "
                    "--vocab-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
                    "--position-embedding-type rope --untie-embeddings-and-output-weights --attention-dropout 0 "
                    "--hidden-dropout 0 --log-interval 1 --save-interval 3 --eval-iters 0").split()

# the router training runs: 4 experts, sigmoid scores with an expert bias, aux and z losses
ROUTER_RUN_FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
                    "--group-query-attention --num-query-groups 2 --seq-length 32 --max-position-embeddings 64 "
                    "--micro-batch-size 2 --global-batch-size 4 --train-iters 8 --lr 1e-3 --min-lr 1e-4 "
                    "--lr-decay-style cosine --lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer "
                    "--vocab-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
                    "--position-embedding-type rope --untie-embeddings-and-output-weights --attention-dropout 0 "
                    "--hidden-dropout 0 --log-interval 1 --save-interval 4 --eval-iters 0 --num-experts 4 "
                    "--moe-router-topk 2 --moe-ffn-hidden-size 32 --qk-layernorm --moe-router-score-function sigmoid "
                    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 --moe-aux-loss-coeff 0.01 "
                    "--moe-z-loss-coeff 0.001").split()


# The flags that describe the model's shape; the rest (data, schedule, tokenizer) stay.
ARCHITECTURE = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                "--num-query-groups", "--max-position-embeddings", "--normalization", "--position-embedding-type",
                "--attention-dropout", "--hidden-dropout", "--num-experts", "--moe-router-topk",
                "--moe-ffn-hidden-size"}


SWITCHES = {"--group-query-attention", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--qk-layernorm"}


def without_architecture(flags):
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ARCHITECTURE:
            skip = True
        elif flag not in SWITCHES:
            out.append(flag)
    return out


FP8 = {"--fp8-format": 1, "--fp8-param-gather": 0, "--fp8-amax-compute-algo": 1, "--fp8-amax-history-len": 1}


def edit_flags(argv, drop=(), **values):
    """`argv` without the flags in `drop` (with their values) and with `values` replacing flag values."""
    out, i = [], 0
    drop = {**{k: v for k, v in FP8.items() if k in drop}, **{k: 1 for k in drop if k not in FP8}}
    while i < len(argv):
        flag = argv[i]
        if flag in drop:
            i += 1 + drop[flag]
            continue
        out.append(flag)
        i += 1
        name = flag.lstrip("-").replace("-", "_")
        if name in values:
            out.append(str(values.pop(name)))
            i += 1
    for name, value in values.items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return out
