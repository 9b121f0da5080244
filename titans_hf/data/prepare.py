"""Raw text -> token stores (`titans-hf prepare` and `prepare()`).

Inputs, per train type (one record per `.jsonl` line or `datasets` row; a `.txt` file is one document):

- `seq`:  `.txt` files, or a text field (`text` by default)
- `sft`:  one of, detected per record (`SFT_FORMATS`; a field holding None counts as absent):
          `messages` (a chat: `[{"role", "content"}, ...]`), `prompt` + `completion` (TRL's
          prompt-completion), `prompt` + `response`  -> `sequence`, `loss_mask` (1 on what the
          model should learn to write: the completion/response, or the assistant turns)
- `dpo`:  `chosen`, `rejected` (+ `prompt`) -> `chosen`, `rejected`, `chosen_mask`, `rejected_mask`
                                              (the prompt, when given, leads both with mask 0)
- `grpo`: `prompt`, `responses`, `rewards` -> `prompts`, `responses`, `masks`, `rewards` (float32);
          at least one response per group, rewards finite and within +-`MAX_ABS_REWARD` (1e9: beyond it
          GRPO's group mean and standard deviation can overflow in float32; see `titans_hf.data.stores`)

Text is encoded without special tokens by the `AutoTokenizer` named (batched, optionally over
`num_proc` processes); EOS ends every document, response and completion, so documents of one
token stream stay separated. A chat is rendered by the tokenizer's chat template instead, which
writes its own turn markers (no EOS is added): see `chat_tokens` for how the assistant turns are
found. Ids are stored as uint16 when the vocabulary fits, else uint32.

Outputs are written under temporary names and renamed only when complete; with `shard_tokens`
they are split at record boundaries into `name-00000-of-00003.h5` style shards. Before any work,
every output path is checked: `overwrite=True` replaces only a store prepare wrote (judged by
its layout, `replaceable_store_problem`), never a folder of other files, and no output may be or
hold an input of the same call. Input files are only ever read.
"""

from __future__ import annotations

import codecs
import collections
import functools
import json
import multiprocessing
import re
from multiprocessing.pool import ThreadPool
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from titans_hf.data.stores import (
    MAX_ABS_REWARD,
    STORE_WRITERS,
    StoreWriter,
    key_kind,
    output_format,
    replaceable_store_problem,
    token_dtype,
    tokenizer_fingerprint,
)
from titans_hf.data.tokenizers import chat_template_problem, check_tokenizer_argument
from titans_hf.data.windows import TRAIN_TYPE_KEYS
from titans_hf.files import MAX_TEXT_CHARACTERS_VARIABLE, disk_full_message, max_text_characters
from titans_hf.outputs import check_can_create, replace_outputs

RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    "seq": ("text",),
    "dpo": ("chosen", "rejected"),
    "grpo": ("prompt", "responses", "rewards"),
}
# The record formats sft accepts, by the fields that make each one.
SFT_FORMATS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "prompt-completion": ("prompt", "completion"),
    "prompt-response": ("prompt", "response"),
}
INPUT_SUFFIXES = (".txt", ".jsonl")
# `{% generation %}` blocks mark what the assistant writes (transformers' return_assistant_tokens_mask).
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Long documents are encoded in pieces of about this many characters, cut right after a newline
# that precedes a letter or digit: a point where byte-level BPE pre-tokenizers (GPT-2, Qwen,
# Llama 3) always split, so the ids equal those of encoding the document whole. `_cuts_are_exact`
# checks that on the tokenizer at hand and keeps documents whole when it does not hold.
PIECE_CHARS = 1 << 16
_SAFE_CUT = re.compile(r"\n(?=[^\W_])")
_CUT_PROBES = (("Hello world.\n", "The end"), ("a\n\n", "b c"), ("x \n", "9 y"), ("one\r\n", "Two"), ("é\n", "ü"))
_READ_CHARS = 1 << 20
# Stands for a special token's text written in a chat message, while the template renders (private-use code points).
_LITERAL = re.compile("\ue000(\\d+)\ue001")
# A batch also ends at this many characters, which bounds the memory of one tokenizer call.
BATCH_CHARS = 1 << 20


