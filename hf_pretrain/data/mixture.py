"""Weighted mixtures of packed sources (web, code, books, ...): one training order, deterministic, resumable exactly.

`MixtureConfig` names the sources (each a `hf-pretrain data prepare` output folder, or a `save_to_disk` folder of
packed rows) with either a `weight` (its share of the tokens) or `epochs` (passes over its tokens), and optionally a
`schedule` of new weights from given token counts on (a curriculum, as OLMo-core's and levanter's mixtures). The
whole order is decided when the dataset is built, from the config and the sources' token counts alone:

- each source is read in a permutation of its rows drawn from (`seed`, source, pass), a new one at each pass, so a
  source that runs out repeats in another order (counted in `passes`);
- within a phase (between two token counts of the schedule), the next row comes from the source furthest behind its
  weight (`tokens so far in the phase / weight`, ties to the first source): the realised shares stay within two
  rows' tokens of the weights at every point, not only on average (a merge of per-source keys, vectorised);
- the length: `total_tokens`, else each source's passes (`epochs`), else until the first source would repeat.

`MixtureDataset` is a map-style dataset in that order (`keeps_order`: `PretrainTrainer`'s sampler reads it in order,
and its position is the one saved in `hf_pretrain_state.json`, so a resume continues exactly; `_fingerprint` names
the config and the sources, checked on resume). `tokens_per_source(samples)` is what the first `samples` rows hold:
`telemetry/mixture.py` logs the realised shares from it.

Why by hand: `datasets.interleave_datasets` draws by probability (shares right on average only) and has no token
weights or schedule; OLMo-core's and levanter's mixtures belong to their trainers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch


@dataclass
class MixtureConfig:
    sources: dict  # name -> {"path": folder, "weight": share} or {"path": folder, "epochs": passes}
    total_tokens: int | None = None
    schedule: list = field(default_factory=list)  # [{"at_tokens": N, "weights": {name: share, ...}}, ...]
    seed: int = 0
    split: str = "train"

    def __post_init__(self):
        if not isinstance(self.sources, dict) or not self.sources:
            raise ValueError("mixture sources: give an object of name -> {'path': ..., 'weight': ...}.")
        kinds = set()
        for name, source in self.sources.items():
            if not isinstance(source, dict) or "path" not in source:
                raise ValueError(f"mixture source {name!r}: give {{'path': folder, 'weight': share}} (or 'epochs').")
            unknown = sorted(set(source) - {"path", "weight", "epochs"})
            if unknown:
                raise ValueError(f"mixture source {name!r} has unknown key(s) {unknown}; valid: path, weight, epochs.")
            given = [k for k in ("weight", "epochs") if k in source]
            if len(given) != 1:
                raise ValueError(f"mixture source {name!r}: give exactly one of weight (share of tokens) or epochs.")
            if not source[given[0]] >= 0:
                raise ValueError(f"mixture source {name!r}: {given[0]}={source[given[0]]} must be >= 0.")
            kinds.add(given[0])
        if len(kinds) > 1:
            raise ValueError("mixture sources: give every source a weight, or every source epochs, not both.")
        if "epochs" in kinds and (self.schedule or self.total_tokens is not None):
            raise ValueError("mixture: epochs per source fix the length and shares; drop total_tokens and schedule.")
        if "weight" in kinds and not sum(s["weight"] for s in self.sources.values()) > 0:
            raise ValueError("mixture sources: the weights sum to 0; give at least one positive weight.")
        if self.schedule and self.total_tokens is None:
            raise ValueError("mixture: a schedule needs total_tokens (where the last phase ends).")
        if self.total_tokens is not None and self.total_tokens < 1:
            raise ValueError(f"mixture total_tokens={self.total_tokens}: use a positive number of tokens.")
        last = 0
        for phase in self.schedule:
            if not isinstance(phase, dict) or set(phase) != {"at_tokens", "weights"}:
                raise ValueError(f"mixture schedule entry {phase!r}: give {{'at_tokens': N, 'weights': {{...}}}}.")
            if not last < phase["at_tokens"] < self.total_tokens:
                raise ValueError(
                    f"mixture schedule at_tokens={phase['at_tokens']}: increasing, between 0 and total_tokens."
                )
            unknown = sorted(set(phase["weights"]) - set(self.sources))
            if unknown or not sum(phase["weights"].values()) > 0:
                raise ValueError(f"mixture schedule weights {phase['weights']}: sources of the mixture, sum > 0.")
            last = phase["at_tokens"]

    @classmethod
    def from_file(cls, path: str | Path) -> MixtureConfig:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"mixture config {str(path)!r} cannot be read: {err}") from None

    def phases(self, tokens: dict[str, int]) -> list[tuple[int, dict[str, float]]]:
        """[(tokens at which the phase ends, weights)], weights normalised; from epochs: each source's passes."""
        names = list(self.sources)
        if "epochs" in next(iter(self.sources.values())):
            planned = {n: self.sources[n]["epochs"] * tokens[n] for n in names}
            total = sum(planned.values())
            if total <= 0:
                raise ValueError("mixture: the sources hold no tokens for the epochs asked.")
            return [(int(round(total)), {n: planned[n] / total for n in names})]
        starts = [(0, {n: self.sources[n]["weight"] for n in names})]
        starts += [(p["at_tokens"], {n: p["weights"].get(n, 0.0) for n in names}) for p in self.schedule]
        normalised = [(at, {n: w / sum(weights.values()) for n, w in weights.items()}) for at, weights in starts]
        total = self.total_tokens
        if total is None:  # until the first source would start a second pass
            total = int(min(tokens[n] / w for n, w in normalised[0][1].items() if w > 0))
        ends = [at for at, _ in normalised[1:]] + [total]
        return [(end, weights) for end, (_, weights) in zip(ends, normalised)]


