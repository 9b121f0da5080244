"""Token stores, windowed examples and the `datasets` builders serving them.

Importing this package (or `titans_hf`, see its docstring) registers the builders below the way `datasets`
lists its packaged ones (csv, json, ...), so `load_dataset("titans_tokens", data_files=..., ...)` works offline,
streaming included: `load_dataset` looks names up in that same dict. The builders are `titans_tokens` (this
package's) and one per task package holding a `builder.py` (`titans_<package>`, see `task_builders`): found by
their place, so that the data code loads no task code. This is the package's one use of `datasets` internals;
`check_datasets_internals` fails loudly, naming what moved, when a `datasets` release changes them.

A task's builder generates its rows (`titans_babilong` with `task=`) and so needs no data files, but
`datasets` 5.2 resolves data files for a packaged builder from the working directory when none are
given: slow in a large folder, an `EmptyDatasetError` in an empty one, and in between it hands the
builder whatever files happen to lie there. For the builders in `GENERATING_BUILDERS`, a call with
neither `data_files` nor `data_dir` therefore goes straight to the builder with no data files.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from datasets import load as datasets_load
from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

PACKAGE = Path(__file__).resolve().parent.parent
TASK_PACKAGES_FOLDER = "tasks"
_TASK_MODULE = re.compile(r"titans_hf\.tasks\.(\w+)")


def task_builders() -> dict[str, str]:
    """{builder name: module} of the task packages that hold a `builder.py`: `tasks/needle/builder.py` is
    `titans_needle` in `titans_hf.tasks.needle.builder`. Read from the files' places, nothing imported."""
    return {f"titans_{builder.parent.name}": f"titans_hf.{TASK_PACKAGES_FOLDER}.{builder.parent.name}.builder"
            for builder in sorted((PACKAGE / TASK_PACKAGES_FOLDER).glob("*/builder.py"))}


def _task_builder_sources(package: str) -> tuple[str, ...]:
    """The code a task builder's rows depend on: the tokenizer helpers, its package, and every other task package
    its package names (a builder may reuse another task's example assembly or haystacks)."""
    folder = PACKAGE / TASK_PACKAGES_FOLDER
    used = {package} | {name for file in (folder / package).glob("*.py")
                        for name in _TASK_MODULE.findall(file.read_text(encoding="utf-8"))
                        if (folder / name).is_dir()}
    return ("data/tokenizers.py", *(f"{TASK_PACKAGES_FOLDER}/{name}/*.py" for name in sorted(used)))


BUILDER_MODULES: dict[str, str] = {"titans_tokens": "titans_hf.data.tokens_builder", **task_builders()}

# The code each builder's rows depend on (globs under the package), hashed into its datasets cache key.
BUILDER_SOURCES: dict[str, tuple[str, ...]] = {
    "titans_tokens": ("data/stores.py", "data/windows.py", "data/tokens_builder.py"),
    **{name: _task_builder_sources(name.removeprefix("titans_")) for name in task_builders()},
}

# Builders that generate their rows when no data file is named: every task's.
GENERATING_BUILDERS = set(task_builders())
# Builders that read nothing but the files named: a call naming none is refused instead of reading the working
# directory.
NAMED_FILES_BUILDERS = {"titans_tokens"}


def source_hash(builder: str) -> str:
    """Hash of the code `builder`'s rows depend on (`BUILDER_SOURCES`), used as its `datasets` module hash: a change
    to that code rebuilds its Arrow cache, and no other edit does."""
    files = {file for pattern in BUILDER_SOURCES[builder] for file in PACKAGE.glob(pattern)}
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(file.relative_to(PACKAGE).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def check_datasets_internals() -> None:
    """The `datasets` internals the registration relies on; a RuntimeError naming what moved if one is gone."""
    import datasets

    problems = []
    if datasets_load._PACKAGED_DATASETS_MODULES is not _PACKAGED_DATASETS_MODULES:
        problems.append("datasets.load no longer reads datasets.packaged_modules._PACKAGED_DATASETS_MODULES")
    if "get_module" not in vars(getattr(datasets_load, "PackagedDatasetModuleFactory", object)):
        problems.append("datasets.load.PackagedDatasetModuleFactory.get_module is gone")
    for name in ("DatasetModule", "DataFilesDict", "DataFilesList", "sanitize_patterns"):
        if not hasattr(datasets_load, name):
            problems.append(f"datasets.load.{name} is gone")
    if problems:
        raise RuntimeError(f"titans_hf cannot register its datasets builders with datasets {datasets.__version__}: "
                           + "; ".join(problems))


def register_builders() -> None:
    check_datasets_internals()
    for name, module_path in BUILDER_MODULES.items():
        _PACKAGED_DATASETS_MODULES[name] = (module_path, source_hash(name))


def _refuse_patterns_matching_nothing(factory: datasets_load.PackagedDatasetModuleFactory) -> None:
    """A ValueError naming the first `data_files` glob that matches no file: `datasets` drops such a pattern without
    a word, leaving a split with fewer files than named or none ("Instruction 'train' corresponds to no data")."""
    base_path = Path(factory.data_dir or "").expanduser().resolve().as_posix()
    for split, patterns in datasets_load.sanitize_patterns(factory.data_files).items():
        for pattern in patterns:
            files = datasets_load.DataFilesList.from_patterns(
                [pattern], base_path=base_path, download_config=factory.download_config
            )
            if not files:
                raise ValueError(
                    f"{factory.name}: data_files pattern {pattern!r} (split {split!r}) matches no file under "
                    f"{base_path}; name .h5 stores or files of bin stores (e.g. 'corpus.h5' or 'corpus_bin/*')"
                )


def _packaged_module_without_data_files(resolve_module):
    def get_module(factory: datasets_load.PackagedDatasetModuleFactory) -> datasets_load.DatasetModule:
        no_files = factory.data_files is None and factory.data_dir is None
        if no_files and factory.name in NAMED_FILES_BUILDERS:
            raise ValueError(
                f"{factory.name} needs data_files naming its token stores (e.g. data_files='corpus.h5' or "
                f"'corpus_bin/*'); none were given, and datasets would load whatever lies in the working directory "
                f"{Path().resolve()}. Pass data_files, or data_dir to load the stores of a folder on purpose"
            )
        if factory.data_files is not None and factory.name in NAMED_FILES_BUILDERS:
            _refuse_patterns_matching_nothing(factory)
        if no_files and factory.name in GENERATING_BUILDERS:
            module_path, code_hash = _PACKAGED_DATASETS_MODULES[factory.name]
            return datasets_load.DatasetModule(
                module_path, code_hash, {"data_files": datasets_load.DataFilesDict(), "dataset_name": factory.name}
            )
        return resolve_module(factory)

    get_module.resolves_generating_builders = True
    return get_module


register_builders()
if not getattr(datasets_load.PackagedDatasetModuleFactory.get_module, "resolves_generating_builders", False):
    datasets_load.PackagedDatasetModuleFactory.get_module = _packaged_module_without_data_files(
        datasets_load.PackagedDatasetModuleFactory.get_module
    )
