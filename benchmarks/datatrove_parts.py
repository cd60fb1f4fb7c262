"""Our data blocks against datatrove's own parts, pair by pair, measured in one run: quality, speed, memory, faults.

Pairs (ours | datatrove 0.10's), each side run as one task in a process of its own, forked from one "zygote" process
that was forked once the libraries (and the modules they load lazily) were imported and before any input existed:
neither side pays an import, every task starts from the same heap, and what a task builds itself (spaCy's tokenizer
included) is counted. Datatrove's default shingle hash (xxhash64 of a str) raises with xxhash 4, which this package
installs ("Strings must be encoded before hashing"; datatrove's own extras pin xxhash < 4): the benchmark encodes
the str as UTF-8, as xxhash 3 did, and gives exact dedup a `content_getter` that returns bytes.

- MinHash near-dedup on `benchmarks/dedup.py`'s planted corpus (copies edited to target Jaccard 1.0 ... 0.5):
  the chain's one dedup driver (`chain/dedup_shards.py`, in one process over one shard) | `MinhashDedupSignature` -> `MinhashDedupBuckets` -> `MinhashDedupCluster`
  -> `MinhashDedupFilter` on datatrove's `LocalPipelineExecutor` (one worker; the buckets stage one task per band).
  The same 5-word shingles, seed and banding (14 bands x 9 rows: `lsh_params(0.8, 128)`). Cannot match: their
  shingles are spaCy word tokens of a simplified text (punctuation removed, digits to 0, accents stripped), ours
  whitespace words lower-cased; they link every candidate pair sharing a band (no check of the estimated Jaccard:
  ours verifies with all 128 permutations); their signatures are 64-bit hashes, ours 31-bit.
- exact dedup on the same corpus: the same driver with `minhash` off | `ExactDedupSignature` -> `ExactFindDedups` -> `ExactDedupFilter`
  with our normalisation (lower-cased, whitespace collapsed) as its `content_getter`; their hash has 64 bits, ours
  128.
- rule filters on the embedded corpus (`corpus.embedded_documents`, `--size` copies of it for speed; drops counted
  on one copy): `Clean` with its rewrites off (datatrove's filters see the raw text) and only the rules of the pair,
  at datatrove's thresholds | `GopherQualityFilter`, `GopherRepetitionFilter`, `C4QualityFilter`,
  `FineWebQualityFilter` with their defaults. Ours has a subset: Gopher quality = word count 50-100,000,
  `symbol_ratio`, `bullet_lines`, `ellipsis_lines`, `alpha_words`, `word_length`, `stop_words` (2); Gopher
  repetition = `duplicate_lines`, `duplicate_line_chars` only (no paragraph or n-gram rules); FineWeb =
  `line_punct` only; C4 = none. Their words are spaCy tokens (punctuation tokens split off), ours whitespace tokens.
- readers: `ReadFiles` (rows to an Arrow dataset, fields as columns, ids) | `JsonlReader` / `ParquetReader`
  (Python `Document`s), on .jsonl, .jsonl.gz, .jsonl.zst and .parquet files of the planted corpus.
- faults: a folder of one broken file (a .zst or .gz cut in half, a .parquet cut in half, two lines of invalid
  UTF-8) and one whole file: what each reads, counts, warns or raises.

Measures: docs/s per core = documents / the task process's CPU seconds (steadier than wall-clock on a shared
machine); RSS added = the task's peak resident memory above its start (`chain/stages.py`'s `PeakMemory`, psutil
sampled every 20 ms); recall / precision as `benchmarks/dedup.py` defines them; "dissimilar docs kept": of the
documents in no planted pair of exact Jaccard >= threshold - 0.1, the fraction kept. Ratios are theirs / ours, both
measured in this run; a one-line verdict per pair names what each side measures better on (where recall or
precision differ by more than 2 %, dissimilar docs kept by 0.1 %, speed or memory by 10 %). Each task's log lines
(datatrove's) go to `WORKDIR/logs/`. On a shared machine run it with `nice`: absolute figures are noisy, ratios
within a run less so. Sizes: tiny (seconds: the test), small (the default: about a minute on 2 cores), large.

    nice -n 10 python benchmarks/datatrove_parts.py [--size tiny|small|large] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gzip
import importlib.util
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dedup import ExactJaccard, evaluate, planted_corpus  # noqa: E402

THRESHOLD, NUM_PERM, SHINGLE, SEED = 0.8, 128, 5, 1
THEIRS_NEEDS = ("datatrove", "spacy", "orjson", "zstandard")  # datatrove's English tokenizer, JSONL reader, .zst


class Size(NamedTuple):
    planted: int  # documents of the planted corpus (dedup)
    filter_docs: int | None  # the embedded corpus's first documents (None: all)
    filter_copies: int  # copies of them in the timed filter runs
    read_docs: int  # documents of each reader's files


SIZES = {
    "tiny": Size(planted=200, filter_docs=40, filter_copies=1, read_docs=200),
    "small": Size(planted=4000, filter_docs=None, filter_copies=2, read_docs=20_000),
    "large": Size(planted=20_000, filter_docs=None, filter_copies=10, read_docs=100_000),
}

# -- ours: the rule filters as `Clean` configs (rewrites off; only the pair's rules, at datatrove's thresholds) --

NO_REWRITES = dict(
    remove_html=False,
    normalize_unicode=None,
    remove_urls=False,
    remove_emails=False,
    normalize_whitespace=False,
    max_bytes=None,
    long_documents="drop",
    min_tokens=None,
    max_tokens=None,
)
FILTERS = {  # pair -> (datatrove's filter class, our rules)
    "gopher quality": (
        "GopherQualityFilter",
        dict(
            min_tokens=50,
            max_tokens=100_000,
            max_symbol_word_ratio=0.1,
            max_bullet_line_fraction=0.9,
            max_ellipsis_line_fraction=0.3,
            min_alpha_word_fraction=0.8,
            min_mean_word_length=3.0,
            max_mean_word_length=10.0,
            min_stop_words=2,
        ),
    ),
    "gopher repetition": (
        "GopherRepetitionFilter",
        dict(max_duplicate_line_fraction=0.3, max_duplicate_line_char_fraction=0.2),
    ),
    "c4 quality": ("C4QualityFilter", None),  # ours has no C4 rules
    "fineweb quality": ("FineWebQualityFilter", dict(min_line_punct_fraction=0.12)),
}
READERS = {
    "read jsonl": ".jsonl",
    "read jsonl.gz": ".jsonl.gz",
    "read jsonl.zst": ".jsonl.zst",
    "read parquet": ".parquet",
}
FAULTS = ("cut .zst", "cut .gz", "truncated .parquet", "invalid UTF-8 lines")
PAIRS = ("minhash dedup", "exact dedup", *FILTERS, *READERS)

# -- one task in a process of its own --------------------------------------------------------------


class Tasks:
    """Runs each task in a process of its own, forked from a "zygote" forked here once the libraries are loaded and
    before any input exists: every task starts from the same heap. (Forked from this process, a task would fill the
    free memory that earlier work left here without its resident memory growing: its RSS added would depend on what
    ran before it.) A task is named by its function: the zygote has the same module state."""

    def __init__(self):
        context = multiprocessing.get_context("fork")
        self._requests, requests = context.Pipe()
        self._zygote = context.Process(target=self._serve, args=(requests,))
        self._zygote.start()
        requests.close()

    def run(self, log: Path, function: Callable, *args) -> dict:
        """`function(*args)` as one task: {"value", "cpu" seconds, "rss_added" bytes} or {"error"}; the task's stdout
        and stderr (datatrove's log lines) go to `log`."""
        self._requests.send((log, function.__name__, args))
        return self._requests.recv()

    def close(self) -> None:
        self._requests.send(None)
        self._zygote.join()

    @staticmethod
    def _serve(requests) -> None:
        while (request := requests.recv()) is not None:
            log, name, args = request
            requests.send(forked(log, globals()[name], *args))


def forked(log: Path, function: Callable, *args) -> dict:
    """`function(*args)` in a forked process (`Tasks.run`)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_task, args=(send, log, function, args))
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        result = {"error": f"the task process died (exit code {process.exitcode}); its log: {log}"}
    process.join()
    return result


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc `malloc_trim`): a forked task starts with the free memory
    its parent left, which it would fill without its resident memory growing (its RSS added would then depend on what
    ran before it)."""
    with contextlib.suppress(AttributeError, OSError):  # not glibc: the figure may read low after a large task
        ctypes.CDLL(None).malloc_trim(0)


def _task(send, log: Path, function: Callable, args: tuple) -> None:
    from hf_pretrain.data.chain.stages import PeakMemory

    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    release_free_memory()
    try:
        with PeakMemory() as memory:
            cpu = time.process_time()
            value = function(*args)
            cpu = time.process_time() - cpu
        send.send({"value": value, "cpu": cpu, "rss_added": memory.peak - memory.start})
    except Exception as err:  # the result of this side: recorded, never a crash of the benchmark
        send.send({"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"})
    finally:
        send.close()


# -- datatrove's side ----------------------------------------------------------------------------------


def documents(texts: list[str]) -> Callable:
    """A pipeline step yielding `texts` as datatrove `Document`s (ids: their positions)."""
    from datatrove.data import Document

    def source(data=None, rank: int = 0, world_size: int = 1):
        for i, text in enumerate(texts):
            yield Document(text=text, id=str(i))

    return source


def collector(kept: list[int]) -> Callable:
    """A last pipeline step noting the ids of the documents that reach it."""

    def sink(data, rank: int = 0, world_size: int = 1):
        for doc in data:
            kept.append(int(doc.id))
        yield from ()

    return sink


def run_stages(stages: list[tuple[list, int]], logs: Path) -> None:
    """Each (pipeline, tasks) on datatrove's local executor, one worker: the tasks one after another on one core."""
    from datatrove.executor import LocalPipelineExecutor

    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=str(logs / f"stage{i}")).run()