def source_rows(seed: int, source: int, num_rows: int, start: int, count: int) -> np.ndarray:
    """Rows `start .. start + count` of a source's stream: a permutation of its rows per pass, seeded per pass."""
    out, position = [], start
    while position < start + count:
        epoch, offset = divmod(position, num_rows)
        order = np.random.default_rng([seed, source, epoch]).permutation(num_rows)
        take = min(num_rows - offset, start + count - position)
        out.append(order[offset : offset + take])
        position += take
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def mixture_order(config: MixtureConfig, lengths: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(source index, row) of every sample in training order, for sources with these per-row token counts."""
    names = list(config.sources)
    tokens = {n: int(lengths[n].sum()) for n in names}
    consumed = dict.fromkeys(names, 0)  # rows of each source's stream used so far
    sources, rows, done = [], [], 0
    for end, weights in config.phases(tokens):
        budget = end - done
        if budget <= 0:
            continue
        keys, owners, picked = [], [], []
        for index, name in enumerate(names):
            weight, length = weights[name], lengths[name]
            if weight <= 0:
                continue
            if len(length) == 0 or tokens[name] == 0:
                raise ValueError(f"mixture source {name!r} has no tokens but weight {weight}.")
            need = budget * weight + 2 * int(length.max()) + 1  # enough rows for the merge, whatever the order
            count = int(np.ceil(need / max(length.mean(), 1))) + 2
            candidate = source_rows(config.seed, index, len(length), consumed[name], count)
            while int(length[candidate].sum()) < need:
                count *= 2
                candidate = source_rows(config.seed, index, len(length), consumed[name], count)
            sizes = length[candidate]
            keys.append((np.cumsum(sizes) - sizes) / weight)  # tokens of this source in the phase before the row
            owners.append(np.full(len(candidate), index, np.int64))
            picked.append(candidate)
        key, owner, row = np.concatenate(keys), np.concatenate(owners), np.concatenate(picked)
        merged = np.lexsort((owner, key))
        size = np.empty(len(row), np.int64)
        for i in np.unique(owner):
            size[owner == i] = lengths[names[i]][row[owner == i]]
        take = int(np.searchsorted(np.cumsum(size[merged]), budget, side="left")) + 1
        chosen = merged[:take]
        sources.append(owner[chosen])
        rows.append(row[chosen])
        done += int(size[chosen].sum())
        for i in np.unique(owner[chosen]):
            consumed[names[i]] += int((owner[chosen] == i).sum())
    return np.concatenate(sources), np.concatenate(rows)


def load_source(path: str | Path, split: str):
    """A source's packed rows: a `prepare` output folder's (or output URL's) split (`load_packed`), or a
    `save_to_disk` folder."""
    from datasets import load_from_disk

    from .prepared import load_packed
    from .storage import is_url

    path = path if is_url(path) else Path(path)
    if not is_url(path) and not path.exists():
        raise FileNotFoundError(f"mixture source path {str(path)!r} does not exist; give a prepare output folder.")
    if is_url(path) or any(path.glob("*-pack")):
        packed = load_packed(path)
        if split not in packed:
            raise ValueError(f"mixture source {str(path)!r} has no packed {split!r} split ({sorted(packed)}).")
        return packed[split]
    return load_from_disk(str(path))


class MixtureDataset(torch.utils.data.Dataset):
    """The mixture's rows in training order (see the module docstring); items hold `input_ids` (and `source`)."""

    keeps_order = True  # PretrainTrainer's sampler reads it in this order (training/resume/data_position.py)

    def __init__(self, config: MixtureConfig):
        self.config = config
        self.names = list(config.sources)
        self.sources = [load_source(config.sources[n]["path"], config.split) for n in self.names]
        lengths = {
            n: np.asarray(pc.list_value_length(d.data.column("input_ids")), np.int64)[self._indices(d)]
            for n, d in zip(self.names, self.sources)
        }
        self.source_tokens = {n: int(lengths[n].sum()) for n in self.names}
        self.source_of, self.row_of = mixture_order(config, lengths)
        self.row_tokens = np.empty(len(self.row_of), np.int64)
        for i, name in enumerate(self.names):
            mine = self.source_of == i
            self.row_tokens[mine] = lengths[name][self.row_of[mine]]
        self.passes = {
            n: float(np.bincount(self.source_of, minlength=len(self.names))[i] / max(len(lengths[n]), 1))
            for i, n in enumerate(self.names)
        }
        spec = json.dumps([config.__dict__, [d._fingerprint for d in self.sources]], sort_keys=True, default=str)
        self._fingerprint = hashlib.sha1(spec.encode()).hexdigest()[:16]

    @staticmethod
    def _indices(data) -> np.ndarray | slice:
        """The Arrow rows of `data`'s rows (a selected or shuffled dataset keeps an indices mapping)."""
        mapping = data._indices
        return slice(None) if mapping is None else np.asarray(mapping.column(0), np.int64)

    def __len__(self) -> int:
        return len(self.row_of)

    def __getitem__(self, index: int) -> dict:
        source = int(self.source_of[index])
        return {"input_ids": self.sources[source][int(self.row_of[index])]["input_ids"], "source": source}

    def tokens_per_source(self, samples: int) -> dict[str, int]:
        """Tokens of each source in the first `samples` rows of the order (whole passes over it, then a prefix)."""
        passes, rest = divmod(int(samples), len(self))
        total = np.bincount(self.source_of, self.row_tokens, len(self.names)) * passes
        total += np.bincount(self.source_of[:rest], self.row_tokens[:rest], len(self.names))
        return {n: int(t) for n, t in zip(self.names, total)}

    def target_weights(self, tokens: int) -> dict[str, float]:
        """The weights of the phase holding token `tokens` of a pass."""
        phases = self.config.phases(self.source_tokens)
        within = tokens % max(int(self.row_tokens.sum()), 1)
        return next((w for end, w in phases if within < end), phases[-1][1])

    def describe(self) -> str:
        """One line per source: rows, tokens and share in the order, passes over the source."""
        totals = self.tokens_per_source(len(self))
        everything = max(sum(totals.values()), 1)
        lines = [f"mixture: {len(self):,} rows, {everything:,} tokens, seed {self.config.seed}"]
        for i, name in enumerate(self.names):
            rows = int((self.source_of == i).sum())
            lines.append(
                f"  {name:<12} {rows:>10,} rows {totals[name]:>14,} tokens  share {totals[name] / everything:.3f}"
                f"  passes {self.passes[name]:.2f}"
            )
        return "\n".join(lines)