def _cuts_are_exact(tokenizer) -> bool:
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return all(encode(left + right) == encode(left) + encode(right) for left, right in _CUT_PROBES)


def _pieces(text_blocks: Iterable[str], cut: bool, where: str = "input") -> Iterator[str]:
    """Regroup a document's text into pieces of about PIECE_CHARS, cut only at safe points; a stretch of more than
    `max_text_characters()` without one is refused, naming `where` (longer documents go in `.txt` files or have line
    breaks: they are read in blocks and cut at safe points)."""
    limit = max_text_characters()
    buffer = ""
    for block in text_blocks:
        buffer += block
        while cut and len(buffer) >= PIECE_CHARS:
            match = _SAFE_CUT.search(buffer, PIECE_CHARS)
            if match is None:
                break
            yield buffer[: match.end()]
            buffer = buffer[match.end() :]
        if len(buffer) > limit:
            raise ValueError(f"{where}: more than {limit} characters without a line break where the text can be cut; "
                             "tokenizing it whole would take gigabytes of memory: break the text into lines (or set "
                             f"${MAX_TEXT_CHARACTERS_VARIABLE})")
    if buffer:
        yield buffer


def _utf8_problem(path: Path) -> str:
    """Where `path` stops being UTF-8 (line and byte), found by decoding it again as bytes; for error messages."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0
    with open(path, "rb") as handle:
        while block := handle.read(_READ_CHARS):
            pending = len(decoder.getstate()[0])  # bytes of a character the previous block began
            try:
                decoder.decode(block)
            except UnicodeDecodeError as error:
                position = offset - pending + error.start
                line = newlines + block[: max(position - offset, 0)].count(b"\n") + 1
                return f"{path}:{line}: not valid UTF-8 (byte {position}: {error.reason}); input text must be UTF-8"
            offset += len(block)
            newlines += block.count(b"\n")
    return f"{path}: not valid UTF-8 (it ends inside a character); input text must be UTF-8"


def _read_blocks(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            while block := handle.read(_READ_CHARS):
                yield block
    except UnicodeDecodeError as error:
        raise ValueError(_utf8_problem(path)) from error


def _usable_reward(reward: float) -> bool:
    """Whether a reward is finite and within +-MAX_ABS_REWARD, where GRPO's advantages cannot overflow (NaN, infinities,
    3e38, which float32 holds but two of which sum to inf, and integers too large for a float are not)."""
    return -MAX_ABS_REWARD <= reward <= MAX_ABS_REWARD  # NaN compares false; an int of any size compares exactly


def _string_fields(record: dict[str, Any], fields: Iterable[str], where: str) -> None:
    for field in fields:
        if not isinstance(record[field], str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")


def _sft_record(record: dict[str, Any], where: str, tokenizer_name: str, chat_template: bool) -> dict[str, Any]:
    """The sft unit of `record`: `{prompt, response}` for either text format, `{messages, where}` for a chat."""
    present = {field for fields in SFT_FORMATS.values() for field in fields if record.get(field) is not None}
    formats = [name for name, fields in SFT_FORMATS.items() if present.issuperset(fields)]
    if not formats:
        expected = " or ".join(str(list(fields)) for fields in SFT_FORMATS.values())
        raise ValueError(f"{where}: an sft record needs the fields {expected}; it has {sorted(record)}")
    if len(formats) > 1:
        raise ValueError(f"{where}: the record has the fields of several sft formats {formats}; keep one")
    if formats[0] != "chat":
        answer = SFT_FORMATS[formats[0]][1]
        _string_fields(record, ("prompt", answer), where)
        return {"prompt": record["prompt"], "response": record[answer]}
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: message {index} must be an object with string 'role' and 'content', got {message!r:.80}")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where}: the chat has no 'assistant' message, so nothing in it would carry loss")
    if not chat_template:
        raise ValueError(
            f"{where}: a chat record ('messages') is rendered with the tokenizer's chat template, but tokenizer "
            f"{tokenizer_name!r} has none (tokenizer.chat_template is unset); set one and save the tokenizer, "
            "or write prompt/completion records"
        )
    return {"messages": messages, "where": where}


def _check_record(
    record: Any, train_type: str, text_field: str, where: str, tokenizer_name: str = "", chat_template: bool = False
) -> dict[str, Any]:
    """The record as an encoding unit, after checking it has what `train_type` needs (errors name `where`)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if train_type == "sft":
        return _sft_record(record, where, tokenizer_name, chat_template)
    fields = (text_field,) if train_type == "seq" else RECORD_FIELDS[train_type]
    missing = [field for field in fields if field not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing} that train_type {train_type!r} needs")
    strings = {"seq": fields, "dpo": (*fields, *(["prompt"] if "prompt" in record else [])), "grpo": ("prompt",)}[train_type]
    _string_fields(record, strings, where)
    if train_type == "grpo":
        responses, rewards = record["responses"], record["rewards"]
        if not isinstance(responses, list) or not all(isinstance(response, str) for response in responses):
            raise ValueError(f"{where}: field 'responses' must be a list of strings")
        if not responses:
            raise ValueError(f"{where}: field 'responses' is empty; a grpo group needs at least one response")
        if not isinstance(rewards, list) or not all(
            isinstance(reward, (int, float)) and not isinstance(reward, bool) for reward in rewards
        ):
            raise ValueError(f"{where}: field 'rewards' must be a list of numbers")
        if not all(_usable_reward(reward) for reward in rewards):
            raise ValueError(f"{where}: field 'rewards' holds {rewards!s:.200}; rewards must be finite numbers in "
                             f"[{-MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}] (larger ones overflow GRPO's advantages in "
                             "float32)")
        if len(rewards) != len(responses):
            raise ValueError(f"{where}: {len(responses)} responses but {len(rewards)} rewards")
    return record