def kept_mask(n: int, kept: list[int]) -> np.ndarray:
    mask = np.zeros(n, bool)
    mask[kept] = True
    return mask


def utf8_encoded(hash_function: Callable[[bytes], int]) -> Callable[[str], int]:
    """Datatrove 0.10's default shingle hash (xxhash64) as it ran with xxhash < 4, which encoded a str as UTF-8: with
    xxhash 4 (what this package installs) it raises "TypeError: Strings must be encoded before hashing"."""
    return lambda text: hash_function(text.encode("utf-8"))


def theirs_minhash(texts: list[str], folder: Path, bands: int, rows: int) -> dict:
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    config = MinhashConfig(n_grams=SHINGLE, num_buckets=bands, hashes_per_bucket=rows, seed=SEED)
    signatures, buckets, remove = (str(folder / name) for name in ("signatures", "buckets", "remove"))
    signing = MinhashDedupSignature(signatures, config=config)
    signing._hash_func = utf8_encoded(signing._hash_func)
    kept: list[int] = []
    stages = [
        ([documents(texts), signing], 1),
        ([MinhashDedupBuckets(signatures, buckets, config=config)], bands),  # tasks: a multiple of the bands
        ([MinhashDedupCluster(buckets, remove, config=config, save_cluster_id=True)], 1),
        ([documents(texts), MinhashDedupFilter(remove), collector(kept)], 1),
    ]
    run_stages(stages, folder / "logs")
    groups = np.arange(len(texts))
    clusters = folder / "remove" / "000000.clusters"  # (document, cluster id) of every clustered document
    if clusters.exists():
        pairs = np.fromfile(clusters, "<u4").reshape(-1, 2).astype(np.int64)
        lowest: dict[int, int] = {}
        for doc, cluster in pairs.tolist():
            lowest[cluster] = min(lowest.get(cluster, doc), doc)
        groups[pairs[:, 0]] = [lowest[c] for c in pairs[:, 1].tolist()]
    return {"groups": groups, "kept": kept_mask(len(texts), kept)}


