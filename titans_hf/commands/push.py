"""`titans-hf push`: upload a memory folder (weights, config, model card) to a Hub model repository."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from titans_hf.hub import push_memory_folder
from titans_hf.modeling import TitansQwenForCausalLM


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "push",
        help="upload a trained memory (weights, config, model card) to the Hugging Face Hub",
        # No --token: a token typed on the command line ends up in shell history.
        description="Share a trained memory the way PEFT adapters are shared: its weights, its config and a model "
        "card with your evaluation results go to a Hub model repository (never the base, the optimizer or the "
        "training arguments); anyone then loads it with AutoModelForCausalLM.from_pretrained(REPO_ID). The token "
        "comes from HF_TOKEN or `hf auth login`.",
    )
    parser.add_argument("folder", help="memory folder written by save_pretrained or titans-hf train")
    parser.add_argument("repo_id", help="Hub model repository, e.g. your-name/qwen-titans-memory")
    parser.add_argument("--base-model", default=None,
                        help="the base's Hub id, when the memory was trained on a local copy of it")
    parser.add_argument("--base-revision", default=None, help="the base's revision on the Hub (with --base-model)")
    parser.add_argument("--dataset", nargs="+", default=None, help="Hub ids of the datasets trained on, for the card")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    parser.add_argument("--results", default=None, help="evaluation JSON from `titans-hf eval` for the card's table")
    parser.add_argument("--commit-message", default=None)
    parser.set_defaults(func=push_command)


def push_command(args: argparse.Namespace) -> int:
    results = None
    if args.results is not None:
        try:
            results = json.loads(Path(args.results).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{args.results}: not valid JSON ({error})") from error
    commit_url = push_memory_folder(
        args.folder,
        args.repo_id,
        endpoint=args.endpoint,
        private=args.private,
        commit_message=args.commit_message,
        results=results,
        datasets=args.dataset,
        base_model=args.base_model,
        revision=args.base_revision,
        check_weights=TitansQwenForCausalLM.check_memory_weights,
    )
    print(commit_url)
    return 0
