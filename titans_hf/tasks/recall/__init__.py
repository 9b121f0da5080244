"""Recall: long documents of ordinary prose in which facts stated early ("Captain Orlen's horse was called
Tamsin.") are needed many chunks later ("Orlen saddled Tamsin ..."), the corpus on which a memory must matter.

`generate` writes the documents (seeded, offline) with the character spans of each statement and of each recalled
value; `files` writes them as `.jsonl` for `titans-hf prepare` and builds an `sft`-type evaluation store whose
loss mask marks the tokens that depend on an earlier statement; `toy_base` pretrains a toy Qwen3 base, the
offline base of `scripts/recall.sh`.
"""

from .files import (
    build_recall_eval_store,
    encode_document,
    read_recall_jsonl,
    span_token_mask,
    write_recall_jsonl,
)
from .generate import (
    ATTRIBUTES,
    DEFAULT_PEOPLE,
    DEFAULT_POOL_SIZE,
    PEOPLE,
    TITLES,
    VALUE_POOL,
    RecallDocument,
    Reference,
    Statement,
    generate_document,
    generate_recall,
    glossary_document,
    glossary_sentence,
    iter_recall_documents,
    name_meaning,
    parse_statement,
    people_pool,
    token_counter,
    value_pool,
)

__all__ = [
    "ATTRIBUTES",
    "DEFAULT_PEOPLE",
    "DEFAULT_POOL_SIZE",
    "PEOPLE",
    "TITLES",
    "VALUE_POOL",
    "RecallDocument",
    "Reference",
    "Statement",
    "build_recall_eval_store",
    "encode_document",
    "generate_document",
    "generate_recall",
    "glossary_document",
    "glossary_sentence",
    "iter_recall_documents",
    "name_meaning",
    "parse_statement",
    "people_pool",
    "read_recall_jsonl",
    "span_token_mask",
    "token_counter",
    "value_pool",
    "write_recall_jsonl",
]