def _input_paths(inputs: Any) -> list[Path] | None:
    """The input files, or None when `inputs` is a dataset."""
    if isinstance(inputs, (str, Path)):
        return [Path(inputs)]
    if isinstance(inputs, (list, tuple)) and all(isinstance(item, (str, Path)) for item in inputs):
        return [Path(item) for item in inputs]
    return None


def _check_input_files(paths: list[Path], train_type: str) -> None:
    """Refuse, before any work, an input that is missing, not a file, or of a kind `train_type` cannot read."""
    for path in paths:
        if path.is_dir():
            raise ValueError(f"{path}: is a directory; pass the .txt/.jsonl files inside it")
        if not path.is_file():
            if path.exists():  # a FIFO, a socket, a device: a read would block or never end
                raise ValueError(f"{path}: not a regular file (a FIFO, socket or device); pass a .txt or .jsonl file")
            raise FileNotFoundError(f"{path}: input file not found")
        if path.suffix not in INPUT_SUFFIXES:
            raise ValueError(f"{path}: unsupported input; use .txt or .jsonl files, or a datasets.Dataset")
        if path.suffix == ".txt" and train_type != "seq":
            raise ValueError(f"{path}: a .txt file is one plain document; train_type {train_type!r} needs .jsonl")


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with open(path, encoding="utf-8") as handle:
            limit = max_text_characters()
            for line_number, line in enumerate(iter(lambda: handle.readline(limit + 1), ""), start=1):
                if len(line) > limit and not line.endswith("\n"):
                    raise ValueError(f"{path}:{line_number}: the line is longer than {limit} characters, more than "
                                     "one record should hold (tokenizing it would take gigabytes of memory); put a "
                                     f"long document in a .txt file, which is read in blocks (or set "
                                     f"${MAX_TEXT_CHARACTERS_VARIABLE})")
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from error
                except RecursionError:
                    raise ValueError(f"{path}:{line_number}: JSON nested too deeply to read (more levels of "
                                     "arrays or objects than Python's parser takes); a record is an object of "
                                     "texts") from None
                yield f"{path}:{line_number}", record
    except UnicodeDecodeError as error:
        raise ValueError(_utf8_problem(path)) from error


