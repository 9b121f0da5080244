#!/usr/bin/env bash
# The CPU demo: install (or reuse .venv), then train a tiny Qwen3 with Titans memory on BABILong QA1 on the CPU
# and evaluate it with and without the memory. Writes outputs/demo/. Extra arguments go to `titans-hf demo`
# (e.g. --model Qwen/Qwen2.5-0.5B, --output-dir DIR, --seed N; --help lists them). A rerun replaces the folder an
# earlier demo wrote (--overwrite), never a folder it did not write whole.
set -euo pipefail
started=$SECONDS
# the package alone (the demo needs no extra), named explicitly: a sourced script would otherwise read this
# script's own arguments as its extras
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" ""
# two kinds of English prose (scripture, technical documentation) that the training rows' haystacks mix with the
# built-in prose, so that the memory learns to write little on prose it has not seen; fetched once into
# outputs/haystacks (the novel and the Markov prose there are kept for evaluation: scripts/bench_length.py --haystack)
.venv/bin/python scripts/fetch_haystacks.py --cache outputs/haystacks --sources web_bible docutils
echo "environment ready in $((SECONDS - started))s"
.venv/bin/titans-hf demo --overwrite --haystack outputs/haystacks/web_bible outputs/haystacks/docutils "$@"
echo "demo.sh finished in $((SECONDS - started))s (install included)"
