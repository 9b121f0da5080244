"""`titans-hf lm-eval`: lm-eval tasks on a memory folder, loglikelihood and generate_until, in batches of mixed
lengths (left-padded by lm-eval for generation) that answer every request as it is answered alone."""

import json
import re

import pytest
from transformers import AutoTokenizer

from titans_hf.commands import main as cli_main

from test_modeling import VARIANT_SETTINGS, build

pytest.importorskip("lm_eval")

QUESTIONS = [
    ("Mary went to the kitchen. Where is Mary?", "kitchen"),
    ("John moved to the garden.", "garden"),
    ("Where is Sandra? Sandra travelled to the office. Daniel went back to the hallway. Answer:", "office"),
    ("The old clock", "bedroom"),
    ("Daniel journeyed to the bathroom. Mary went to the garden. John moved to the kitchen. Question: Where is "
     "Daniel? Answer:", "bathroom"),
]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
doc_to_target: " {{{{answer}}}}"
"""
GENERATE = """generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture
def tasks(tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    (folder / "tiny_ll.yaml").write_text(TASK.format(name="tiny_ll", rows=rows, output_type="loglikelihood")
                                         + "metric_list:\n  - metric: acc\n")
    (folder / "tiny_gen.yaml").write_text(TASK.format(name="tiny_gen", rows=rows, output_type="generate_until")
                                          + GENERATE)
    return folder


@pytest.fixture
def own_tasks_only(monkeypatch):
    """lm-eval's TaskManager without its built-in tasks (an index of thousands, which takes seconds to build): the
    tasks of --include-path are all it knows."""
    import lm_eval.tasks

    task_manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kwargs: task_manager(include_defaults=False, **kwargs))


def run(folder, tasks, output, *flags):
    assert cli_main(["lm-eval", "--model", str(folder), "--tasks", "tiny_ll", "tiny_gen", "--include-path",
                     str(tasks), "--output", str(output), "--log-samples", *flags]) == 0
    return json.loads((output / "lm_eval_results.json").read_text())


def test_lm_eval_batches_answer_as_each_request_alone(tmp_path, tiny_qwen3_dir, tasks, own_tasks_only):
    model = build(tiny_qwen3_dir, **VARIANT_SETTINGS["mag"])
    folder = tmp_path / "memory"
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    phases = {len(tokenizer(question)["input_ids"]) % model.padding_multiple for question, _ in QUESTIONS}
    assert len(phases) > 1  # lm-eval's left-padded generation batches mix places in the chunk cycle
    alone = run(folder, tasks, tmp_path / "alone", "--batch-size", "1")
    with pytest.raises(FileExistsError, match=r"alone/lm_eval_results\.json exists; pass --overwrite"):
        run(folder, tasks, tmp_path / "alone", "--batch-size", "1")
    batched = run(folder, tasks, tmp_path / "batched", "--batch-size", "4")
    assert set(batched["results"]) == {"tiny_ll", "tiny_gen"}
    assert batched["results"] == alone["results"]
    assert [s["resps"] for s in batched["samples"]["tiny_gen"]] == [s["resps"] for s in alone["samples"]["tiny_gen"]]
    for one, many in zip(alone["samples"]["tiny_ll"], batched["samples"]["tiny_ll"]):
        assert many["resps"][0][0][0] == pytest.approx(one["resps"][0][0][0], abs=1e-4)
    # the ablation runs the same weights with the memory off, and answers otherwise
    off = run(folder, tasks, tmp_path / "off", "--batch-size", "4", "--memory-off")
    assert off["titans_hf"]["memory_off"] is True
    assert [s["resps"] for s in off["samples"]["tiny_ll"]] != [s["resps"] for s in batched["samples"]["tiny_ll"]]


def test_lm_eval_names_an_unknown_task(tmp_path, tiny_qwen3_dir, tasks):
    with pytest.raises(ValueError, match=r"no lm-eval task or group is called \['tiny_nothing'\]"):
        cli_main(["lm-eval", "--model", str(tiny_qwen3_dir), "--tasks", "tiny_nothing", "--include-path", str(tasks),
                  "--output", str(tmp_path / "out")])


def test_lm_eval_keeps_a_users_results_file_even_with_overwrite(tmp_path, tiny_qwen3_dir, tasks, own_tasks_only):
    output = tmp_path / "out"
    output.mkdir()
    (output / "lm_eval_results.json").write_text('{"mine": true}\n')
    with pytest.raises(FileExistsError, match=r"will not replace it, even with --overwrite: titans_hf did not write"):
        cli_main(["lm-eval", "--model", str(tiny_qwen3_dir), "--tasks", "tiny_ll", "--include-path", str(tasks),
                  "--output", str(output), "--overwrite"])
    assert (output / "lm_eval_results.json").read_text() == '{"mine": true}\n'