def _records(inputs: Any) -> Iterator[tuple[str, Any]]:
    """(where, record) pairs; `where` names the file and line (or row) for error messages.

    A `.txt` file's record is its path: the document is read in blocks, never whole.
    """
    paths = _input_paths(inputs)
    if paths is None:
        for row_number, row in enumerate(inputs):
            yield f"dataset row {row_number}", row
        return
    for path in paths:
        if path.suffix == ".txt":
            yield str(path), path
        else:
            yield from _jsonl_records(path)


def _unit_chars(unit: dict[str, Any]) -> int:
    """Characters of text in a record unit: its string fields, or the contents of a chat's messages."""
    if "messages" in unit:
        return sum(len(message["content"]) for message in unit["messages"])
    return sum(len(value) for value in unit.values() if isinstance(value, str))


def _units(
    inputs: Any, train_type: str, text_field: str, cut: bool, tokenizer_name: str = "", chat_template: bool = False
) -> Iterator[tuple[Any, int]]:
    """Units of encoding work and their character counts (for progress).

    `seq` documents become `(piece, ends_document)` pairs so long documents stream through in
    pieces; the other types keep a record whole (its parts must stay aligned).
    """
    for where, record in _records(inputs):
        if isinstance(record, Path):
            blocks: Iterable[str] = _read_blocks(record)
        else:
            record = _check_record(record, train_type, text_field, where, tokenizer_name, chat_template)
            if train_type != "seq":
                yield record, _unit_chars(record)
                continue
            blocks = [record[text_field]]
        previous = None
        for piece in _pieces(blocks, cut, where):
            if previous is not None:
                yield (previous, False), len(previous)
            previous = piece
        if previous is not None:  # an empty document adds nothing, not a lone EOS
            yield (previous, True), len(previous)


_worker_tokenizer = None


def _load_tokenizer(name: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(name), trust_remote_code=False)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{name}: tokenizer has no eos token; prepare ends every document with one")
    return tokenizer


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = _load_tokenizer(tokenizer_name)


def _escape_literals(messages: list[dict[str, Any]], special: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with every special token's text in their contents replaced by a placeholder, and the texts
    replaced (placeholder i stands for literals[i]); ([], []) untouched when no content holds one."""
    found = [token for token in special if token and any(token in message["content"] for message in messages)]
    if not found:
        return messages, []
    pattern = re.compile("|".join(re.escape(token) for token in sorted(found, key=len, reverse=True)))
    literals: list[str] = []

    def placeholder(match: re.Match) -> str:
        literals.append(match.group(0))
        return f"\ue000{len(literals) - 1}\ue001"

    return [{**message, "content": pattern.sub(placeholder, message["content"])} for message in messages], literals


def _encode_with_literals(tokenizer, text: str, literals: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, character offsets) of `text` rendered with placeholders: the template's own text as usual (its special
    tokens are control tokens), each placeholder as the plain text it stands for (`split_special_tokens`), so
    what a user wrote never becomes a turn marker. A placeholder's tokens all carry its span in `text`."""
    pieces, position = [], 0
    for match in _LITERAL.finditer(text):
        pieces += [(text[position : match.start()], position, None), (literals[int(match.group(1))], match.start(),
                                                                      match.end())]
        position = match.end()
    pieces.append((text[position:], position, None))
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for piece, start, end in pieces:
        if not piece:
            continue
        encoded = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True,
                            split_special_tokens=end is not None)
        ids += encoded["input_ids"]
        offsets += ([(start, end)] * len(encoded["input_ids"]) if end is not None
                    else [(start + a, start + b) for a, b in encoded["offset_mapping"]])
    return np.array(ids, np.int64), np.array(offsets, np.int64).reshape(-1, 2)


