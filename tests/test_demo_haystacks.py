"""The demo's haystack sources: training rows shared out between the built-in prose and each source."""

from __future__ import annotations

from transformers import AutoTokenizer

from titans_hf.commands.demo_job import mixed_haystack_rows
from titans_hf.tasks.babilong import generate_babilong

RIVER = "".join(f"The river ran fast under stone bridge {i}. A heron stood in the reeds by bank {i}. "
                for i in range(40))
LEDGER = "".join(f"The clerk added column {i} twice before noon. Every receipt was filed under month {i}. "
                 for i in range(40))


def sources(tmp_path) -> tuple[str, str]:
    (tmp_path / "river.txt").write_text(RIVER, encoding="utf-8")
    (tmp_path / "ledger.txt").write_text(LEDGER, encoding="utf-8")
    return str(tmp_path / "river.txt"), str(tmp_path / "ledger.txt")


def test_rows_are_shared_out_between_the_built_in_prose_and_each_source(tiny_tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    river, ledger = sources(tmp_path)
    rows = mixed_haystack_rows("qa1", 7, 120, tokenizer, seed=3, haystacks=(river, ledger))
    kinds = ["river" if "heron" in row["input"] else "ledger" if "clerk" in row["input"] else "built-in"
             for row in rows]
    # 7 rows over three sources: 3, 2, 2 (the first sources take the remainder)
    assert sorted(kinds) == ["built-in"] * 3 + ["ledger"] * 2 + ["river"] * 2
    assert not any("heron" in row["input"] and "clerk" in row["input"] for row in rows)
    # the built-in share is the generator's own rows of that seed
    built_in = [row for row, kind in zip(rows, kinds) if kind == "built-in"]
    assert sorted(built_in, key=str) == sorted(generate_babilong("qa1", 3, 120, tokenizer, seed=3), key=str)
    assert mixed_haystack_rows("qa1", 7, 120, tokenizer, seed=3, haystacks=(river, ledger)) == rows  # seeded


def test_without_sources_the_rows_are_the_generators_in_its_order(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert mixed_haystack_rows("qa1", 5, 120, tokenizer, seed=4) == generate_babilong("qa1", 5, 120, tokenizer, seed=4)

