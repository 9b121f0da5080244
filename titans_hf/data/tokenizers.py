"""Tokenizer helpers of the data code: the id to pad with, a tokenizer argument checked before anything loads,
and a fast tokenizer's backend without the truncation or padding earlier calls left in it."""

from __future__ import annotations

import json
import multiprocessing
import os
import weakref
from pathlib import Path
from typing import Any


def resolve_pad_token_id(tokenizer: Any = None, config: Any = None) -> int:
    """The id to pad with: the tokenizer's pad token, else its EOS (Qwen base tokenizers have no pad token), else
    the model config's pad, else its EOS. Raises ValueError naming what was looked at when none is an int."""
    candidates = [getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                  getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)]
    for candidate in candidates:
        if isinstance(candidate, list) and candidate:  # generation configs may list several EOS ids
            candidate = candidate[0]
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            return candidate
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    raise ValueError(f"no pad token id: tokenizer {name!r} has neither a pad nor an EOS token, and the model config "
                     "names none either; set tokenizer.pad_token")


def check_tokenizer_argument(name: str | os.PathLike, flag: str) -> None:
    """Refuse, before anything loads, a tokenizer (or model) argument that is neither an existing path nor a Hub
    id, naming `flag`: a missing local path otherwise surfaces as the Hub client's "Repo id must be in the
    form..." error."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(name).exists():
        return
    try:
        validate_repo_id(str(name))
    except HFValidationError:
        raise FileNotFoundError(f"{flag} {name}: no such file or folder (and not a Hub repository id)") from None
    if str(name).startswith((".", "~", os.sep)):
        raise FileNotFoundError(f"{flag} {name}: no such file or folder")


def plain_backend_tokenizer(tokenizer: Any):
    """The fast tokenizer's Rust backend without truncation or padding, whatever state earlier calls left in it.

    A call like ``tokenizer(texts, truncation=True, max_length=n)`` leaves the backend truncating (and
    ``save_pretrained`` records it in tokenizer.json); code that encodes through the backend directly would then see
    cut encodings. A backend in that state is copied once per state and the copy's truncation and padding are
    switched off; the caller's tokenizer is never changed.
    """
    backend = tokenizer.backend_tokenizer
    if backend.truncation is None and backend.padding is None:
        return backend
    key = (id(backend), json.dumps([backend.truncation, backend.padding], sort_keys=True, default=str))
    plain = _PLAIN_BACKENDS.get(tokenizer)
    if plain is None or plain[0] != key:
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()
        copy.no_padding()
        plain = _PLAIN_BACKENDS[tokenizer] = (key, copy)
    return plain[1]


_PLAIN_BACKENDS: "weakref.WeakKeyDictionary[Any, tuple[tuple[int, str], Any]]" = weakref.WeakKeyDictionary()


# The most seconds a chat template may take to render a one-message chat (a real one takes milliseconds).
CHAT_TEMPLATE_SECONDS = 1.0
CHAT_TEMPLATE_PROBE = [{"role": "user", "content": "Where is Mary?"}]


def _render_probe(tokenizer: Any, connection: Any) -> None:
    """Render the probe chat with `tokenizer`'s template and send None, or why it failed, through `connection`."""
    try:
        tokenizer.apply_chat_template(CHAT_TEMPLATE_PROBE, tokenize=False, add_generation_prompt=True)
        connection.send(None)
    except Exception as error:  # noqa: BLE001 (any failure of a template is reported, as a message)
        connection.send(f"{type(error).__name__}: {error}")


def chat_template_problem(tokenizer: Any, seconds: float = CHAT_TEMPLATE_SECONDS) -> str | None:
    """None when `tokenizer` has no chat template or renders a one-message chat within `seconds`, else why not.
    Rendered in a child process (forked where the platform can), killed when it runs past `seconds`."""
    if not tokenizer.chat_template:
        return None
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else methods[0])
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_render_probe, args=(tokenizer, sender), daemon=True)
    process.start()
    finished = receiver.poll(seconds)
    if not finished:
        process.kill()
    process.join()
    if not finished:
        return f"it does not render a one-message chat within {seconds:g} s"
    failure = receiver.recv()
    return None if failure is None else f"it does not render a one-message chat ({failure})"