def _render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer, messages: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns, found by rendering prefixes.

    For assistant message i, the text of `messages[:i]` with the generation prompt ends where the
    reply begins, and the text of `messages[:i + 1]` ends after the turn; both must be prefixes of
    the whole conversation's text (a template that renders earlier turns differently once the
    conversation goes on is refused). The span runs from the reply's start through the last
    special token the turn holds (its end-of-turn marker, e.g. `<|im_end|>`), leaving out what the
    template writes after it (a newline); a turn without one is labelled to its end.
    """
    full = _render(tokenizer, messages, False)
    special = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = _render(tokenizer, messages[:index], True), _render(tokenizer, messages[: index + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(
                f"{where}: the chat template of tokenizer {tokenizer.name_or_path!r} renders message {index} (assistant) "
                "differently once the conversation goes on, so its tokens cannot be found by rendering prefixes; "
                "use a template that marks assistant text with {% generation %} ... {% endgeneration %} (as TRL's "
                "training templates do)"
            )
        reply = through[len(before) :]
        end = max((reply.rfind(token) + len(token) for token in special if token and token in reply), default=len(reply))
        spans.append((len(before), len(before) + end))
    return full, spans


def chat_tokens(tokenizer, messages: list[dict[str, Any]], where: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a conversation rendered by the tokenizer's chat template, and a mask that is 1 on assistant turns.

    The labelled tokens are, per assistant turn, its content and the template's end-of-turn token
    (TRL's `assistant_only_loss`). A template with `{% generation %}` blocks says itself which
    text that is (transformers' `return_assistant_tokens_mask`); for any other template the turns
    are found by rendering prefixes of the conversation (`_assistant_spans`), and every token whose
    characters overlap a turn's span (offsets of a fast tokenizer) is labelled. The ids are those
    of the rendered text tokenized without added special tokens, as `apply_chat_template` has them.
    """
    from jinja2 import TemplateError

    special = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    escaped, literals = _escape_literals(messages, special)
    try:
        if _GENERATION_TAG.search(tokenizer.get_chat_template()) and not literals:
            encoded = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = np.array(encoded["input_ids"], np.int64), np.array(encoded["assistant_masks"], np.uint8)
        else:
            text, spans = _assistant_spans(tokenizer, escaped, where)
            ids, offsets = _encode_with_literals(tokenizer, text, literals)
            mask = np.zeros(len(offsets), np.uint8)
            for start, stop in spans:
                mask |= (offsets[:, 0] < stop) & (offsets[:, 1] > start)
    except TemplateError as error:
        raise ValueError(f"{where}: the chat template of tokenizer {tokenizer.name_or_path!r} failed: {error}") from error
    if not mask.any():
        raise ValueError(f"{where}: the chat template of tokenizer {tokenizer.name_or_path!r} marks no assistant tokens")
    return ids, mask


