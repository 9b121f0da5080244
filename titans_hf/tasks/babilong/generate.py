"""An offline BABILong generator: bAbI stories (QA1 single supporting fact, QA2 two, QA3 three) in a haystack.

A story's facts are scattered, in story order, over the sentence gaps of a haystack sized in tokens of the
tokenizer that will read it: contiguous text of the user's files or folders, or of a ``datasets`` split, without
the sentences that name a task word; or built-in distractor prose that never names one. Rows are plain
``{"input", "question", "target"}`` dicts, the public format, so generated and published rows go through the same
reader and the same example assembly.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import random
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from tqdm.auto import tqdm

from titans_hf.data.tokenizers import plain_backend_tokenizer

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

ACTORS = ["John", "Mary", "Sandra", "Daniel"]
LOCATIONS = ["bathroom", "bedroom", "garden", "hallway", "kitchen", "office"]
OBJECTS = ["football", "apple", "milk"]
MOVE_VERBS = ["moved to", "went to", "journeyed to", "travelled to", "went back to"]
PICK_VERBS = ["picked up", "got", "grabbed", "took"]
DROP_VERBS = ["dropped", "discarded", "put down", "left"]

# Fewest and most facts of a story, per task the generator writes: QA3 needs a move, a pick-up and a second move.
STORY_FACTS: dict[str, tuple[int, int]] = {"qa1": (2, 10), "qa2": (2, 10), "qa3": (3, 10)}
GENERATED_TASKS = tuple(STORY_FACTS)

_TASK_WORDS = re.compile(r"\b(" + "|".join(ACTORS + LOCATIONS + OBJECTS) + r")\b", re.IGNORECASE)
# A sentence ends at . ! ? followed by whitespace (a closing quote may come between), or at the full-width 。！？
# that Chinese and Japanese prose ends sentences with, whitespace or not (a closing bracket or quote may follow).
_SENTENCE_END = re.compile(
    r"[.!?。！？](?:(?<=[.!?])[\"'\u2019\u201d]?\s+|(?<=[。！？])[」』\u201d）]?(?![。！？」』\u201d）])\s*)"
)
SENTENCE_END_MARKS = ". ! ? 。 ！ ？"
# A haystack of fewer distinct sentences would repeat each many times in one row.
MIN_HAYSTACK_SENTENCES = 32
# What one haystack source (a file, or a datasets split) gives at most; the rest of it is not read.
HAYSTACK_SOURCE_BYTES = 64 * 2**20
_READ_PIECE_BYTES = 2**20


# ----------------------------------------------------------------------------------------------
# bAbI stories


class World:
    """The bAbI world state: where each actor is, who holds what, every place each object has been."""

    def __init__(self) -> None:
        self.actor_location: dict[str, str] = {}
        self.holder: dict[str, str | None] = dict.fromkeys(OBJECTS)
        self.object_location: dict[str, str | None] = dict.fromkeys(OBJECTS)
        self.object_history: dict[str, list[str]] = {obj: [] for obj in OBJECTS}

    def _place(self, obj: str, location: str) -> None:
        self.object_location[obj] = location
        if not self.object_history[obj] or self.object_history[obj][-1] != location:
            self.object_history[obj].append(location)

    def move(self, actor: str, location: str) -> None:
        self.actor_location[actor] = location
        for obj, holder in self.holder.items():
            if holder == actor:
                self._place(obj, location)

    def pick(self, actor: str, obj: str) -> None:
        self.holder[obj] = actor
        self._place(obj, self.actor_location[actor])

    def drop(self, obj: str) -> None:
        self.holder[obj] = None  # it stays where it was, which is already recorded

    def can_pick(self, actor: str, obj: str) -> bool:
        """An object can only be taken by someone standing where it lies (anywhere, before it was ever seen)."""
        here = self.actor_location.get(actor)
        return here is not None and self.holder[obj] is None and self.object_location[obj] in (None, here)


def _story(task: str, rng: random.Random) -> tuple[list[str], str, str]:
    """One bAbI story: (facts in story order, question, answer)."""
    low, high = STORY_FACTS[task]
    while True:  # rejection sampling: cheap, and keeps every valid story reachable
        num_facts = rng.randint(low, high)
        world, facts = World(), []
        for _ in range(num_facts):
            facts.append(random_fact(task, world, rng))
        question = random_question(task, world, rng)
        if question is not None:
            return facts, question[0], question[1]


def random_fact(task: str, world: World, rng: random.Random) -> str:
    picks = [(a, o) for a in ACTORS for o in OBJECTS if world.can_pick(a, o)] if task != "qa1" else []
    drops = [(a, o) for o, a in world.holder.items() if a is not None]
    roll = rng.random()
    if picks and roll < 0.3:
        actor, obj = rng.choice(picks)
        world.pick(actor, obj)
        return f"{actor} {rng.choice(PICK_VERBS)} the {obj} there."
    if drops and roll > 0.8:
        actor, obj = rng.choice(drops)
        world.drop(obj)
        return f"{actor} {rng.choice(DROP_VERBS)} the {obj} there."
    actor = rng.choice(ACTORS)
    location = rng.choice([loc for loc in LOCATIONS if loc != world.actor_location.get(actor)])
    world.move(actor, location)
    return f"{actor} {rng.choice(MOVE_VERBS)} the {location}."


def _all_facts(task: str) -> list[str]:
    """Every fact sentence a story of ``task`` can contain."""
    facts = [f"{a} {verb} the {loc}." for a in ACTORS for verb in MOVE_VERBS for loc in LOCATIONS]
    if task != "qa1":
        facts += [f"{a} {verb} the {obj} there." for a in ACTORS for verb in PICK_VERBS + DROP_VERBS for obj in OBJECTS]
    return facts


def random_question(task: str, world: World, rng: random.Random) -> tuple[str, str] | None:
    """(question, answer) about the final world, or None when the story cannot support one."""
    if task == "qa1":
        actor = rng.choice(sorted(world.actor_location))
        return f"Where is {actor}? ", world.actor_location[actor]
    if task == "qa2":
        placed = [obj for obj in OBJECTS if world.object_location[obj] is not None]
        if not placed:
            return None
        obj = rng.choice(placed)
        return f"Where is the {obj}? ", world.object_location[obj]
    travelled = [obj for obj in OBJECTS if len(world.object_history[obj]) >= 2]
    if not travelled:
        return None
    obj = rng.choice(travelled)
    history = world.object_history[obj]
    later = rng.choice(sorted(set(history[1:])))
    last_arrival = max(i for i in range(1, len(history)) if history[i] == later)
    # "Before the kitchen" means before its latest arrival there: the latest relevant location.
    return f"Where was the {obj} before the {later}? ", history[last_arrival - 1]


# ----------------------------------------------------------------------------------------------
# Haystacks

_SUBJECTS = [
    "the old sailor", "a tired merchant", "the young painter", "the village priest", "her elder brother",
    "the schoolmaster", "a travelling musician", "the ferryman", "the baker's widow", "the captain",
    "a stranger in a grey coat", "the twins", "the mayor", "the blacksmith", "an old woman", "the shepherd",
    "the poet", "the clerk", "the miller", "a young soldier", "the doctor", "the innkeeper", "the fisherman",
    "the librarian", "the weaver", "the carpenter", "a boy with a lantern", "the countess", "the tax collector",
    "the lighthouse keeper", "his cousin from the coast", "the choir", "a pair of pilgrims", "the judge",
]
_VERBS = [
    "repaired", "polished", "described", "admired", "sold", "bought", "examined", "kept", "painted",
    "carried", "found", "wrapped", "mended", "weighed", "borrowed", "returned", "sketched", "praised",
    "ignored", "cleaned", "inherited", "counted", "guarded", "studied",
]
_THINGS = [
    "a wooden chest", "the brass lantern", "an old violin", "a bundle of letters", "the silver spoons",
    "a torn sail", "the parish map", "a basket of pears", "the iron gate", "a leather saddle", "a jar of honey",
    "the fishing nets", "a clay pot", "the heavy ledger", "a woollen scarf", "the copper kettle",
    "a small portrait", "the broken clock", "a box of candles", "the ship's compass", "a coil of rope",
    "the family bible", "a pair of boots", "the tin whistle",
]
_PLACES = [
    "near the harbour", "by the mill", "at the market", "on the hill", "in the chapel", "beside the river",
    "at the crossroads", "in the square", "under the bridge", "behind the tavern", "in the forest",
    "at the station", "in the library", "on the ship", "in the barn", "by the lighthouse", "in the workshop",
    "at the inn", "in the orchard", "in the cellar", "at the quay", "on the frozen lake", "in the town hall",
]
_TIMES = [
    "in the morning", "late that evening", "before dawn", "at noon", "during the storm",
    "on the first day of spring", "long after midnight", "that winter", "on sundays", "years later",
    "after the harvest", "just before supper", "on the day of the fair", "in the dry season",
]
_MANNERS = [
    "slowly", "without a word", "with great care", "in silence", "for hours", "as if nothing had happened",
    "cheerfully", "with some reluctance", "twice", "more carefully than anyone expected", "in a hurry",
]
_INTRANSITIVE = ["waited", "sang", "laughed", "wept", "slept", "prayed", "argued", "wandered", "worked", "listened"]
_SCENERY = [
    "the wind rose over the rooftops", "rain fell on the empty streets", "the bells rang across the valley",
    "the fog lifted from the water", "snow covered the roads", "the sun sank behind the hills",
    "a dog barked somewhere in the distance", "the candles burned low", "the tide turned",
    "the fire crackled in the hearth", "the crows gathered on the fence", "the clouds hung low and grey",
]
_TEMPLATES = [
    "{Time}, {subject} {verb} {thing} {place}.",
    "{Subject} {verb} {thing} {place}, and {scenery}.",
    "{Place}, {subject} {verb} {thing}.",
    "{Subject} said that {subject2} had {verb} {thing} {time}.",
    "There was {thing} {place}, and {subject} {intransitive} beside it {manner}.",
    "{Subject} {intransitive} {manner} {place} {time}.",
    "Nobody knew why {subject} {verb} {thing}, but {scenery}.",
    "{Subject} {verb} {thing}; meanwhile {scenery}.",
    "When {scenery}, {subject} {intransitive} {place}.",
    "{Time}, {subject} and {subject2} {intransitive} {manner}.",
]


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def distractor_sentence(rng: random.Random) -> str:
    """A sentence of plain narrative prose that never names an actor, object or location of the tasks.

    The vocabulary is disjoint from the bAbI words by construction, so a haystack can never
    contradict or answer a question; the templates and word lists combine into far more
    sentences than a 1M-token haystack needs.
    """
    slots = {
        "subject": rng.choice(_SUBJECTS), "subject2": rng.choice(_SUBJECTS), "verb": rng.choice(_VERBS),
        "thing": rng.choice(_THINGS), "place": rng.choice(_PLACES), "time": rng.choice(_TIMES),
        "manner": rng.choice(_MANNERS), "intransitive": rng.choice(_INTRANSITIVE), "scenery": rng.choice(_SCENERY),
    }
    slots.update({key.capitalize(): _capitalise(value) for key, value in list(slots.items())})
    return rng.choice(_TEMPLATES).format(**slots)


def split_sentences(text: str) -> list[str]:
    """Sentences of free text (books wrap lines, so whitespace is normalised first), cut at ``_SENTENCE_END``."""
    text = " ".join(text.split())
    sentences, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        sentences.append(text[start : end.start() + len(end.group().rstrip())])
        start = end.end()
    return [sentence for sentence in [*sentences, text[start:]] if sentence]


def names_a_task_word(sentence: str) -> bool:
    """Whether a sentence names an actor, location or object of the tasks (any case, whole words): such a sentence
    in a haystack could contradict the story or answer its question, so no haystack keeps one."""
    return _TASK_WORDS.search(sentence) is not None


@dataclass(frozen=True)
class HaystackDataset:
    """A ``datasets`` split as the haystack: the text of ``column``, row after row, read as contiguous text.

    ``source`` is what ``datasets.load_dataset`` takes as its path: a packaged builder (``"text"``, ``"json"``,
    ``"parquet"``, ``"csv"``) with ``data_files``, a local folder, or a Hub id; ``split`` defaults to ``"train"``.
    It is read with ``streaming=True``, so every read sees the files as they are now (the Arrow cache of a plain
    ``load_dataset`` keys local files by path and mtime, and would serve an edited file whose mtime was kept).
    ``source`` may also be a loaded ``datasets.Dataset`` or ``IterableDataset``, with no ``data_files`` or ``split``.
    """

    source: str | datasets.Dataset | datasets.IterableDataset
    data_files: str | tuple[str, ...] | None = None
    split: str | None = None
    column: str = "text"

    def __post_init__(self) -> None:
        if isinstance(self.data_files, (list, tuple)):
            object.__setattr__(self, "data_files", tuple(str(file) for file in self.data_files))
        elif self.data_files is not None and not isinstance(self.data_files, str):
            raise ValueError(f"haystack data_files={self.data_files!r} must be a file pattern or a list of them")
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"haystack column={self.column!r} must name a column")
        if self.split is not None and (not isinstance(self.split, str) or not self.split):
            raise ValueError(f"haystack split={self.split!r} must name a split")
        if isinstance(self.source, str):
            if not self.source:
                raise ValueError("haystack dataset: an empty path; name a builder (json, text, parquet, csv), a "
                                 "folder or a Hub id")
        elif self._is_loaded():
            if self.data_files is not None or self.split is not None:
                raise ValueError("haystack dataset: data_files and split choose what load_dataset reads; a loaded "
                                 f"{type(self.source).__name__} takes neither")
        else:
            raise ValueError(f"haystack dataset {self.source!r}: a load_dataset path or a loaded datasets.Dataset / "
                             f"IterableDataset, not {type(self.source).__name__}")

    def _is_loaded(self) -> bool:
        import datasets

        return isinstance(self.source, (datasets.Dataset, datasets.IterableDataset))

    def describe(self) -> str:
        """The source as error messages name it."""
        if not isinstance(self.source, str):
            return f"haystack dataset (a {type(self.source).__name__}), column {self.column!r}"
        files = f", data_files {self.data_files!r}" if self.data_files is not None else ""
        return f"haystack dataset {self.source!r}{files}, split {self.split or 'train'!r}, column {self.column!r}"

    def texts(self) -> Iterator[str]:
        """The column's texts in row order. A missing data file is a FileNotFoundError, a missing split or column,
        a file its builder cannot read or a value that is not text a ValueError, each naming the source."""
        import datasets

        dataset = self.source
        if isinstance(dataset, str):
            try:
                dataset = datasets.load_dataset(dataset, data_files=self.data_files, split=self.split or "train",
                                                streaming=True)
            except FileNotFoundError as error:
                raise FileNotFoundError(f"{self.describe()}: {error}") from error
            except (ValueError, ConnectionError) as error:
                raise ValueError(f"{self.describe()}: cannot be read: {error}") from error
        names = dataset.column_names  # None for a stream whose features are known only once read
        if names is not None:
            if self.column not in names:
                raise ValueError(f"{self.describe()}: no column {self.column!r} (columns: {names})")
            dataset = dataset.select_columns([self.column])
        batches, row = dataset.iter(batch_size=1024), 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (ValueError, OSError) as error:  # a file that is not what its builder reads
                raise ValueError(f"{self.describe()}: cannot be read: {error}") from error
            if self.column not in batch:
                raise ValueError(f"{self.describe()}: no column {self.column!r} (columns: {sorted(batch)})")
            for value in batch[self.column]:
                if not isinstance(value, str):
                    raise ValueError(f"{self.describe()}: row {row} holds {type(value).__name__}, not text")
                yield value
                row += 1


HAYSTACK_FILE_SUFFIX = ".txt"


def haystack_text_files(haystack_files: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The text files a haystack reads, in order: each file as given, and for each folder every ``*.txt`` file under
    it, in sorted order of their paths inside it.

    A folder's links are followed only inside it: a link to a file or folder outside it is a ValueError naming the
    link (a link to a folder inside it is not walked, as its target is walked anyway). A folder holding no ``*.txt``
    file, and a ``*.txt`` entry that is not a regular file, are ValueErrors naming them; a missing path is a
    FileNotFoundError naming it.
    """
    files: list[Path] = []
    for entry in _paths(haystack_files):
        if entry.is_dir():
            files.extend(_folder_text_files(entry))
        elif not entry.exists():
            raise FileNotFoundError(f"haystack file {entry} does not exist")
        else:
            files.append(_regular_file(entry, "haystack file"))
    return files


