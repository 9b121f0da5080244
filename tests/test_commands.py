"""The `titans-hf` command line as a user meets it: help that says what each command does, both spellings of every
flag, lengths such as 4k, a missing local path named as missing, usage errors in one line, one version."""

import importlib.metadata
import subprocess
import sys

import pytest

import titans_hf
from titans_hf.commands import build_parser, cli, one_spelling
from titans_hf.commands.train import parse_arguments


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """The `titans-hf` program in this process: (exit status, stdout, stderr)."""

    def run(*argv: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "argv", ["titans-hf", *argv])
        with pytest.raises(SystemExit) as exit_:
            cli()
        out = capsys.readouterr()
        return subprocess.CompletedProcess(argv, exit_.value.code or 0, out.out, out.err)

    return run


def parse(*argv: str):
    args, _ = build_parser().parse_known_args(one_spelling(list(argv)))
    return args


def test_help_says_what_each_command_does_for_the_user(run_cli):
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("prepare", "babilong", "recall", "train", "eval", "lm-eval", "push", "demo"):
        assert f"    {command} " in result.stdout
    assert "thin parser" not in result.stdout and "long-term memory" in result.stdout
    prepare = run_cli("prepare", "--help").stdout
    assert "SFT_FORMATS" not in prepare and "chat_tokens" not in prepare and "chat template" in prepare
    train = run_cli("train", "--help").stdout
    assert train.startswith("usage: titans-hf train")
    groups = [line for line in train.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert groups == ["options:", "the base model:", "the memory (saved in memory_config.json):", "the data:",
                      "training (transformers.TrainingArguments, plus log_every_batches, curriculum_chunks, hub_*):"]


def test_every_flag_takes_both_spellings_and_lengths_take_k():
    for spelling in ("--window-size", "--window_size"):
        args = parse("eval", "--lm", "--model", ".", "--data", "x.h5", "--output", "out", spelling, "4k",
                     "--stride=2k")
        assert (args.window_size, args.stride) == (4096, 2048)
    assert parse("eval", "--model", ".", "--generate", "--output", "o", "--max_new_tokens", "3").max_new_tokens == 3
    args = parse("babilong", "generate", "--task", "qa1", "--length", "4k", "--num_samples", "2", "--tokenizer", ".",
                 "--output", "o.json")
    assert (args.length, args.num_samples) == (4096, 2)
    model, memory, data, _ = parse_arguments(["--model-name-or-path", ".", "--window-size", "4k", "--max_length=2k",
                                              "--chunk_size", "1k", "--generate_lengths", "1k", "300",
                                              "--output-dir", "out"])
    assert (data.window_size, data.max_length, memory.chunk_size, data.generate_lengths) == (4096, 2048, 1024,
                                                                                              [1024, 300])


def test_usage_errors_are_one_line_without_a_traceback(run_cli, tmp_path, monkeypatch):
    missing = run_cli("eval", "--model", "outputs/demo/memroy", "--data", "x.json", "--output", str(tmp_path))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "outputs/demo/memroy: no such file or folder" in missing.stderr
    (tmp_path / "outputs").mkdir()  # a first part that is a local folder: a typo, not a Hub id
    monkeypatch.chdir(tmp_path)
    typo = run_cli("eval", "--model", "outputs/memroy", "--data", "x.json", "--output", "o")
    assert typo.returncode == 2 and "outputs/memroy: no such file or folder" in typo.stderr
    variant = run_cli("train", "--model_name_or_path", ".", "--variant", "magg")
    assert variant.returncode == 2 and "Traceback" not in variant.stderr
    assert "--variant: invalid choice: 'magg'" in variant.stderr
    length = run_cli("babilong", "generate", "--task", "qa1", "--length", "4kb", "--num-samples", "1", "--tokenizer",
                     ".", "--output", str(tmp_path / "x.json"))
    assert length.returncode == 2 and "'4kb' is not a length in tokens" in length.stderr
    # an error the command itself finds (a ValueError) is one line too
    lengths = run_cli("eval", "--model", ".", "--generate", "--output", str(tmp_path / "out"))
    assert lengths.returncode == 2 and "Traceback" not in lengths.stderr
    assert lengths.stderr.strip() == "titans-hf: error: titans-hf eval --generate needs --lengths (input lengths in tokens)"


def test_one_version_everywhere(run_cli):
    assert importlib.metadata.version("titans_hf") == titans_hf.__version__
    assert run_cli("--version").stdout.strip() == f"titans-hf {titans_hf.__version__}"
    program = subprocess.run([sys.executable, "-m", "titans_hf.commands", "--version"], capture_output=True, text=True)
    assert program.stdout.strip() == f"titans-hf {titans_hf.__version__}"  # python -m is the same program
    (script,) = [entry for entry in importlib.metadata.entry_points(group="console_scripts") if entry.name == "titans-hf"]
    assert script.value == "titans_hf.commands:cli"


@pytest.mark.parametrize("command", ["prepare", "eval", "lm-eval", "babilong generate", "recall generate", "push",
                                     "demo"])
def test_every_command_has_help(run_cli, command):
    result = run_cli(*command.split(), "--help")
    assert result.returncode == 0 and result.stdout.startswith(f"usage: titans-hf {command}")


def test_the_readme_32k_recipe_trains_the_measured_memory(tiny_qwen3_dir):
    """The README's GPU command (chunks of 4096) gets the settings the CPU demo validated, not ones that forget: the
    delta rule with its step at most 1, no forgetting, the state bounded, the write gate starting almost closed, the
    write cost growing eightfold in training; and a model built on them starts its gates there."""
    import dataclasses

    from titans_hf import TitansQwenForCausalLM
    from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig

    _, memory, _, training = parse_arguments([
        "--model_name_or_path", ".", "--generate_lengths", "3500", "7500", "15500", "31500", "--max_length", "32768",
        "--chunk_size", "4096", "--answer_reserve_tokens", "64", "--curriculum_chunks", "1", "2", "4", "8",
        "--num_train_epochs", "4", "--state_passing", "0.5", "--output_dir", "out"])
    config = TitansMemoryConfig(**dataclasses.asdict(memory))
    assert (config.chunk_size, config.update_rule, config.max_lr, config.max_memory_norm) == (
        4096, "delta", 0.5, 4 * 64**0.5)
    assert config.forget_bias_init == -30.0  # alpha ~ 1e-13 per update: after 16,384 updates 1 - 2e-9 of a fact
    assert config.theta_bias_init == -6.0 and config.write_cost == 1.0
    assert training.state_passing == 0.5
    assert (training.write_cost_growth, training.write_cost_growth_span) == (8.0, [0.3, 0.6])  # 1, then 8 from 60 %
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **{**config.memory_settings(), "chunk_size": 64})
    assert model.config.memory_config.write_cost == 1.0
    memory = model.model.memory[str(model.config.memory_config.memory_layers[0])].neural_memory
    theta_bias, _, forget_bias = memory.to_gates.bias.view(3, memory.memory_num_heads)
    assert theta_bias.eq(-6.0).all() and forget_bias.eq(-30.0).all()
    assert (memory.update_rule, memory.max_lr, memory.max_memory_norm) == ("delta", 0.5, 4 * 64**0.5)  # 4 sqrt(d), d = 64


