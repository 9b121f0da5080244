"""`prepare(train_type="sft")` with the record formats users have: chat `messages`, prompt/completion, prompt/response.

Loss positions are checked against hand-counted token positions on a word-level tokenizer whose ids
are known, and against transformers' own `return_assistant_tokens_mask` on a byte-level BPE one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from titans_hf.commands import main
from titans_hf.data.prepare import prepare
from titans_hf.data.stores import open_store

# Word-level vocabulary: every id below is known by heart.
WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\n", "user", "assistant", "system", "where", "is", "mary",
         "kitchen", "john", "office", "be", "brief", "[UNK]"]
START, END, NEWLINE, USER, ASSISTANT, SYSTEM = 1, 2, 3, 4, 5, 6
WHERE, IS, MARY, KITCHEN, JOHN, OFFICE, BE, BRIEF = 7, 8, 9, 10, 11, 12, 13, 14

# A ChatML template as Qwen2.5 writes it (no generation tags): each turn ends with <|im_end|> and a newline.
CHATML = (
    r"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same rendering, with the assistant's content and end-of-turn marked as TRL's training templates mark them.
CHATML_GENERATION = (
    r"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    r"{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    r"{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Like Qwen3's: the final assistant turn gets an (empty) thinking block that earlier turns lose once the chat goes on.
THINKING_LAST = (
    r"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    r"{% if message['role'] == 'assistant' and loop.last %}{{ 'be\n' }}{% endif %}"
    r"{{ message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# No special token ends a turn: a turn's label runs to its end, the newline included.
PLAIN = (
    r"{% for message in messages %}{{ message['role'] + '\n' + message['content'] + '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ 'assistant\n' }}{% endif %}"
)

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "where is mary"},
    {"role": "assistant", "content": "kitchen"},
    {"role": "user", "content": "where is john"},
    {"role": "assistant", "content": "office"},
]
# CHAT rendered by CHATML, token by token (the positions in the comments):
CHAT_IDS = [
    START, SYSTEM, NEWLINE, BE, BRIEF, END, NEWLINE,                      # 0-6
    START, USER, NEWLINE, WHERE, IS, MARY, END, NEWLINE,                  # 7-14
    START, ASSISTANT, NEWLINE, KITCHEN, END, NEWLINE,                     # 15-20: kitchen, <|im_end|> at 18, 19
    START, USER, NEWLINE, WHERE, IS, JOHN, END, NEWLINE,                  # 21-28
    START, ASSISTANT, NEWLINE, OFFICE, END, NEWLINE,                      # 29-34: office, <|im_end|> at 32, 33
]
CHAT_LOSS_POSITIONS = [18, 19, 32, 33]


def word_tokenizer(path: Path, chat_template: str | None) -> Path:
    """A word-level tokenizer over WORDS (spaces dropped, newlines kept as tokens), saved with `chat_template`."""
    model = Tokenizer(models.WordLevel({word: index for index, word in enumerate(WORDS)}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Split(" ", "removed")])
    model.add_special_tokens([AddedToken(token, special=True) for token in WORDS[:3]])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def positions(mask) -> list[int]:
    return [index for index, value in enumerate(mask) if value]


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["prefix-diff", "generation-tags"])
@pytest.mark.parametrize("output_name", ["chat_bin", "chat.h5"])
def test_chat_loss_covers_assistant_content_and_end_of_turn_only(tmp_path, template, output_name):
    tokenizer = word_tokenizer(tmp_path / "tok", template)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    before = digest(source)
    [path] = prepare(source, tmp_path / output_name, tokenizer, train_type="sft")
    with open_store(path) as store:
        assert store.segment("sequence", 0).tolist() == CHAT_IDS  # no EOS appended: the template ends the turn
        assert positions(store.segment("loss_mask", 0)) == CHAT_LOSS_POSITIONS
    assert digest(source) == before


def test_turn_without_a_special_end_token_is_labelled_to_its_end(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", PLAIN)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[1:3]}])
    [path] = prepare(source, tmp_path / "plain_bin", tokenizer, train_type="sft")
    store = open_store(path)
    # user \n where is mary \n assistant \n kitchen \n  -> kitchen (8) and the turn's newline (9)
    assert store.segment("sequence", 0).tolist() == [USER, NEWLINE, WHERE, IS, MARY, NEWLINE, ASSISTANT, NEWLINE, KITCHEN, NEWLINE]
    assert positions(store.segment("loss_mask", 0)) == [8, 9]


def test_formats_are_detected_per_record(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", CHATML)
    records = [
        {"prompt": "where is mary", "completion": "kitchen"},
        {"messages": CHAT[1:3]},
        {"prompt": "where is john", "response": "office", "id": 7},  # extra fields are fine
    ]
    [path] = prepare(write_jsonl(tmp_path / "mixed.jsonl", records), tmp_path / "mixed_bin", tokenizer, train_type="sft")
    store = open_store(path)
    eos = 0
    assert store.segment("sequence", 0).tolist() == [WHERE, IS, MARY, KITCHEN, eos]
    assert store.segment("loss_mask", 0).tolist() == [0, 0, 0, 1, 1]
    # <|im_start|> user \n where is mary <|im_end|> \n <|im_start|> assistant \n kitchen <|im_end|> \n
    assert store.segment("sequence", 1).tolist() == CHAT_IDS[7:21]
    assert positions(store.segment("loss_mask", 1)) == [11, 12]
    assert store.segment("sequence", 2).tolist() == [WHERE, IS, JOHN, OFFICE, eos]
    assert store.segment("loss_mask", 2).tolist() == [0, 0, 0, 1, 1]


def test_dataset_rows_with_none_in_the_other_formats_fields(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", CHATML)
    rows = datasets.Dataset.from_list([
        {"messages": CHAT[1:3], "prompt": None, "completion": None},
        {"messages": None, "prompt": "where is john", "completion": "office"},
    ])
    [path] = prepare(rows, tmp_path / "rows.h5", tokenizer, train_type="sft")
    store = open_store(path)
    assert positions(store.segment("loss_mask", 0)) == [11, 12]
    assert store.segment("sequence", 1).tolist() == [WHERE, IS, JOHN, OFFICE, 0]


def test_byte_level_tokenizer_matches_transformers_assistant_mask(tmp_path, tiny_tokenizer_dir):
    """On a BPE tokenizer (tokens cross word boundaries), prefix diffing labels what the generation tags label."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat = [{"role": "user", "content": "Where is Mary?"}, {"role": "assistant", "content": "Mary went to the kitchen."},
            {"role": "user", "content": "And John?"}, {"role": "assistant", "content": " office"}]
    tokenizer.chat_template = CHATML_GENERATION
    expected = tokenizer.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(tmp_path / "bpe")
    [path] = prepare(write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}]), tmp_path / "bpe_bin", tmp_path / "bpe",
                     train_type="sft")
    store = open_store(path)
    ids, mask = store.segment("sequence", 0).tolist(), store.segment("loss_mask", 0).tolist()
    assert ids == expected["input_ids"]
    assert mask == expected["assistant_masks"]
    labelled = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert labelled == "Mary went to the kitchen.<|im_end|> office<|im_end|>"