def _encode_batch(batch: tuple[str, list[Any], int], tokenizer=None) -> tuple[list[dict[str, Any]], int]:
    """Encode a batch of units with one batched tokenizer call; return store segments per unit."""
    train_type, units, chars = batch
    tokenizer = tokenizer or _worker_tokenizer
    texts: list[str] = []

    def take(text: str) -> int:
        texts.append(text)
        return len(texts) - 1

    if train_type == "seq":
        plans = [take(piece) for piece, _ in units]
    elif train_type == "sft":
        plans = [
            chat_tokens(tokenizer, unit["messages"], unit["where"]) if "messages" in unit
            else (take(unit["prompt"]), take(unit["response"]))
            for unit in units
        ]
    elif train_type == "dpo":
        plans = [
            (take(unit["prompt"]) if "prompt" in unit else None, take(unit["chosen"]), take(unit["rejected"]))
            for unit in units
        ]
    else:
        plans = [(take(unit["prompt"]), [take(response) for response in unit["responses"]]) for unit in units]
    # split_special_tokens: a document that writes "<|endoftext|>" or "<|im_end|>" holds that text, not the token
    ids = tokenizer(texts, add_special_tokens=False, split_special_tokens=True,
                    return_attention_mask=False)["input_ids"] if texts else []
    eos = np.array([tokenizer.eos_token_id], dtype=np.int64)

    def tokens(index: int | None, end: bool = False) -> np.ndarray:
        array = np.array(ids[index] if index is not None else [], dtype=np.int64)
        return np.concatenate([array, eos]) if end else array

    def labelled(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(answer), np.uint8)])
        return np.concatenate([prompt, answer]), mask

    encoded = []
    for unit, plan in zip(units, plans):
        if train_type == "seq":
            encoded.append({"sequence": tokens(plan, end=unit[1]), "ends_document": unit[1]})
        elif train_type == "sft":
            sequence, mask = plan if "messages" in unit else labelled(tokens(plan[0]), tokens(plan[1], end=True))
            encoded.append({"sequence": sequence, "loss_mask": mask})
        elif train_type == "dpo":
            prompt = tokens(plan[0])
            chosen, chosen_mask = labelled(prompt, tokens(plan[1], end=True))
            rejected, rejected_mask = labelled(prompt, tokens(plan[2], end=True))
            encoded.append(
                {"chosen": chosen, "chosen_mask": chosen_mask, "rejected": rejected, "rejected_mask": rejected_mask}
            )
        else:
            responses = [tokens(index, end=True) for index in plan[1]]
            encoded.append(
                {
                    "prompts": tokens(plan[0]),
                    "responses": responses,
                    "masks": [np.ones(len(response), np.uint8) for response in responses],
                    "rewards": np.asarray(unit["rewards"], dtype=np.float32),
                }
            )
    return encoded, chars


def _batches(units: Iterator[tuple[Any, int]], train_type: str, batch_size: int):
    """(train_type, units, characters) per batch: the characters advance the progress bar once written."""
    batch: list[Any] = []
    chars = 0
    for unit, unit_chars in units:
        batch.append(unit)
        chars += unit_chars
        if len(batch) >= batch_size or chars >= BATCH_CHARS:
            yield train_type, batch, chars
            batch, chars = [], 0
    if batch:
        yield train_type, batch, chars