def test_the_write_gate_starts_where_each_rule_was_measured():
    from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig

    assert TitansMemoryConfig().theta_bias_init == -6.0
    assert TitansMemoryConfig(update_rule="gradient").theta_bias_init == -2.0
    assert TitansMemoryConfig(theta_bias_init=-3).theta_bias_init == -3.0
    saved = TitansMemoryConfig().to_dict()
    assert saved["theta_bias_init"] == -6.0  # a saved memory carries the number, not the default that chose it
    assert TitansMemoryConfig.from_dict({**saved, "theta_bias_init": -2.0}).theta_bias_init == -2.0
    with pytest.raises(ValueError, match=r"update_rule='hebb' must be one of \['delta', 'gradient'\]"):
        TitansMemoryConfig(update_rule="hebb")


def test_the_write_cost_defaults_to_what_each_rule_was_measured_with():
    from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig

    assert TitansMemoryConfig().write_cost == 1.0
    assert TitansMemoryConfig(update_rule="gradient").write_cost == 0.0
    assert TitansMemoryConfig(write_cost=3).write_cost == 3.0
    saved = TitansMemoryConfig().to_dict()
    assert saved["write_cost"] == 1.0
    assert TitansMemoryConfig.from_dict(saved).write_cost == 1.0
    # a memory saved before the write cost existed (and before format_version) is from before the first release:
    # refused, not read with the write cost it trained without
    before = {name: value for name, value in saved.items() if name not in ("write_cost", "format_version")}
    with pytest.raises(ValueError, match=r"no format_version: the memory config is from before titans_hf's first "
                                         r"release \(0\.3\.0\)"):
        TitansMemoryConfig.from_dict(before)
    assert TitansMemoryConfig.from_dict({"chunk_size": 64}).write_cost == 1.0  # settings, not a saved config
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"write_cost=.* must be"):
            TitansMemoryConfig(write_cost=bad)
