#!/usr/bin/env sh
# Run a command on the GPU host (device tool) with the offline vLLM 0.25.1 bundle and minipic
# discoverable as a vLLM plugin, as `pip install minipic` would make it (the host has no network).
#   carry: [".bundle"]   command: tools/gpu_run.sh python3 tools/bench_ttft.py --out $OUT/ttft.json
set -eu
site=/tmp/minipic-entry-point
mkdir -p "$site/minipic-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: minipic\nVersion: 0.1.0\n' > "$site/minipic-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\nminipic = minipic.plugin:register\n' \
    > "$site/minipic-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$site:$PWD:${PYTHONPATH:-}"
exec .bundle/run_with_bundle.sh .bundle/vllm-0.25.1-sm90.tar.xz "$@"