def _ordered_map(pool, function, items: Iterable[Any], lookahead: int) -> Iterator[Any]:
    """`pool.imap` with at most `lookahead` batches in flight (imap would read the whole input ahead)."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(function, (item,)))
        if len(pending) >= lookahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _write_unit(writer: StoreWriter, encoded: dict[str, Any]) -> bool:
    """Write one encoded unit; return whether it finished a record (a safe place to start a new shard)."""
    if "ends_document" in encoded:
        writer.append("sequence", encoded["sequence"])
        if encoded["ends_document"]:
            writer.end_segment("sequence")
        return encoded["ends_document"]
    for key, values in encoded.items():
        for segment in values if isinstance(values, list) else [values]:
            writer.add_segment(key, segment)
    return True


def _shard_paths(output: Path, count: int) -> list[Path]:
    """`name.h5` -> `name-00000-of-00003.h5`, ...; a bin directory `name` -> `name-00000-of-00003`, ..."""
    if count == 1:
        return [output]
    return [output.with_name(_shard_name(output, f"{index:05d}", f"{count:05d}")) for index in range(count)]


def _stem_and_suffix(output: Path) -> tuple[str, str]:
    """`corpus.h5` -> (`corpus`, `.h5`); a bin directory keeps its whole name as the stem."""
    suffix = output.suffix if output_format(output) == "h5" else ""
    return output.name[: len(output.name) - len(suffix)], suffix


def _shard_name(output: Path, index: str, count: str) -> str:
    stem, suffix = _stem_and_suffix(output)
    return f"{stem}-{index}-of-{count}{suffix}"


def _protected_paths(inputs: Any) -> list[Path]:
    """What this call reads, resolved: its input files, or the Arrow files behind a `datasets.Dataset`."""
    paths = _input_paths(inputs)
    if paths is None:
        paths = [Path(entry["filename"]) for entry in getattr(inputs, "cache_files", None) or [] if "filename" in entry]
    return [path.resolve() for path in paths]


def _checked_outputs(output: Path, inputs: Any, overwrite: bool) -> list[Path]:
    """Check what lies at the outputs and return the paths this call would replace: `output` and its shards
    (`name-00000-of-00003...`) that exist.

    Refused (prepare checks before any work, and again just before it replaces anything): an
    output that is, or is a folder holding, an input of this call; an existing output without
    `overwrite`; and, with it, any that is not a store prepare wrote.
    """
    stem, suffix = _stem_and_suffix(output)
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}" + re.escape(suffix))
    siblings = sorted(path for path in output.parent.iterdir() if shard.fullmatch(path.name)) if output.parent.is_dir() else []
    existing = [path for path in [output, *siblings] if path.exists() or path.is_symlink()]
    protected = _protected_paths(inputs)
    for path in dict.fromkeys([output, *existing]):
        resolved = path.resolve()
        for source in protected:
            if source == resolved or source.is_relative_to(resolved):
                what = "an input" if source == resolved else f"a folder holding the input {source}"
                raise ValueError(f"{path}: the output is {what} of this call; choose another output")
    if existing and not overwrite:
        raise ValueError(f"{existing[0]}: output already exists; pass overwrite=True (--overwrite) to replace it")
    for path in existing:
        problem = replaceable_store_problem(path)
        if problem is not None:
            raise ValueError(
                f"{path}: will not replace it, even with overwrite: {problem}, so it is not a token store prepare wrote; "
                "remove it yourself or choose another output"
            )
    return existing


def prepare(
    inputs: str | Path | Sequence[str | Path] | Any,
    output: str | Path,
    tokenizer: str | Path,
    train_type: str = "seq",
    text_field: str = "text",
    num_proc: int = 1,
    batch_size: int = 256,
    shard_tokens: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Tokenize `inputs` into a store at `output` (`.h5` file, else a bin directory); return the paths written.

    `inputs`: `.txt`/`.jsonl` paths or a `datasets.Dataset`. `tokenizer`: a hub id or local path
    for `AutoTokenizer`. `shard_tokens`: start a new shard once one holds this many tokens.
    `overwrite`: replace an existing output, only if it is a store prepare wrote. Inputs and
    outputs are checked before the tokenizer is loaded; errors name the file (and line) at fault.
    """
    _check_arguments(train_type, num_proc, batch_size, shard_tokens)
    output = Path(output)
    paths = _input_paths(inputs)
    if paths is not None:
        _check_input_files(paths, train_type)
    _checked_outputs(output, inputs, overwrite)
    check_can_create(output)
    check_tokenizer_argument(tokenizer, "tokenizer (--tokenizer)")
    output.parent.mkdir(parents=True, exist_ok=True)

    tok = _load_tokenizer(tokenizer)
    template_problem = chat_template_problem(tok) if train_type == "sft" else None  # a template can loop for hours
    if template_problem is not None:
        raise ValueError(f"tokenizer {str(tokenizer)!r}: its chat template (tokenizer.chat_template): {template_problem}")
    dtypes, metadata = _store_layout(tok, str(tokenizer), train_type)
    new_writer = functools.partial(STORE_WRITERS[output_format(output)], output, dtypes, metadata)
    # File sizes in bytes bound the characters from above: the bar may stop a little short of 100%.
    total_chars = sum(path.stat().st_size for path in paths) if paths is not None else None
    progress = tqdm(total=total_chars, unit="char", unit_scale=True, desc=f"prepare {output.name}")
    units = _units(inputs, train_type, text_field, _cuts_are_exact(tok), str(tokenizer), bool(tok.chat_template))
    batches = _batches(units, train_type, batch_size)

    writers: list[StoreWriter] = []
    # With one process, a thread still encodes batch k+1 (the Rust tokenizer releases the GIL)
    # while this thread parses the input and writes batch k.
    if num_proc > 1:
        pool, encode = multiprocessing.Pool(num_proc, initializer=_init_worker, initargs=(str(tokenizer),)), _encode_batch
    else:
        pool, encode = ThreadPool(1), functools.partial(_encode_batch, tokenizer=tok)
    try:
        encoded_batches = _ordered_map(pool, encode, batches, lookahead=2 * num_proc)
        finished = _write_stores(encoded_batches, new_writer, shard_tokens, progress, writers)
        if not finished:
            raise ValueError(f"{inputs}: no records to prepare (all inputs empty)")
        targets = _shard_paths(output, len(finished))
        # Checked again: what lies at the outputs may have changed while the inputs were encoded.
        replace_outputs(finished, targets, _checked_outputs(output, inputs, overwrite))
        return targets
    except BaseException as error:
        for writer in writers:
            writer.abort()
        message = disk_full_message(error, f"prepare {output}") if isinstance(error, OSError) else None
        if message:
            raise OSError(error.errno, message) from error
        raise
    finally:
        progress.close()
        pool.terminate()
        pool.join()