def _paths(haystack_files: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The haystack files and folders given: one path alone, or a list of them. An empty path (an unset shell
    variable) is a ValueError: read as a path it would be the working folder, every text file under it."""
    entries = [haystack_files] if isinstance(haystack_files, (str, os.PathLike)) else list(haystack_files or [])
    if any(os.fspath(entry) == "" for entry in entries):
        raise ValueError(f"haystack_files={haystack_files!r}: an empty path names no file or folder (an unset "
                         "variable?)")
    return [Path(entry) for entry in entries]


def _regular_file(path: Path, what: str) -> Path:
    """``path`` when it is (or links to) a regular file; a FIFO or device would block or never end a read."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} is a link to nothing") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {path} is not a regular file")
    return path


def _folder_text_files(folder: Path) -> list[Path]:
    """Every ``*.txt`` file under ``folder`` (links kept inside it), sorted by their path inside it."""
    def unreadable(error: OSError) -> None:
        raise ValueError(f"haystack folder {folder}: cannot list {error.filename}: {error.strerror}") from error

    root = folder.resolve()
    found: list[Path] = []
    for directory, subfolders, names in os.walk(folder, onerror=unreadable, followlinks=False):
        for name in subfolders + names:
            path = Path(directory, name)
            if not path.is_symlink() or not (name.endswith(HAYSTACK_FILE_SUFFIX) or name in subfolders):
                continue
            try:
                target = path.resolve()
            except (OSError, RuntimeError) as error:  # a loop of links
                raise ValueError(f"haystack folder {folder}: the link {path} cannot be resolved ({error})") from None
            if not target.is_relative_to(root):
                raise ValueError(f"haystack folder {folder}: {path} is a link to {target}, outside the folder; "
                                 "copy the file in, or name it as a haystack file of its own")
        found.extend(_regular_file(Path(directory, name), "haystack file")
                     for name in names if name.endswith(HAYSTACK_FILE_SUFFIX))
    if not found:
        raise ValueError(f"haystack folder {folder} holds no {HAYSTACK_FILE_SUFFIX} file")
    return sorted(found, key=lambda path: path.relative_to(folder).parts)