def test_tokenizer_without_chat_template_names_tokenizer_and_line(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", None)
    source = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "where is mary", "completion": "kitchen"}, {"messages": CHAT}])
    before = digest(source)
    with pytest.raises(ValueError, match=rf"sft.jsonl:2: a chat record .* tokenizer '{tokenizer}' has none"):
        prepare(source, tmp_path / "out_bin", tokenizer, train_type="sft")
    assert digest(source) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sft.jsonl", "tok"]  # no output, complete or not


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", THINKING_LAST)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(ValueError, match=r"chat.jsonl:1: the chat template .* renders message 2 \(assistant\) differently"):
        prepare(source, tmp_path / "out_bin", tokenizer, train_type="sft")
    assert not (tmp_path / "out_bin").exists()


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question": "where is mary"},
         r"rec.jsonl:1: an sft record needs the fields \['messages'\] or \['prompt', 'completion'\] or "
         r"\['prompt', 'response'\]; it has \['question'\]"),
        ({"prompt": "a", "completion": "b", "response": "c"},
         r"rec.jsonl:1: the record has the fields of several sft formats \['prompt-completion', 'prompt-response'\]"),
        ({"prompt": "a", "completion": ["b"]}, r"rec.jsonl:1: field 'completion' must be a string, got list"),
        ({"messages": []}, r"rec.jsonl:1: field 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         r"rec.jsonl:1: message 0 must be an object with string 'role' and 'content'"),
        ({"messages": CHAT[:2]}, r"rec.jsonl:1: the chat has no 'assistant' message"),
    ],
)
def test_bad_sft_records_name_file_line_and_fields(tmp_path, record, message):
    tokenizer = word_tokenizer(tmp_path / "tok", CHATML)
    source = write_jsonl(tmp_path / "rec.jsonl", [record])
    with pytest.raises(ValueError, match=message):
        prepare(source, tmp_path / "out.h5", tokenizer, train_type="sft")
    assert not (tmp_path / "out.h5").exists()


def test_console_command_prepares_chat_records(tmp_path, capsys):
    tokenizer = word_tokenizer(tmp_path / "tok", CHATML)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    output = tmp_path / "cli_bin"
    assert main(["prepare", str(source), "-o", str(output), "--tokenizer", str(tokenizer), "--train-type", "sft"]) == 0
    assert capsys.readouterr().out.strip() == str(output)
    assert positions(open_store(output).segment("loss_mask", 0)) == CHAT_LOSS_POSITIONS