def _check_arguments(train_type: str, num_proc: int, batch_size: int, shard_tokens: int | None) -> None:
    """`prepare`'s settings other than its inputs and outputs, each refused naming it."""
    if train_type not in TRAIN_TYPE_KEYS:
        raise ValueError(f"train_type must be one of {list(TRAIN_TYPE_KEYS)}, got {train_type!r}")
    for name, value in (("num_proc", num_proc), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if shard_tokens is not None and (not isinstance(shard_tokens, int) or shard_tokens < 1):
        raise ValueError(f"shard_tokens must be a positive integer or None, got {shard_tokens!r}")


def _store_layout(tok, tokenizer_name: str, train_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dtype of each key of `train_type`'s stores (ids in the smallest dtype the vocabulary fits) and the
    metadata they record of the tokenizer."""
    vocab_size = len(tok)
    ids_dtype = token_dtype(vocab_size)
    dtypes = {
        key: {"float": np.float32, "mask": np.uint8, "token": ids_dtype}[key_kind(key)] for key in TRAIN_TYPE_KEYS[train_type]
    }
    metadata = {
        "train_type": train_type,
        "tokenizer": tokenizer_name,
        "vocab_size": vocab_size,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
    }
    return dtypes, metadata


def _write_stores(encoded_batches: Iterable[tuple[list[dict[str, Any]], int]], new_writer: Callable[[], StoreWriter],
                  shard_tokens: int | None, progress: tqdm, writers: list[StoreWriter]) -> list[Path]:
    """Write the encoded records in order into stores from `new_writer`, a new one once a store holds `shard_tokens`
    tokens (at a record boundary); each writer is added to `writers` as it opens, so that a failure aborts them all.
    Returns the finished stores' temporary paths."""
    finished: list[Path] = []
    writer = None
    for encoded_batch, chars in encoded_batches:
        for encoded in encoded_batch:
            if writer is None:
                writer = new_writer()
                writers.append(writer)
            if _write_unit(writer, encoded) and shard_tokens is not None and writer.num_tokens >= shard_tokens:
                finished.append(writer.finish())
                writer = None
        progress.update(chars)
    if writer is not None:
        finished.append(writer.finish())
    return finished