def _check_one_source(
    haystack_files: str | Path | Sequence[str | Path] | None, haystack_dataset: HaystackDataset | None
) -> None:
    if haystack_files and haystack_dataset is not None:
        raise ValueError("a haystack comes from haystack_files or from haystack_dataset, not both")


def read_haystack_sentences(
    haystack_files: str | Path | Sequence[str | Path] | None = None,
    haystack_dataset: HaystackDataset | None = None,
    expected_digests: list[list[str]] | None = None,
) -> tuple[list[str], list[list[str]]]:
    """Sentences of a haystack, in order, without any that names a task word (``names_a_task_word``), and the
    digests of the very bytes they were cut from, for cache keys.

    The haystack is text files and folders (``haystack_text_files``), or a ``datasets`` split
    (``HaystackDataset``). Dropping sentences that mention e.g. "kitchen" or "Mary" keeps a book from
    contradicting the story; everything else keeps its original order, as BABILong takes contiguous book text.
    Each source gives at most its first ``HAYSTACK_SOURCE_BYTES`` (the rest is not read): a file is read in
    pieces and decoded as it comes, so a huge file starts at once in bounded memory. The digests are [path,
    SHA-256 of the bytes read] of every file, in order, or ["texts", SHA-256 of the texts read, each framed by
    its length]: contents only, never mtimes. With ``expected_digests`` (a cache key taken earlier), a haystack
    whose digests differ is a ValueError naming what changed.

    A file with text but no sentence end (``SENTENCE_END_MARKS``) is a ValueError naming it, and so is a haystack
    of fewer than ``MIN_HAYSTACK_SENTENCES`` distinct sentences free of the task words.
    """
    _check_one_source(haystack_files, haystack_dataset)
    if haystack_dataset is not None:
        where = haystack_dataset.describe()
        sentences, digests = _dataset_sentences(haystack_dataset)
    else:
        where = f"haystack files {[str(path) for path in _paths(haystack_files)]}"
        sentences, digests = [], []
        for file in haystack_text_files(haystack_files):
            file_sentences, digest = _file_sentences(file)
            sentences += file_sentences
            digests.append([str(file), digest])
    if expected_digests is not None and digests != expected_digests:
        changed = [entry[0] for entry in digests if entry not in expected_digests]
        raise ValueError(f"{where}: {changed or 'the files read'} changed while the dataset was being built; "
                         "build it again")
    kept = [sentence for sentence in sentences if not names_a_task_word(sentence)]
    if not kept:
        raise ValueError(f"{where} hold no sentence free of the task words")
    distinct = len(set(kept))
    if distinct < MIN_HAYSTACK_SENTENCES:
        raise ValueError(f"{where} hold {distinct} distinct sentence(s) free of the task words, fewer than "
                         f"{MIN_HAYSTACK_SENTENCES}: a row would repeat them over and over; give more text")
    return kept, digests