def normalised(doc) -> bytes:
    """Our exact dedup's normalisation (lower-cased, whitespace collapsed) as datatrove's `content_getter`, encoded:
    their default hash (xxhash64) takes no str with xxhash 4."""
    return " ".join(doc.text.lower().split()).encode("utf-8")


def theirs_exact(texts: list[str], folder: Path) -> dict:
    from datatrove.pipeline.dedup.exact_dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
    )

    config = ExactDedupConfig(content_getter=normalised)
    signatures, duplicates = str(folder / "signatures"), str(folder / "duplicates")
    kept: list[int] = []
    stages = [
        ([documents(texts), ExactDedupSignature(signatures, config=config)], 1),
        ([ExactFindDedups(signatures, duplicates, config=config)], 1),
        ([documents(texts), ExactDedupFilter(duplicates, config=config), collector(kept)], 1),
    ]
    run_stages(stages, folder / "logs")
    return {"kept": kept_mask(len(texts), kept)}


def counters(step) -> dict[str, int]:
    return {name: int(stat.total) for name, stat in step.stats.stats.items()}


def theirs_filter(name: str, texts: list[str]) -> dict:
    import datatrove.pipeline.filters as filters

    step = getattr(filters, name)()
    kept = [int(doc.id) for doc in step.run(documents(texts)())]
    found = counters(step)
    dropped = {k.removeprefix("dropped_"): v for k, v in found.items() if k.startswith("dropped_")}
    lines = sum(v for k, v in found.items() if k.startswith("line-filter-"))  # C4 removes lines of kept documents
    return {"kept": kept, "dropped": dropped, "lines_removed": lines}


