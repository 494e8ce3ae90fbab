#!/usr/bin/env bash
# From text to a trained model, a newcomer's path (README.md, "From text to a trained
# model"): a sentencepiece tokenizer trained on the text, the text prepared into a Megatron
# dataset, then moe_lm on it with the held-out CE of --split's validation part every
# EVAL_EVERY steps.
#   tools/text_to_model.sh OUT_DIR TEXT_FILE... [-- MOE_LM_FLAGS...]
# Binaries: $TOKENIZER_TRAIN, $PREPARE_DATA and $MOE_LM, else bazel-bin's (build them with
# ./bazelw build -c opt //tools:all //train:moe_lm). $VOCAB (default 2000) pieces.
set -euo pipefail
out="$1"; shift
texts=()
while [[ $# -gt 0 && "$1" != "--" ]]; do texts+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
vocab="${VOCAB:-2000}"
tokenizer_train="${TOKENIZER_TRAIN:-bazel-bin/tools/tokenizer_train}"
prepare_data="${PREPARE_DATA:-bazel-bin/tools/prepare_data}"
moe_lm="${MOE_LM:-bazel-bin/train/moe_lm}"
mkdir -p "$out"
cat "${texts[@]}" > "$out/text.txt"

# 1. The tokenizer (one thread: the same model from the same text).
"$tokenizer_train" --input="$out/text.txt" --vocab_size="$vocab" --model_prefix="$out/tok"
# 2. The dataset: each paragraph (blank-line separated) a document, </s> after each.
"$prepare_data" --input="$out/text.txt" --text_documents=paragraph --tokenizer="$out/tok.model" \
  --output_prefix="$out/text"
# 3. Training, with a held-out CE on 5% of the paragraphs.
"$moe_lm" --data_path="$out/text" --split=95,5 --vocab="$vocab" --eval_every=50 "$@"