def _file_sentences(path: Path) -> tuple[list[str], str]:
    """The sentences of one haystack file and the SHA-256 of the bytes read: its first ``HAYSTACK_SOURCE_BYTES``,
    read in pieces, each decoded as UTF-8 (a sequence split between pieces waits for the next) and cut into
    sentences as soon as a sentence end is settled (followed by more text). Text that is not UTF-8 is a ValueError
    naming the file, line and byte offset, as is text with no sentence end at all."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    digest = hashlib.sha256()
    sentences: list[str] = []
    tail, ends, offset, lines = "", 0, 0, 1
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        while offset < HAYSTACK_SOURCE_BYTES:
            piece = stream.read(min(_READ_PIECE_BYTES, HAYSTACK_SOURCE_BYTES - offset))
            if not piece:
                break
            digest.update(piece)
            text = _decode(decoder, piece, path, offset, lines)
            offset, lines = offset + len(piece), lines + piece.count(b"\n")
            tail, found = _settled_sentences(tail, text, sentences)
            ends += found
    if offset < HAYSTACK_SOURCE_BYTES:
        tail += _decode(decoder, b"", path, offset, lines, final=True)
    else:
        logger.warning("haystack file %s: only its first %d of %d bytes are read", path, offset, max(size, offset))
    ends += _SENTENCE_END.search(tail + " ") is not None  # the last sentence ends the file
    if ends == 0 and tail.strip():
        raise ValueError(f"haystack file {path} holds no sentence end ({SENTENCE_END_MARKS}): its text cannot be "
                         "cut into sentences")
    sentences += split_sentences(tail)
    return sentences, digest.hexdigest()


def _decode(decoder: codecs.IncrementalDecoder, piece: bytes, path: Path, offset: int, lines: int,
            final: bool = False) -> str:
    """``piece`` (read at byte ``offset`` of ``path``, after ``lines`` - 1 line breaks) decoded; bytes that are not
    UTF-8 are a ValueError naming the file, line and byte offset."""
    pending = decoder.getstate()[0]
    try:
        return decoder.decode(piece, final)
    except UnicodeDecodeError as error:
        data = pending + piece
        line = lines + data[: error.start].count(b"\n")
        raise ValueError(f"haystack file {path} is not UTF-8 text: {error.reason} (byte 0x{data[error.start]:02x} "
                         f"at offset {offset - len(pending) + error.start}, line {line})") from error


def _settled_sentences(tail: str, text: str, sentences: list[str]) -> tuple[str, int]:
    """Append to ``sentences`` those of ``tail`` + ``text`` up to the last settled sentence end (one followed by
    more text, so the next piece cannot extend it); return the rest and how many sentence ends were settled.
    ``tail`` holds no settled end, so the search starts where its trailing whitespace does."""
    start = len(tail)
    while start and tail[start - 1].isspace():
        start -= 1
    buffer = tail + text
    last_end, found = None, 0
    for match in _SENTENCE_END.finditer(buffer, start):
        if match.end() < len(buffer):
            last_end, found = match.end(), found + 1
    if last_end is None:
        return buffer, 0
    sentences += split_sentences(buffer[:last_end])
    return buffer[last_end:], found


def _dataset_sentences(haystack_dataset: HaystackDataset) -> tuple[list[str], list[list[str]]]:
    """The sentences of a dataset's texts, each text cut alone, up to the text that reaches
    ``HAYSTACK_SOURCE_BYTES`` of UTF-8, and ["texts", SHA-256 of those texts, each framed by its length]. Texts
    with no sentence end at all are a ValueError naming the dataset."""
    digest = hashlib.sha256()
    sentences: list[str] = []
    read, ends = 0, False
    for text in haystack_dataset.texts():
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
        sentences += split_sentences(text)
        ends = ends or _SENTENCE_END.search(text + " ") is not None  # a last sentence ends the text
        read += len(data)
        if read >= HAYSTACK_SOURCE_BYTES:
            logger.warning("%s: only its first %d bytes of text are read", haystack_dataset.describe(), read)
            break
    if sentences and not ends:
        raise ValueError(f"{haystack_dataset.describe()} holds no sentence end ({SENTENCE_END_MARKS}): its text "
                         "cannot be cut into sentences")
    return sentences, [["texts", digest.hexdigest()]]


def token_counts(tokenizer, texts: list[str], leading_space: bool = True) -> list[int]:
    """Token counts without special tokens; sentences are counted as they appear after another one.

    The Rust backend is called directly: the Python wrapper's per-encoding conversion costs more
    than the tokenisation itself for the many short sentences counted here.
    """
    prefix = " " if leading_space else ""
    counts: list[int] = []
    backend = plain_backend_tokenizer(tokenizer)
    for start in range(0, len(texts), 4096):
        batch = [prefix + text for text in texts[start : start + 4096]]
        counts.extend(len(e.ids) for e in backend.encode_batch_fast(batch, add_special_tokens=False))
    return counts


def _row_random(task: str, length: int, seed: int, index: int) -> random.Random:
    """Row ``index`` depends only on (task, length, seed, index), so any subset generates alone (num_proc)."""
    return random.Random(f"titans_babilong:{task}:{length}:{seed}:{index}")


# ----------------------------------------------------------------------------------------------
# Generation


def generate_babilong(
    task: str,
    num_samples: int,
    length: int,
    tokenizer,
    seed: int = 0,
    haystack_files: str | Path | Sequence[str | Path] | None = None,
    row_indices: Sequence[int] | None = None,
    show_progress: bool = False,
    haystack_dataset: HaystackDataset | None = None,
) -> list[dict[str, str]]:
    """Generate BABILong rows ``{"input", "question", "target"}``.

    ``length`` is the size of ``input`` in tokens of ``tokenizer`` (no special tokens): at most
    ``length`` and short of it by less than one haystack sentence; ``length=0`` gives the bare
    story (BABILong's "0k"). Facts go, in story order, into uniformly random gaps between
    haystack sentences; the haystack is contiguous text from a random start of ``haystack_files``
    (text files, and folders of ``*.txt`` files, see ``haystack_text_files``) or of a ``datasets``
    split (``haystack_dataset``), or else built-in distractor prose; sentences naming a task word
    are left out of every haystack. ``row_indices`` picks rows of the ``num_samples``-row set
    (each row depends only on its index), which lets workers generate shards independently.
    """
    batches = iter_babilong_batches(
        task, num_samples, length, tokenizer, seed, haystack_files, row_indices, show_progress=show_progress,
        haystack_dataset=haystack_dataset,
    )
    return [row for batch in batches for row in batch]


def checked_row_indices(num_samples: int, row_indices: Sequence[int] | None) -> list[int]:
    """The rows a generator writes: `row_indices`, or all `num_samples`; one outside the set is a ValueError."""
    indices = list(range(num_samples)) if row_indices is None else list(row_indices)
    bad = [i for i in indices if not 0 <= i < num_samples]
    if bad:
        raise ValueError(f"row_indices {bad[:5]} lie outside the {num_samples}-row set")
    return indices


def haystack_sentence_pool(generator: str, haystack_files: str | Path | Sequence[str | Path] | None,
                           haystack_dataset: HaystackDataset | None, num_samples: int, length: int, seed: int,
                           expected_digests: list[list[str]] | None = None) -> tuple[list[str], bool]:
    """(sentences, contiguous) a generator's rows draw their haystack from: the user's prose read in order
    (`read_haystack_sentences`, refused unless its digests are `expected_digests` when given; an empty path is
    refused there), or built-in prose drawn at random, seeded by `generator`'s name and `seed`: enough distinct
    sentences that a row rarely repeats one, capped to keep start-up short."""
    if haystack_files or haystack_files == "" or haystack_dataset is not None:
        return read_haystack_sentences(haystack_files, haystack_dataset, expected_digests)[0], True
    pool_random = random.Random(f"{generator}:pool:{seed}")
    return [distractor_sentence(pool_random) for _ in range(min(8192, max(512, num_samples * length // 12)))], False


def iter_babilong_batches(
    task: str,
    num_samples: int,
    length: int,
    tokenizer,
    seed: int = 0,
    haystack_files: str | Path | Sequence[str | Path] | None = None,
    row_indices: Sequence[int] | None = None,
    batch_size: int = 256,
    show_progress: bool = False,
    haystack_dataset: HaystackDataset | None = None,
    expected_haystack_digests: list[list[str]] | None = None,
) -> Iterator[list[dict[str, str]]]:
    """``generate_babilong`` in batches of rows, so a large set never sits in memory at once.

    The haystack (read and token-counted once) is shared by all batches: it costs more than
    hundreds of short rows. ``expected_haystack_digests`` is a cache key's (``read_haystack_sentences``).
    """
    if task not in STORY_FACTS:
        raise ValueError(f"task={task!r}: the generator writes {list(GENERATED_TASKS)}")
    if not tokenizer.is_fast:
        raise ValueError("generate_babilong needs a fast (Rust) tokenizer to count tokens quickly")
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be at least 1")
    if length < 0:
        raise ValueError(f"length={length} must be >= 0 (0 = facts only)")
    indices = checked_row_indices(num_samples, row_indices)
    sentences, contiguous = haystack_sentence_pool("titans_babilong", haystack_files, haystack_dataset, num_samples,
                                                   length, seed, expected_haystack_digests)
    counts = token_counts(tokenizer, sentences) if length > 0 else []
    all_facts = _all_facts(task)
    fact_counts = dict(zip(all_facts, token_counts(tokenizer, all_facts)))
    longest_story = STORY_FACTS[task][1] * max(fact_counts.values())
    if 0 < length < longest_story:
        raise ValueError(
            f"length={length} is shorter than the longest {task} story ({longest_story} tokens of this "
            "tokenizer); use length=0 for stories alone or a larger length"
        )

    progress = tqdm(total=len(indices), desc=f"generating {task} @ {length}", disable=not show_progress)
    for batch_start in range(0, len(indices), batch_size):
        rows, pieces_per_row = [], []
        for index in indices[batch_start : batch_start + batch_size]:
            rng = _row_random(task, length, seed, index)
            facts, question, answer = _story(task, rng)
            budget = length - sum(fact_counts[f] for f in facts)
            haystack = draw_haystack(sentences, counts, budget, contiguous, rng) if length > 0 else []
            gaps = sorted(rng.choices(range(len(haystack) + 1), k=len(facts)))
            pieces = _interleave(haystack, facts, gaps)
            pieces_per_row.append(pieces)
            rows.append({"input": " ".join(text for text, _ in pieces), "question": question, "target": answer})
        if length > 0:
            _trim_to_length(rows, pieces_per_row, tokenizer, length)
        progress.update(len(rows))
        yield rows
    progress.close()


def draw_haystack(
    sentences: list[str], counts: list[int], budget: int, contiguous: bool, rng: random.Random
) -> list[str]:
    """Haystack sentences until the next one would pass ``budget`` tokens.

    Book text must stay contiguous, so it stops at the first sentence that does not fit; prose
    drawn at random gets a few more draws to fill the gap left by a long sentence.
    """
    haystack: list[str] = []
    position = rng.randrange(len(sentences))
    used, misses = 0, 0
    while misses <= (0 if contiguous else 16):
        if not contiguous:
            position = rng.randrange(len(sentences))
        if used + counts[position] > budget:
            misses += 1
            continue
        haystack.append(sentences[position])
        used += counts[position]
        position = (position + 1) % len(sentences)
    return haystack


def _interleave(haystack: list[str], facts: list[str], gaps: list[int]) -> list[tuple[str, bool]]:
    """Haystack with fact k placed before haystack sentence ``gaps[k]``; (text, is_fact) pieces."""
    pieces: list[tuple[str, bool]] = []
    fact_index = 0
    for position in range(len(haystack) + 1):
        while fact_index < len(facts) and gaps[fact_index] == position:
            pieces.append((facts[fact_index], True))
            fact_index += 1
        if position < len(haystack):
            pieces.append((haystack[position], False))
    return pieces


def _trim_to_length(rows: list[dict], pieces_per_row: list[list], tokenizer, length: int) -> None:
    """Measure each input as one text and drop its last haystack sentences while it is too long.

    Per-sentence counts add up exactly for byte-level BPE; other tokenizers can merge across a
    sentence boundary, so the joined text is what decides.
    """
    pending = list(range(len(rows)))
    while pending:
        lengths = token_counts(tokenizer, [rows[i]["input"] for i in pending], leading_space=False)
        too_long = []
        for i, measured in zip(pending, lengths):
            if measured <= length:
                continue
            pieces = pieces_per_row[i]
            last_haystack = max((k for k, (_, is_fact) in enumerate(pieces) if not is_fact), default=None)
            if last_haystack is None:
                raise ValueError(f"the story alone of row {i} is {measured} tokens, over length={length}")
            del pieces[last_haystack]
            rows[i]["input"] = " ".join(text for text, _ in pieces)
            too_long.append(i)
        pending = too_long
