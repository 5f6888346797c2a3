#!/usr/bin/env bash
# `make demo`: a user's day on 2 CPU ranks, from files already on this machine (no download).
#   1. a corpus (Python's stdlib sources), a tokenizer trained on it, a tiny Qwen3 HF directory
#   2. tools/preprocess_data.py → .bin/.idx (Megatron's format)
#   3. the MindSpeed-style script's translation (--dry-run)
#   4. training with that script's Megatron flags, stopped at iteration 100 by --exit-interval
#   5. the very same command again: it resumes from the newest checkpoint and finishes, then exports to HF
#   6. plain transformers loads the export and generates
set -euo pipefail
cd "$(dirname "$0")/.."
W=${DEMO_DIR:-demo_work}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}  # `make demo PYTHON=venv/bin/python` runs it with that environment, activated or not
TORCHRUN="$PY -m torch.distributed.run --nproc_per_node 2"  # the environment's torchrun
rm -rf "$W" && mkdir -p "$W"

echo "== 1. corpus, tokenizer and a tiny Qwen3, built from local files"
"$PY" tools/demo_assets.py "$W"

echo "== 2. tools/preprocess_data.py (Megatron's flags)"
"$PY" tools/preprocess_data.py --input "$W/corpus.jsonl" --output-prefix "$W/data/corpus" --json-keys text \
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$W/model" --append-eod --workers 2 \
    --log-interval 500
DATA="$W/data/corpus_text_document"
export TRAIN_ITERS=200  # steps 3 to 5 (the dry run shows the run that steps 4 and 5 train); fewer iterations
                        # leave a model that completes any prompt with newlines

echo "== 3. what the Megatron flags become (--dry-run, nothing touched)"
LAUNCHER="env WORLD_SIZE=2 $PY" bash examples/pretrain_qwen3_tiny.sh "$W/model" "$DATA" "$W/ckpt" --dry-run \
    | grep -E '^# (pretrain_fsdp2|accepted|warning|validated)|^  (tp_size|per_device_train_batch_size|gradient_accumulation_steps|max_steps|lr):'

echo "== 4. train on 2 CPU ranks with the script's flags; --exit-interval 100 stops it after saving"
LAUNCHER="$TORCHRUN" bash examples/pretrain_qwen3_tiny.sh "$W/model" "$DATA" "$W/ckpt" --exit-interval 100

echo "== 5. the same command again: resumes from the newest checkpoint, finishes, exports to HF"
LAUNCHER="$TORCHRUN" bash examples/pretrain_qwen3_tiny.sh "$W/model" "$DATA" "$W/ckpt" --exit-interval 100
ls "$W/ckpt"

echo "== 6. plain transformers loads the export and generates"
"$PY" - "$W/ckpt/hf" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
ids = tokenizer("def __init__(self", return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
print(repr(tokenizer.decode(out[0])))
PY
echo "== demo done: checkpoints and the HF export are under $W/ckpt"