def theirs_read(folder: Path, suffix: str) -> dict:
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from loguru import logger

    warnings: list[str] = []
    sink = logger.add(lambda message: warnings.append(message.record["message"]), level="WARNING")
    reader = (ParquetReader if suffix == ".parquet" else JsonlReader)(str(folder))
    docs, error = 0, ""
    try:
        for _ in reader.run():
            docs += 1
    except Exception as err:  # what a task of theirs dies of: recorded
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        logger.remove(sink)
    return {"docs": docs, "error": error, "warnings": warnings, "counters": counters(reader)}


# -- our side -----------------------------------------------------------------------------------------


def ours_minhash(texts: list[str], folder: Path) -> dict:
    """The chain's dedup stages (`dedup_shards.deduplicate`) on one shard: signatures, buckets (one task), clusters."""
    from hf_pretrain.data.chain.dedup_shards import deduplicate
    from hf_pretrain.data.dedup import DedupConfig

    config = DedupConfig(threshold=THRESHOLD, num_perm=NUM_PERM, shingle_size=SHINGLE, seed=SEED)
    codes, roots, _ = deduplicate(texts, config, folder)
    return {"groups": roots, "kept": codes == 0}


def ours_exact(texts: list[str], folder: Path) -> dict:
    """The same stages with `minhash` off: the exact band (the content hash of the normalised text) alone."""
    from hf_pretrain.data.chain.dedup_shards import deduplicate
    from hf_pretrain.data.dedup import DedupConfig

    codes, _, _ = deduplicate(texts, DedupConfig(minhash=False), folder)
    return {"kept": codes == 0}


def ours_filter(rules: dict, texts: list[str]) -> dict:
    from datasets import Dataset

    from hf_pretrain.data.clean import Clean, CleanConfig
    from hf_pretrain.data.quality import QualityThresholds

    off = {f.name: None for f in fields(QualityThresholds)}
    block = Clean(CleanConfig(**{**NO_REWRITES, **off, **rules}))
    kept = block.run(Dataset.from_dict({"text": texts, "doc_id": [str(i) for i in range(len(texts))]}))
    return {"kept": [int(i) for i in kept["doc_id"]], "dropped": dict(block.stats.dropped)}


def ours_read(folder: Path, cache: Path) -> dict:
    import datasets

    from hf_pretrain.data.read import ReadFiles

    before, datasets.config.HF_DATASETS_CACHE = datasets.config.HF_DATASETS_CACHE, str(cache)  # nothing reused
    reader = ReadFiles()
    try:
        docs, error = len(reader.run(str(folder))), ""
    except ValueError as err:
        docs, error = 0, f"ValueError: {str(err).splitlines()[0]}"
    finally:
        datasets.config.HF_DATASETS_CACHE = before
    corrupt = reader.stats.extra.get("corrupt_files", [])
    return {"docs": docs, "error": error, "dropped": dict(reader.stats.dropped), "corrupt_files": corrupt}


# -- inputs -------------------------------------------------------------------------------------------


