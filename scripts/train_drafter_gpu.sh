#!/usr/bin/env bash
# One DSPARK training stage on a GPU machine that has a CUDA build of torch but not this project's venv (the
# device machines lent to some sessions: no network, 64 MiB of working tree a call, 16 MiB a returned file).
#   bash scripts/train_drafter_gpu.sh OUT_DIR [train-drafter flags, which override the defaults below]
# Needs the target GGUF at $TARGET or as its parts "$TARGET".part-* (split -b 48M), and the gguf wheel in .whl/
# (pip download --no-deps gguf==0.19.0 -d .whl). The tracked tree is ~61 MiB, most of it drafters' weights that this
# run does not read: untrack and ignore them for the calls (git rm -q --cached '*.safetensors'; add *.safetensors,
# /.gpu/ and /.whl/ to .git/info/exclude; git reset -q and drop that line afterwards), then send one part in a first
# call and the other in a second within the machine's 30 s of warmth (an ignored path carried by the first stays).
# Writes OUT_DIR/train.log, the exported drafter's small files, its weights in 15 MB parts (cat
# model.safetensors.part-* > model.safetensors), the held-out report and the training log.
# DEVICE=cpu SPECSERVE_NATIVE=1 PYTHON=.venv/bin/python runs it here (checks the script).
set -euo pipefail
python=${PYTHON:-python3}
out=${1:?usage: scripts/train_drafter_gpu.sh OUT_DIR [train-drafter flags]}
shift
target=${TARGET:-.gpu/SmolLM2-135M-Instruct.Q4_1.gguf}
work=${WORK:-work/gpu}
[ -f "$target" ] || cat "$target".part-* > "$target"
if ! "$python" -c "import gguf" 2>/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} SPECSERVE_NATIVE=${SPECSERVE_NATIVE:-0} PYTHONUNBUFFERED=1
mkdir -p "$out" "$work"
cat data/smollm2-135m-sharegpt-regenerated.jsonl.gz data/smollm2-135m-sharegpt-regenerated-2.jsonl.gz \
    data/smollm2-135m-sharegpt-regenerated-3.jsonl.gz > "$work/all3.jsonl.gz"
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
"$python" -m specserve.cli train-drafter --device "${DEVICE:-cuda}" --target-model-path "$target" \
    --data "$work/all3.jsonl.gz" --out "$work/drafter" --work-dir "$work" --features-dir "$work/features" \
    --algorithm dspark --block-size 8 --draft-vocab 8192 --markov-rank 64 --batch-size 16 --anchors 0 --lr 1e-3 \
    --loss-ce 0.5 --loss-dist 0.5 --loss-decay 2 --warmup-ratio 0.002 --time-budget 4m --max-steps 100000 \
    --save-every 1000000 --eval-prompts 0 "$@" 2>&1 | tee "$out/train.log"
cp "$work"/drafter/README.md "$work"/drafter/config.json "$work"/held_out.json "$out"/
split -b 15M "$work/drafter/model.safetensors" "$out/model.safetensors.part-"
gzip -c "$work/train_log.jsonl" > "$out/train_log.jsonl.gz"