@pytest.mark.parametrize(("flags", "message"), [
    (["--batch-size", "0"], r"--batch-size 0: must be at least 1"),
    (["--batch-size", "-4"], r"--batch-size -4: must be at least 1"),
    (["--num-fewshot", "-1"], r"--num-fewshot -1: must be at least 0"),
    (["--limit", "0"], r"--limit 0\.0: must be a count of documents \(1, 2, \.\.\.\) or a fraction in \(0, 1\)"),
    (["--limit", "-1"], r"--limit -1\.0: must be a count of documents"),
    (["--limit", "nan"], r"--limit nan: must be a count of documents"),
    (["--limit", "inf"], r"--limit inf: must be a count of documents"),
    (["--limit", "2.5"], r"--limit 2\.5: must be a count of documents"),
    (["--limit", "1e308"], r"--limit 1e\+308: a count of documents must be at most 9223372036854775807$"),
    (["--seed", "-1"], r"--seed -1: must be in \[0, 4294967295\]"),
    (["--num-fewshot", "6"], r"--num-fewshot 6: task tiny_ll has 5 few-shot examples to draw from"),
])
def test_lm_eval_names_a_bad_flag_before_loading_anything(tmp_path, tiny_qwen3_dir, tasks, own_tasks_only, flags,
                                                           message):
    """Each flag lm-eval would take silently (a negative count), or fail on with its own words, is one error naming
    the flag, before the model loads or anything is written."""
    output = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"^{message}"):
        cli_main(["lm-eval", "--model", str(tiny_qwen3_dir), "--tasks", "tiny_ll", "--include-path", str(tasks),
                  "--output", str(output), *flags])
    assert not output.exists()


def test_lm_eval_takes_every_shot_a_task_has_and_a_whole_limit(tmp_path, tiny_qwen3_dir, tasks, own_tasks_only):
    """The bounds are lm-eval's own: 5 shots from a task of 5 documents (drawn from its test split, which is not set
    aside as a few-shot split) and a limit of 2 documents run."""
    folder = tmp_path / "memory"
    build(tiny_qwen3_dir, **VARIANT_SETTINGS["mag"]).save_pretrained(folder)
    assert cli_main(["lm-eval", "--model", str(folder), "--tasks", "tiny_ll", "--include-path", str(tasks),
                     "--output", str(tmp_path / "out"), "--num-fewshot", "5", "--limit", "2", "--log-samples"]) == 0
    results = json.loads((tmp_path / "out" / "lm_eval_results.json").read_text())
    assert results["n-shot"]["tiny_ll"] == 5
    assert len(results["samples"]["tiny_ll"]) == 2


def test_lm_eval_names_an_include_path_that_is_not_a_folder_of_tasks(tmp_path, tiny_qwen3_dir, tasks):
    """A missing --include-path, a file, and a folder without task YAML files: one line naming the flag, before lm-eval
    builds its task index or the model loads (lm-eval would say only that no task of that name exists)."""
    (tmp_path / "empty").mkdir()
    output = tmp_path / "out"
    for path, problem in ((tmp_path / "missing", "no such folder"),
                          (tasks / "tiny_ll.yaml", "a file, not a folder of task YAML files"),
                          (tmp_path / "empty", r"holds no task YAML files \(\*\.yaml\)")):
        with pytest.raises(ValueError, match=rf"^--include-path {re.escape(str(path))}: {problem}$"):
            cli_main(["lm-eval", "--model", str(tiny_qwen3_dir), "--tasks", "tiny_ll", "--include-path", str(path),
                      "--output", str(output)])
    assert not output.exists()


def test_lm_eval_expands_task_patterns_and_refuses_one_matching_every_task(tmp_path, tiny_qwen3_dir, tasks,
                                                                          own_tasks_only):
    """--tasks takes glob patterns as lm-eval's own command does (lm-eval's simple_evaluate takes names only); a
    pattern matching every task lm-eval knows, '*', is refused naming the flag before the model loads."""
    (tasks / "other_ll.yaml").write_text((tasks / "tiny_ll.yaml").read_text().replace("tiny_ll", "other_ll"))
    folder = tmp_path / "memory"
    build(tiny_qwen3_dir, **VARIANT_SETTINGS["mag"]).save_pretrained(folder)
    argv = ["lm-eval", "--model", str(folder), "--include-path", str(tasks), "--limit", "1"]
    for pattern in ("*", "*_*"):
        with pytest.raises(ValueError, match=rf"^--tasks {re.escape(pattern)}: matches every one of the 3 tasks"):
            cli_main([*argv, "--tasks", pattern, "tiny_ll", "--output", str(tmp_path / "every")])
    assert not (tmp_path / "every").exists()
    assert cli_main([*argv, "--tasks", "tiny_*", "--output", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "lm_eval_results.json").read_text())
    assert set(results["results"]) == {"tiny_ll", "tiny_gen"}