def write_records(path: Path, texts: list[str], first_id: int = 0) -> None:
    """`texts` as {"id", "text"} records in the format `path`'s suffix names (.jsonl[.gz|.zst] or .parquet)."""
    records = [{"id": f"doc-{first_id + i}", "text": t} for i, t in enumerate(texts)]
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=max(len(records) // 4, 1))
        return
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def reader_inputs(root: Path, texts: list[str]) -> dict[str, Path]:
    """Per reader pair, a folder of two files holding `texts`."""
    folders = {}
    half = len(texts) // 2
    for pair, suffix in READERS.items():
        folder = folders[pair] = root / pair.replace(" ", "_")
        folder.mkdir(parents=True)
        write_records(folder / f"part-0{suffix}", texts[:half])
        write_records(folder / f"part-1{suffix}", texts[half:], half)
    return folders


def fault_inputs(root: Path, texts: list[str]) -> dict[str, Path]:
    """Per fault, a folder of a broken file `a` (cut in half, or two lines of invalid UTF-8) and a whole file `b`."""
    half = len(texts) // 2
    folders = {}
    for case, suffix in zip(FAULTS, (".jsonl.zst", ".jsonl.gz", ".parquet", ".jsonl")):
        folder = folders[case] = root / case.replace(" ", "_")
        folder.mkdir(parents=True)
        write_records(folder / f"a{suffix}", texts[:half])
        write_records(folder / f"b{suffix}", texts[half:], half)
        broken = folder / f"a{suffix}"
        whole = broken.read_bytes()
        if suffix == ".jsonl":
            lines = whole.split(b"\n")
            for i in (3, len(lines) // 2):  # invalid UTF-8 inside the text of two lines
                lines[i] = lines[i][:-20] + b"\xff\xfe" + lines[i][-20:]
            broken.write_bytes(b"\n".join(lines))
        else:
            broken.write_bytes(whole[: len(whole) // 2])  # a copy or download cut short
    return folders


# -- the runs --------------------------------------------------------------------------------------------


def dissimilar(n: int, planted, jaccard: ExactJaccard, floor: float) -> np.ndarray:
    """Documents in no planted pair of exact Jaccard >= floor (random pairs of this corpus have J ~ 0)."""
    close = {k for i, j, _ in planted if jaccard(i, j) >= floor for k in (i, j)}
    return np.array([i not in close for i in range(n)])


def dedup_quality(result: dict, planted, jaccard: ExactJaccard, far: np.ndarray) -> dict:
    if "error" in result:
        return result
    value = result["value"]
    metrics = evaluate(np.asarray(value["groups"]), planted, jaccard, THRESHOLD)
    kept = np.asarray(value["kept"])
    return {
        **result,
        "recall": metrics["recall"],
        "precision": metrics["precision"],
        "dissimilar_kept": float(kept[far].mean()) if far.any() else 1.0,
        "dropped": int((~kept).sum()),
    }


def run_dedup(tasks: Tasks, texts, planted, work: Path, logs: Path) -> dict:
    from hf_pretrain.data.dedup import DedupConfig

    config = DedupConfig(threshold=THRESHOLD, num_perm=NUM_PERM, shingle_size=SHINGLE, seed=SEED)
    jaccard = ExactJaccard(texts, SHINGLE)
    far = dissimilar(len(texts), planted, jaccard, THRESHOLD - 0.1)
    log = logs / "dedup.log"
    print(f"[dedup] datatrove's 4 MinHash stages on {len(texts):,} documents ...", flush=True)
    theirs = dedup_quality(
        tasks.run(log, theirs_minhash, texts, work / "theirs_minhash", config.bands, config.rows), planted, jaccard, far
    )
    print("[dedup] ours: the sharded stages; exact dedup, both ...", flush=True)
    ours = dedup_quality(tasks.run(log, ours_minhash, texts, work / "ours_minhash"), planted, jaccard, far)
    exact = {
        "ours": tasks.run(log, ours_exact, texts, work / "ours_exact"),
        "theirs": tasks.run(log, theirs_exact, texts, work / "exact"),
    }
    for side in exact.values():
        if "error" not in side:
            side["dropped"] = int((~side["value"]["kept"]).sum())
    ours_exact_kept = exact["ours"].get("value", {}).get("kept")
    theirs_exact_kept = exact["theirs"].get("value", {}).get("kept")
    if ours_exact_kept is not None and theirs_exact_kept is not None:
        exact["agree"] = int((ours_exact_kept == theirs_exact_kept).sum())
    return {
        "minhash dedup": {"ours": ours, "theirs": theirs},
        "exact dedup": exact,
        "far": int(far.sum()),
        "true_pairs": sum(jaccard(i, j) >= THRESHOLD for i, j, _ in planted),
        "bands_rows": (config.bands, config.rows),
    }


def run_filters(tasks: Tasks, docs: list[str], copies: int, logs: Path) -> dict:
    texts = docs * copies
    results = {}
    for pair, (name, rules) in FILTERS.items():
        print(f"[filters] {pair}: {len(texts):,} documents ...", flush=True)
        log = logs / "filters.log"
        theirs = tasks.run(log, theirs_filter, name, texts)
        ours = tasks.run(log, ours_filter, rules, texts) if rules is not None else None
        results[pair] = {"ours": ours, "theirs": theirs, "n": len(docs)}
        for side in (ours, theirs):
            if side and "error" not in side:
                v = side["value"]
                side["dropped_ids"] = set(range(len(docs))) - {i for i in v["kept"] if i < len(docs)}
                side["dropped"] = len(side["dropped_ids"])
                side["by_rule"] = {k: c // copies for k, c in sorted(v["dropped"].items(), key=lambda kv: -kv[1])}
    return results


def run_readers(tasks: Tasks, texts: list[str], work: Path, logs: Path) -> dict:
    folders = reader_inputs(work / "readers", texts)
    results = {}
    for n, (pair, folder) in enumerate(folders.items()):
        print(f"[readers] {pair}: {len(texts):,} documents in 2 files ...", flush=True)
        log = logs / "readers.log"
        theirs = tasks.run(log, theirs_read, folder, READERS[pair])
        ours = tasks.run(log, ours_read, folder, work / f"cache-read-{n}")
        results[pair] = {"ours": ours, "theirs": theirs}
        for side in (ours, theirs):
            if "error" not in side:
                side["docs"] = side["value"]["docs"]
    return results


def run_faults(tasks: Tasks, texts: list[str], work: Path, logs: Path) -> dict:
    folders = fault_inputs(work / "faults", texts)
    results = {}
    for n, (case, folder) in enumerate(folders.items()):
        print(f"[faults] {case} ...", flush=True)
        suffix = ".parquet" if "parquet" in case else ".jsonl"
        results[case] = {
            "ours": tasks.run(logs / "faults.log", ours_read, folder, work / f"cache-fault-{n}"),
            "theirs": tasks.run(logs / "faults.log", theirs_read, folder, suffix),
        }
    return results


# -- the table ----------------------------------------------------------------------------------------------


def per_core(side: dict | None, n: int) -> float | None:
    return n / side["cpu"] if side and "error" not in side and side["cpu"] > 0 else None


def rss_mb(side: dict | None) -> float | None:
    return side["rss_added"] / 2**20 if side and "error" not in side else None


def cell(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def ratio(ours, theirs) -> str:
    if ours is None or theirs is None:
        return "n/a"
    if ours == 0:
        return "=" if theirs == 0 else "inf"
    return f"{theirs / ours:.2f}"


def row(pair: str, measure: str, ours, theirs, fmt: str = ",.0f", rated: bool = True) -> str:
    shown = ratio(ours, theirs) if rated else ""
    return f"{pair:<24} {measure:<38} {cell(ours, fmt):>12} {cell(theirs, fmt):>12} {shown:>11}"


# measure -> (direction: +1 higher is better, -1 lower is better; tolerance)
JUDGED = {
    "recall": (1, 0.02),
    "precision": (1, 0.02),
    "dissimilar kept": (1, 0.001),
    "docs read": (1, 0.0),
    "docs/s per core": (1, 0.10),
    "RSS added": (-1, 0.10),
}


def verdict(scores: dict[str, tuple[float | None, float | None]], note: str = "") -> str:
    """One line: which side measures better on what (`scores`: measure -> (ours, theirs))."""
    better: dict[str, list[str]] = {"ours": [], "theirs": []}
    for measure, (ours, theirs) in scores.items():
        direction, tolerance = JUDGED[measure]
        if ours is None or theirs is None:
            continue
        if direction * (ours - theirs) > tolerance * max(abs(ours), abs(theirs)):
            better["ours"].append(measure)
        elif direction * (theirs - ours) > tolerance * max(abs(ours), abs(theirs)):
            better["theirs"].append(measure)
    parts = [f"{side} better on {', '.join(m)}" for side, m in better.items() if m]
    return "  verdict: " + ("; ".join(parts) or "even on every measure") + (f"; {note}" if note else "")


def print_failures(ours: dict | None, theirs: dict | None) -> None:
    for side, result in (("ours", ours), ("theirs", theirs)):
        if result and "error" in result:
            print(f"{'':<24} {side}: failed: {result['error']}")


def print_dedup(results: dict, n: int) -> None:
    measures = (  # (label, key, format, the verdict's name for it)
        (f"recall (planted J >= {THRESHOLD})", "recall", ".3f", "recall"),
        (f"precision (found pairs J >= {THRESHOLD})", "precision", ".3f", "precision"),
        (f"dissimilar docs kept (of {results['far']:,})", "dissimilar_kept", ".4f", "dissimilar kept"),
        (f"docs dropped (of {n:,})", "dropped", ",.0f", None),
    )
    for pair in ("minhash dedup",):
        ours, theirs = results[pair]["ours"], results[pair]["theirs"]
        scores = {}
        for i, (label, key, fmt, judged) in enumerate(measures):
            values = (ours.get(key), theirs.get(key))
            print(row("" if i else pair, label, *values, fmt))
            if judged:
                scores[judged] = values
        scores["docs/s per core"] = (per_core(ours, n), per_core(theirs, n))
        scores["RSS added"] = (rss_mb(ours), rss_mb(theirs))
        print(row("", "docs/s per core", *scores["docs/s per core"]))
        print(row("", "RSS added, MB", *scores["RSS added"], ".1f"))
        print_failures(ours, theirs)
        print(verdict(scores))
    exact = results["exact dedup"]
    ours, theirs = exact["ours"], exact["theirs"]
    print(row("exact dedup", f"docs dropped (of {n:,})", ours.get("dropped"), theirs.get("dropped")))
    if "agree" in exact:
        print(row("", "same verdict on docs", exact["agree"], exact["agree"], rated=False))
    speed, memory = (per_core(ours, n), per_core(theirs, n)), (rss_mb(ours), rss_mb(theirs))
    print(row("", "docs/s per core", *speed))
    print(row("", "RSS added, MB", *memory, ".1f"))
    print_failures(ours, theirs)
    print(verdict({"docs/s per core": speed, "RSS added": memory}, "hash: ours 128 bits, theirs 64"))


def print_filters(results: dict, copies: int) -> None:
    for pair, r in results.items():
        ours, theirs, n = r["ours"], r["theirs"], r["n"]
        get = lambda side, key: side.get(key) if side and "error" not in side else None  # noqa: E731
        print(row(pair, f"docs dropped (of {n:,})", get(ours, "dropped"), get(theirs, "dropped")))
        if ours and "error" not in ours and "error" not in theirs:
            a, b = ours["dropped_ids"], theirs["dropped_ids"]
            print(f"{'':<24} {'both drop / only ours / only theirs':<38} {len(a & b)} / {len(a - b)} / {len(b - a)}")
        for side, s in (("ours", ours), ("theirs", theirs)):
            if s is None:
                print(f"{'':<24} ours: no such rules in hf_pretrain")
            elif "error" in s:
                print(f"{'':<24} {side}: failed: {s['error']}")
            else:
                rules = ", ".join(f"{k} {v}" for k, v in s["by_rule"].items()) or "none"
                print(f"{'':<24} {side} by rule: {rules}")
        if get(theirs, "value") and theirs["value"]["lines_removed"]:
            print(f"{'':<24} theirs also removed {theirs['value']['lines_removed'] // copies:,} lines of kept docs")
        speed = (per_core(ours, n * copies), per_core(theirs, n * copies))
        memory = (rss_mb(ours), rss_mb(theirs))
        print(row("", "docs/s per core", *speed))
        print(row("", "RSS added, MB", *memory, ".1f"))
        if ours is None:
            print("  verdict: only theirs has these rules")
        else:
            print(verdict({"docs/s per core": speed, "RSS added": memory}, "the drops differ with the rule sets"))


def read_failure(side: dict) -> dict | None:
    """The error of a read: its task's, or what the reader raised inside it."""
    error = side.get("error") or side["value"]["error"]
    return {"error": error} if error else None


def print_readers(results: dict, n: int) -> None:
    for pair, r in results.items():
        ours, theirs = r["ours"], r["theirs"]
        docs = (ours.get("docs"), theirs.get("docs"))
        speed, memory = (per_core(ours, n), per_core(theirs, n)), (rss_mb(ours), rss_mb(theirs))
        print(row(pair, f"docs read (of {n:,})", *docs))
        print(row("", "docs/s per core", *speed))
        print(row("", "RSS added, MB", *memory, ".1f"))
        print_failures(read_failure(ours), read_failure(theirs))
        print(
            verdict(
                {"docs read": docs, "docs/s per core": speed, "RSS added": memory},
                "ours writes an Arrow dataset (fields as columns), theirs yields Documents",
            )
        )


def describe_ours(s: dict) -> str:
    if "error" in s:
        return f"failed: {s['error']}"
    v = s["value"]
    counted = ", ".join(f"{k} {c}" for k, c in v["dropped"].items()) or "nothing"
    named = f" ({', '.join(v['corrupt_files'])})" if v["corrupt_files"] else ""
    return f"{v['docs']:,} docs; counted {counted}{named}" + (f"; {v['error']}" if v["error"] else "")


def describe_theirs(s: dict, expected: int) -> str:
    if "error" in s:
        return f"failed: {s['error']}"
    v = s["value"]
    out = f"{v['docs']:,} docs; " + (f"raised {v['error']}" if v["error"] else "no error")
    out += f"; counters {', '.join(f'{k} {c}' for k, c in v['counters'].items()) or 'none'}"
    if v["warnings"]:
        out += f"; warned {len(v['warnings'])}x: {v['warnings'][0][:90]!r}"
    return out + f"; {expected - v['docs']:,} not read"


def print_faults(results: dict, n: int) -> None:
    print(f"faults: a broken file a + a whole file b, {n:,} documents in all")
    for case, r in results.items():
        print(f"{case:<24} ours:   {describe_ours(r['ours'])}")
        print(f"{'':<24} theirs: {describe_theirs(r['theirs'], n)}")
        ours, theirs = r["ours"].get("value"), r["theirs"].get("value")
        if ours and theirs:
            counted = sum(ours["dropped"].values()) > 0
            silent = not theirs["error"] and theirs["docs"] < n
            print(
                "  verdict: "
                + ("ours reads more and counts the loss" if ours["docs"] > theirs["docs"] else "both read as much")
                + ("" if counted else " (ours counted nothing!)")
                + (
                    "; theirs' task dies"
                    if theirs["error"]
                    else "; theirs loses documents with no counter"
                    if silent
                    else ""
                )
            )


def missing_packages() -> list[str]:
    return [name for name in THEIRS_NEEDS if importlib.util.find_spec(name) is None]


def warm_up(work: Path) -> None:
    """What both sides import, loaded once here so that no task pays an import: the libraries, and the modules they
    load lazily (found by reading two documents of each format, and a `Clean` and an exact dedup run on them). No
    object of theirs is kept: each task builds its own (spaCy's tokenizer included), and that is counted."""
    import datasets
    import datatrove.executor  # noqa: F401
    import datatrove.pipeline.dedup  # noqa: F401
    import datatrove.pipeline.filters  # noqa: F401
    import psutil  # noqa: F401
    import spacy

    import hf_pretrain.data.chain.dedup_shards  # noqa: F401
    import hf_pretrain.data.chain.stages  # noqa: F401

    datasets.disable_progress_bars()
    spacy.blank("en")  # its language data's modules; the object itself is thrown away
    from loguru import logger

    texts = ["a first small document", "a second small document"]
    logger.disable("datatrove")  # its "Reading input file" lines
    for pair, folder in reader_inputs(work / "warm-up", texts).items():
        ours_read(folder, work / "warm-up" / "cache")
        theirs_read(folder, READERS[pair])
    logger.enable("datatrove")
    ours_filter(FILTERS["fineweb quality"][1], texts)
    ours_exact(texts, work / "warm-up" / "exact")
    shutil.rmtree(work / "warm-up")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="small", help="tiny: seconds (the test); large: more")
    parser.add_argument("--workdir", default=None, help="where files go (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    missing = missing_packages()
    if missing:
        raise SystemExit(
            f"benchmarks/datatrove_parts.py needs {', '.join(missing)} for datatrove's side: "
            f"pip install 'hf_pretrain[test]' (or pip install {' '.join(missing)})."
        )
    from importlib.metadata import version

    from hf_pretrain.data.corpus import embedded_documents

    size = SIZES[args.size]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="datatrove_parts-"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    warm_up(work)
    tasks, start = Tasks(), time.perf_counter()  # the zygote: forked before any input exists
    try:
        texts, planted = planted_corpus(size.planted, SEED)
        docs = embedded_documents()[: size.filter_docs]
        read_texts = planted_corpus(size.read_docs, SEED + 1)[0]
        fault_texts = read_texts[: min(len(read_texts), 2000)]
        dedup = run_dedup(tasks, texts, planted, work, logs)
        filters = run_filters(tasks, docs, size.filter_copies, logs)
        readers = run_readers(tasks, read_texts, work, logs)
        faults = run_faults(tasks, fault_texts, work, logs)
        bands, rows = dedup["bands_rows"]
        print(
            f"\nours vs datatrove {version('datatrove')}'s parts, --size {args.size}: one task each (a process of its "
            "own); docs/s per core = documents / the task's CPU seconds; RSS added = its peak resident memory above "
            "its start.\nDedup: planted corpus "
            f"{len(texts):,} docs, {len(planted):,} planted copies ({dedup['true_pairs']:,} pairs of exact J >= "
            f"{THRESHOLD}), {SHINGLE}-word shingles, {bands} bands x {rows} rows; filters: embedded corpus "
            f"{len(docs):,} docs (x{size.filter_copies} for speed)."
        )
        print(f"{'pair':<24} {'measure':<38} {'ours':>12} {'theirs':>12} {'theirs/ours':>11}")
        print_dedup(dedup, len(texts))
        print_filters(filters, size.filter_copies)
        print_readers(readers, len(read_texts))
        print_faults(faults, len(fault_texts))
        kept = logs if args.workdir else "removed with the temporary folder; pass --workdir to keep them"
        print(f"done in {time.perf_counter() - start:.0f} s; the tasks' logs: {kept}")
    finally:
        tasks.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return {**{k: v for k, v in dedup.items() if k in PAIRS}, **filters, **readers, **faults}


if __name__ == "__main__":
    main()
