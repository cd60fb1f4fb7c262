"""The chain on datatrove's executors (`data/chain/`): local processes, a real Ray cluster and a real one-node Slurm
give the documents, tokenizer and packed tokens of one task in this process; the sharded MinHash dedup keeps what a
brute-force reference keeps, whatever the number of shards; a killed task is rerun by a relaunch, a corrupt input file is counted and named, two launches
at once give the same output. The full matrix (every executor x every fault) is `exhaustive` (`make test-all`)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset, concatenate_datasets, load_from_disk

from benchmarks.engine_clusters import free_port, ray_head, slurm_cluster, slurm_missing, stop_group, wait_until
from hf_pretrain.cli import main
from hf_pretrain.data import embedded_documents
from hf_pretrain.data.chain import dedup_shards, run_pipeline
from hf_pretrain.data.dedup import EXACT, NEAR, REASONS, DedupConfig
from hf_pretrain.data.pipeline_config import PipelineConfig
from hf_pretrain.data.prepared import load_packed

from .test_pipeline import dirty_corpus

ROOT = Path(__file__).resolve().parents[2]
DEDUP_ON: dict = {}  # the dedup section's defaults
SETTINGS = {"heldout_fraction": 0.05, "tokenizer": {"vocab_size": 512}, "pack": {"seq_len": 128, "mode": "best_fit"}}


# ---- the sharded dedup against a brute-force reference (numpy only) --------------------------------------------------


def near_copies(seed: int = 0) -> list[str]:
    """The embedded documents, exact copies (case and spacing changed) and near copies (a word in 80 replaced)."""
    rng = np.random.default_rng(seed)
    docs = embedded_documents()
    texts = list(docs)
    for doc in docs[:40]:
        texts.append("  " + doc.upper())
    for doc in docs[40:120]:
        words = doc.split()
        for i in range(int(rng.integers(0, 80)), len(words), 80):
            words[i] = "edited"
        texts.append(" ".join(words))
    return [texts[i] for i in rng.permutation(len(texts))]


def sharded_codes(texts: list[str], shards: int, section: dict, tmp: Path) -> tuple[np.ndarray, dict, np.ndarray]:
    """The four stages over `shards` contiguous shards: each row's reason code, the counters, each row's kept copy."""
    codes, roots, counters = dedup_shards.deduplicate(texts, DedupConfig(**section), tmp, shards)
    return codes, counters, roots


def reference_verdicts(texts: list[str], config: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """The verdicts by brute force, without the sharded files, pair tasks or blocks: exact copies by their normalised
    text; every pair of documents sharing a band key linked when its estimated Jaccard >= threshold; clusters by a
    breadth-first search, each keeping its lowest index; a dropped document is an exact copy when an earlier one has
    its text, else a near one."""
    from hf_pretrain.data.lsh import band_keys, estimated_jaccard
    from hf_pretrain.data.minhash import minhash_signatures

    from .test_dedup import lowest_of_each_component

    first, pairs, copy = {}, [], np.zeros(len(texts), bool)
    for i, text in enumerate(" ".join(t.lower().split()) for t in texts):
        if text in first:
            pairs.append((first[text], i))
            copy[i] = True
        first.setdefault(text, i)
    signatures = minhash_signatures(texts, config.num_perm, config.shingle_size, config.seed)
    for band in band_keys(signatures, config.bands, config.rows).T:
        buckets: dict[int, list[int]] = {}
        for i, key in enumerate(band.tolist()):
            buckets.setdefault(key, []).append(i)
        for members in buckets.values():
            pairs += [(a, b) for k, b in enumerate(members) for a in members[:k]]
    pairs = np.array(pairs, np.int64).reshape(-1, 2)
    linked = estimated_jaccard(signatures[pairs[:, 0]], signatures[pairs[:, 1]]) >= config.threshold  # copies: 1.0
    roots = np.array(lowest_of_each_component(len(texts), pairs[linked]))
    dropped = roots != np.arange(len(texts))
    return np.where(dropped, np.where(copy, REASONS.index(EXACT), REASONS.index(NEAR)), 0), roots


@pytest.mark.parametrize("shards", [1, 3, 40])  # 40 shards: 3 key ranges per band
def test_sharded_dedup_drops_what_a_brute_force_reference_drops(tmp_path, shards):
    texts = near_copies()
    codes, counters, roots = sharded_codes(texts, shards, {}, tmp_path)
    expected_codes, expected_roots = reference_verdicts(texts, DedupConfig())
    assert counters["exact_duplicates"] >= 40 and counters["near_duplicates"] >= 40
    np.testing.assert_array_equal(codes, expected_codes)  # the same rows dropped, for the same reason
    np.testing.assert_array_equal(roots, expected_roots)  # each for the same kept copy
    assert counters["exact_duplicates"] == int((expected_codes == REASONS.index(EXACT)).sum())
    assert (counters["bands"], counters["rows"]) == (14, 9)


def test_the_clusters_stage_in_small_blocks_gives_the_one_block_result(tmp_path, monkeypatch):
    """Pairs read a few first ids at a time and merged into the forest block by block: the same verdicts and
    counters (a pair found by several bands or tasks counted once) as every pair in one block."""
    texts = near_copies()
    whole = sharded_codes(texts, 40, {}, tmp_path / "whole")
    blocks = []
    streamed = dedup_shards.pair_blocks

    def counted(*args):
        for block in streamed(*args):
            blocks.append(len(block))
            yield block

    monkeypatch.setattr(dedup_shards, "pair_blocks", counted)
    monkeypatch.setattr(dedup_shards, "_CLUSTER_PAIRS", 16)
    monkeypatch.setattr(dedup_shards, "_SAMPLE_STEP", 4)
    small = sharded_codes(texts, 40, {}, tmp_path / "small")
    assert len(blocks) > 10 and max(blocks) < sum(blocks) / 3, blocks  # many blocks, none near all the pairs
    np.testing.assert_array_equal(small[0], whole[0])
    np.testing.assert_array_equal(small[2], whole[2])
    assert small[1] == whole[1]


def test_sharded_exact_dedup_alone(tmp_path):
    texts = near_copies()
    codes, counters, _ = sharded_codes(texts, 3, {"minhash": False}, tmp_path)
    assert counters["exact_duplicates"] == int((codes == 1).sum()) >= 40 and counters["near_duplicates"] == 0
    seen, expected = set(), []
    for text in texts:
        key = " ".join(text.lower().split())
        expected.append(1 if key in seen else 0)
        seen.add(key)
    np.testing.assert_array_equal(codes, expected)


def test_planted_duplicates_through_the_local_executor_with_two_tasks(tmp_path):
    """The planted-duplicate corpus (benchmarks/dedup.py) in 2 files, 2 tasks: recall of the planted pairs of exact
    Jaccard >= 0.8 and the share of dissimilar documents kept (in no planted pair of J >= 0.7) both >= 0.95."""
    from .test_dedup import load_benchmark

    bench = load_benchmark()
    texts, planted = bench.planted_corpus(800, seed=5)
    (tmp_path / "raw").mkdir()
    for part, rows in enumerate((texts[:400], texts[400:])):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in rows)
        (tmp_path / "raw" / f"part-{part}.jsonl").write_text(lines)
    out = tmp_path / "out"
    config = PipelineConfig(
        input=str(tmp_path / "raw"),
        output_dir=str(out),
        heldout_fraction=0.0,
        clean=None,
        dedup={"verbose": False},
        tokenizer=None,
        pack=None,
        executor={"kind": "local", "tasks": 2, "workers": 1},
    )
    run_pipeline(config, verbose=False)
    rows = [json.loads(p.read_text())["rows"] for p in sorted((out / "01-documents" / "tasks").glob("*.json"))]
    assert rows == [400, 400]
    roots = dedup_shards.global_roots(out / "03-clusters" / "verdicts", np.array([0, 400, 800]))
    jaccard = bench.ExactJaccard(texts, 5)
    close = {k for i, j, _ in planted if jaccard(i, j) >= 0.7 for k in (i, j)}
    far = np.array([i not in close for i in range(len(texts))])
    recall = bench.evaluate(roots, planted, jaccard, 0.8)["recall"]
    print(f"recall {recall:.3f}, dissimilar kept {(roots == np.arange(len(texts)))[far].mean():.3f} of {far.sum()}")
    assert recall >= 0.95
    assert far.sum() > 300 and (roots == np.arange(len(texts)))[far].mean() >= 0.95


# ---- the chain on the executors --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The dirty corpus in 4 files (so 2 tasks read 2 files each) and the chain's output over it as one task in this
    process (no executor section), with dedup (`one`) and without (`one-nodedup`: the chain of the default Ray and
    Slurm runs, 3 stages instead of 5)."""
    root = tmp_path_factory.mktemp("engines")
    dirty_corpus(root / "raw2")
    (root / "raw").mkdir()
    for i, name in enumerate(sorted((root / "raw2").iterdir())):
        lines = name.read_bytes().splitlines(keepends=True)
        half = len(lines) // 2
        (root / "raw" / f"part-{2 * i}.jsonl").write_bytes(b"".join(lines[:half]))
        (root / "raw" / f"part-{2 * i + 1}.jsonl").write_bytes(b"".join(lines[half:]))
    for name, dedup in (("one", {}), ("one-nodedup", None)):
        config = PipelineConfig(input=str(root / "raw"), output_dir=str(root / name), dedup=dedup, **SETTINGS)
        run_pipeline(config, verbose=False)
    return root


def config_file(corpus: Path, out: Path, dedup: dict | None = DEDUP_ON, **executor) -> Path:
    path = out.parent / f"{out.name}.json"
    settings = {"input": str(corpus / "raw"), "output_dir": str(out), **SETTINGS, "dedup": dedup}
    path.write_text(json.dumps({**settings, "executor": executor}))
    return path


def documents(folder: Path, split: str) -> Dataset:
    return concatenate_datasets([load_from_disk(str(p)) for p in sorted((folder / split).glob("0*"))])


def packed_documents(rows: list[list[int]], eos: int) -> list[tuple[int, ...]]:
    """Every document of packed rows (best_fit: whole documents, each ending with EOS), sorted."""
    found = []
    for row in rows:
        ends = [i + 1 for i, token in enumerate(row) if token == eos]
        found += [tuple(row[a:b]) for a, b in zip([0, *ends], ends)]
    return sorted(found)


def assert_one_machine_result(corpus: Path, out: Path, reference: str = "one") -> None:
    """The same documents kept (in order, every field), the same tokenizer, every document's tokens packed once."""
    from transformers import AutoTokenizer

    reference = corpus / reference
    for split in ("train", "heldout"):
        one = documents(reference / "05-pack" / "documents", split)
        mine = documents(out / "05-pack" / "documents", split)
        assert mine["doc_id"] == one["doc_id"] and mine["text"] == one["text"]
    tokenizer = (reference / "04-tokenizer" / "tokenizer" / "tokenizer.json").read_text()
    assert (out / "04-tokenizer" / "tokenizer" / "tokenizer.json").read_text() == tokenizer
    eos = AutoTokenizer.from_pretrained(str(out / "04-tokenizer" / "tokenizer")).eos_token_id
    theirs, mine = load_packed(reference), load_packed(out)
    for split in ("train", "heldout"):
        assert packed_documents(mine[split]["input_ids"], eos) == packed_documents(theirs[split]["input_ids"], eos)
    one_stats = {s["block"]: s for s in json.loads((reference / "stats.json").read_text())}
    for s in json.loads((out / "stats.json").read_text()):
        if s["block"] in ("read", "clean", "exact_dedup", "minhash_dedup", "split"):
            expected = one_stats[s["block"]]
            assert (s["documents_in"], s["documents_out"], s["dropped"]) == (
                expected["documents_in"],
                expected["documents_out"],
                expected["dropped"],
            ), s["block"]


def cli(*args: str, env: dict | None = None, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "hf_pretrain.cli", "data", "prepare", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, **kwargs)


def test_local_executor_gives_the_one_machine_result_and_a_relaunch_reuses_it(corpus, tmp_path, capsys):
    out = tmp_path / "local"
    path = config_file(corpus, out)
    assert main(["data", "prepare", str(path), "--executor", "local", "--tasks", "2", "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "01-documents        2     2       0" in printed and "05-pack             2     2       0" in printed
    assert_one_machine_result(corpus, out)
    done = (out / "05-pack" / "tasks" / "00001.json").stat().st_mtime_ns
    assert main(["data", "prepare", str(path), "--executor", "local", "--tasks", "2"]) == 0
    assert "05-pack             2     0       2" in capsys.readouterr().out  # nothing ran again
    assert (out / "05-pack" / "tasks" / "00001.json").stat().st_mtime_ns == done
    assert main(["data", "prepare", str(path), "--executor", "local", "--tasks", "3"]) == 0  # another sharding
    assert "01-documents        3     3       0" in capsys.readouterr().out  # runs every stage again
    assert_one_machine_result(corpus, out)


def test_num_proc_under_the_local_executor_gives_the_result_without_it(corpus, tmp_path):
    """`num_proc` (the one-machine chain's worker processes; the docs' example sets it) under the local executor: the
    tasks run their blocks in their own process (datatrove's pool workers are daemonic: no `datasets` pool inside)
    and `num_proc` is how many run at once; the same documents, counts and packed tokens as without it."""
    out = tmp_path / "num-proc"
    path = config_file(corpus, out, None, kind="local", tasks=2)
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_proc": 2}))
    assert main(["data", "prepare", str(path)]) == 0
    assert_one_machine_result(corpus, out, "one-nodedup")


def test_the_tokenizer_is_trained_once_on_its_sample_and_packs_every_shard(corpus, tmp_path, capsys):
    """`tokenizer_sample_documents` below the training documents: one tokenizer task on that many, and every pack
    shard's rows are its tokens of that shard's documents (workers 1: the tasks run in this process)."""
    from transformers import AutoTokenizer

    out = tmp_path / "sample"
    path = config_file(corpus, out, None, kind="local", tasks=2, workers=1, tokenizer_sample_documents=50)
    assert main(["data", "prepare", str(path)]) == 0
    assert "04-tokenizer        1     1       0" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "04-tokenizer" / "tasks").iterdir()) == ["00000.json"]
    tasks = {t["stage"]: t for t in json.loads((out / "tasks.json").read_text())}
    assert list(tasks) == ["01-documents", "04-tokenizer", "05-pack"]  # dedup off: no buckets, no clusters
    for t in tasks.values():  # each task's memory: its peak, and what its block added (below the peak)
        assert len(t["seconds"]) == len(t["peak_rss_bytes"]) == len(t["rss_growth_bytes"]) == t["tasks"]
        assert all(0 <= grew < peak for grew, peak in zip(t["rss_growth_bytes"], t["peak_rss_bytes"])), t
    record = json.loads((out / "04-tokenizer" / "tasks" / "00000.json").read_text())
    assert (
        record["stats"][0]["extra"]["sample_documents"] == 50 < len(documents(out / "05-pack" / "documents", "train"))
    )
    tokenizer = AutoTokenizer.from_pretrained(str(out / "04-tokenizer" / "tokenizer"))
    for shard in ("00000", "00001"):
        texts = list(load_from_disk(str(out / "05-pack" / "documents" / "train" / shard))["text"])
        rows = list(load_from_disk(str(out / "05-pack" / "train" / shard))["input_ids"])
        expected = Counter(t for ids in tokenizer(texts)["input_ids"] for t in [*ids, tokenizer.eos_token_id])
        assert Counter(t for row in rows for t in row) == expected, shard  # every token of the shard, once


def train_six_steps(dataset, tokens: tuple[int, int], run: Path, resume=None, stop_at=None) -> dict:
    """The losses of 6 steps on `dataset()` (built anew, as a restarted job does), a checkpoint every 3."""
    from hf_pretrain import PretrainForCausalLM, PretrainTrainer
    from hf_pretrain.data.collator import PackedDocumentCollator
    from tests.conftest import quick_args, small_config
    from tests.training.test_resume import Record

    torch.manual_seed(0)
    args = quick_args(run, max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3)
    record = Record(stop_at)
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(small_config(vocab_size=512)),
        args=args,
        train_dataset=dataset(),
        data_collator=PackedDocumentCollator(eos_token_id=tokens[0], pad_token_id=tokens[1]),
        callbacks=[record],
    )
    trainer.train(resume_from_checkpoint=resume)
    return record.losses


def assert_resumes_exactly(dataset, tokens: tuple[int, int], tmp_path: Path) -> None:
    straight = train_six_steps(dataset, tokens, tmp_path / "straight")
    first = train_six_steps(dataset, tokens, tmp_path / "resumed", stop_at=3)
    second = train_six_steps(dataset, tokens, tmp_path / "resumed", resume=True)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    assert {**first, **second} == straight  # identical floats


def special_tokens(out: Path) -> tuple[int, int]:
    """The end-of-document and padding ids of a prepare's tokenizer."""
    from transformers import AutoTokenizer

    from hf_pretrain.data.prepared import tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path(out)))
    return tokenizer.eos_token_id, tokenizer.pad_token_id


def test_training_on_an_executors_shards_resumes_exactly(corpus, tmp_path):
    """`load_packed` over 2 packed shards is one dataset with a fixed fingerprint: 3 + 3 resumed steps give the
    losses of 6 straight (the sampler positioned in the concatenated rows, as on a one-machine prepare)."""
    out = tmp_path / "shards"
    assert main(["data", "prepare", str(config_file(corpus, out, kind="local", tasks=2, workers=1))]) == 0
    assert len(list((out / "05-pack" / "train").iterdir())) == 2
    assert_resumes_exactly(lambda: load_packed(out)["train"], special_tokens(out), tmp_path)


def test_a_mixture_of_an_executors_shards_and_a_one_machine_output_reads_every_shard_and_resumes_exactly(
    corpus, tmp_path
):
    """A mixture source may be an executor's output (a folder of packed shards): its tokens are every shard's, the
    order is the same for the same config, and training on it resumes exactly."""
    from hf_pretrain.data.mixture import MixtureConfig, MixtureDataset

    out = tmp_path / "shards"
    assert main(["data", "prepare", str(config_file(corpus, out, kind="local", tasks=2, workers=1))]) == 0
    shards = sorted((out / "05-pack" / "train").iterdir())
    assert len(shards) == 2
    config = MixtureConfig(
        sources={"web": {"path": str(out), "weight": 0.7}, "books": {"path": str(corpus / "one"), "weight": 0.3}}
    )
    mixture = MixtureDataset(config)
    shard_tokens = sum(len(ids) for shard in shards for ids in load_from_disk(str(shard))["input_ids"])
    assert mixture.source_tokens["web"] == shard_tokens  # both shards read
    again = MixtureDataset(config)
    assert again._fingerprint == mixture._fingerprint and len(again) == len(mixture) > 12
    assert [again[i]["input_ids"] for i in range(len(again))] == [mixture[i]["input_ids"] for i in range(len(mixture))]
    trained = mixture.tokens_per_source(len(mixture))
    assert trained["books"] > 0 and abs(trained["web"] / sum(trained.values()) - 0.7) < 0.05
    assert_resumes_exactly(lambda: MixtureDataset(config), special_tokens(out), tmp_path)


@pytest.fixture(scope="session")
def ray_address():
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("datatrove") is None:
        pytest.skip("ray or datatrove is not installed: pip install 'hf_pretrain[ray]' (make test installs it)")
    with ray_head() as address:
        yield address


@pytest.fixture(scope="session")
def slurm_env():
    if slurm_missing() or importlib.util.find_spec("datatrove") is None:
        pytest.skip(f"Slurm ({slurm_missing()}) or datatrove is not installed (make test installs them, as root)")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm of the tests runs its daemons as root")
    with slurm_cluster() as env:
        yield env


@pytest.fixture(scope="module")
def ray_in_process():
    """Ray started inside the test process (`ray.init`, no head of its own): the executor finds it initialised and
    runs its tasks there, as `executor.address: null` does on a machine without a cluster."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("datatrove") is None:
        pytest.skip("ray or datatrove is not installed: pip install 'hf_pretrain[ray]' (make test installs it)")
    import ray

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # as ray_head: a token in ~/.ray would switch it on
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def test_ray_in_process_gives_the_one_machine_result(corpus, tmp_path, capsys, ray_in_process):
    """Make test's Ray: the whole chain, dedup's buckets and clusters stages included, as Ray tasks."""
    out = tmp_path / "ray"
    path = config_file(corpus, out, kind="ray", tasks=2, mem_per_cpu_gb=1)
    assert main(["data", "prepare", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "(executor ray" in printed and "03-clusters         1     1       0" in printed, printed
    assert_one_machine_result(corpus, out)


@pytest.mark.exhaustive  # a Ray head and workers start in ~20 s; make test: Ray in the test process (above)
def test_ray_executor_gives_the_one_machine_result(corpus, tmp_path, ray_address):
    out = tmp_path / "ray"
    path = config_file(corpus, out, None, kind="ray", tasks=2, address=ray_address, mem_per_cpu_gb=1)
    run = cli(str(path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(executor ray" in run.stdout
    assert_one_machine_result(corpus, out, "one-nodedup")


def test_slurm_executor_gives_the_one_machine_result(corpus, tmp_path, slurm_env):
    out = tmp_path / "slurm"
    path = config_file(corpus, out, kind="slurm", tasks=2, mem_per_cpu_gb=1)  # dedup on: every stage an sbatch
    run = cli(str(path), env=slurm_env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[slurm] submitted job(s)" in run.stdout and "(executor slurm" in run.stdout
    assert "03-clusters         1     1       0" in run.stdout, run.stdout
    script = (out / "logs" / "01-documents" / "launch_script.slurm").read_text()
    assert "#SBATCH --array=0-1" in script and "launch_pickled_pipeline" in script
    assert_one_machine_result(corpus, out)


def test_slurm_without_its_commands_is_one_line_before_any_data_work(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # a machine that is no Slurm login node
    out = tmp_path / "slurm"
    assert main(["data", "prepare", str(config_file(corpus, out, kind="slurm", tasks=2))]) == 2
    error = capsys.readouterr().err
    assert "executor kind='slurm': sbatch, squeue, sinfo, scancel not on PATH" in error, error
    assert "Traceback" not in error and not out.exists()


@pytest.mark.parametrize(
    "option, refused",
    [({"partition": "nosuch"}, "Invalid partition"), ({"sbatch_args": {"nodes": 5}}, "not available")],
)
def test_a_task_the_cluster_would_refuse_is_one_line_before_any_submission(
    corpus, tmp_path, slurm_env, option, refused
):
    out = tmp_path / "slurm"
    run = cli(str(config_file(corpus, out, kind="slurm", tasks=2, mem_per_cpu_gb=1, **option)), env=slurm_env)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "the cluster refuses a task as configured" in run.stderr and refused in run.stderr, run.stderr
    assert "in the executor section" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()  # nothing read, nothing submitted


@pytest.mark.parametrize("listening", ["nothing", "http", "raylet"])
def test_a_wrong_ray_address_is_one_line_within_seconds(tmp_path, listening, request):
    """A closed port on the loopback, a port that answers but is no Ray (an HTTP server), or a gRPC server that is not
    Ray's GCS (the raylet's port of a running Ray node; the Ray client's 10001 without ray:// is the same): refused
    before any data work, where `ray.init` would retry for ever (`Failed to connect to GCS` every 30 s), or, on a gRPC
    port, for 20 s and end in a traceback."""
    import http.server
    import threading
    import time

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("datatrove") is None:
        pytest.skip("ray or datatrove is not installed: pip install 'hf_pretrain[ray]' (make test installs it)")
    server = None
    if listening == "http":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        address = f"127.0.0.1:{server.server_address[1]}"
    elif listening == "raylet":
        import ray

        request.getfixturevalue("ray_in_process")  # the run below is another process: it joins no Ray
        from hf_pretrain.data.chain.executors import gcs_answer

        assert gcs_answer(ray.get_runtime_context().gcs_address) is None  # the GCS of the same node passes
        node = ray.nodes()[0]
        address = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
    else:
        address = f"127.0.0.1:{free_port()}"
    out = tmp_path / "ray"
    path = tmp_path / "ray.json"
    config = {"input": str(ROOT / "README.md"), "output_dir": str(out), "tokenizer": None}
    path.write_text(json.dumps({**config, "executor": {"kind": "ray", "tasks": 2, "address": address}}))
    start = time.monotonic()
    try:
        run = cli(str(path), timeout=30)  # the unfixed hang: subprocess.TimeoutExpired
    finally:
        if server is not None:
            server.shutdown()
    assert run.returncode == 2 and time.monotonic() - start < 30, run.stderr[-3000:]
    said = {
        "nothing": f"nothing answers at {address} (Connection refused)",
        "http": "answers, but is no Ray",
        "raylet": f"a gRPC server answers at {address}, but not Ray's GCS (",
    }[listening]
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: executor address={address!r}: "), run.stderr[-3000:]
    assert said in lines[0] and lines[0].endswith("or null to start a local Ray for the run.")
    assert not out.exists()  # nothing read, nothing written


# ---- faults ----------------------------------------------------------------------------------------------------------

FAULTY_LAUNCH = """
from hf_pretrain.data.chain import stages
from hf_pretrain.data.chain import run_pipeline
from hf_pretrain.data.pipeline_config import PipelineConfig


class Stopped(stages.Documents):
    # Task 1 does its work, then, the first time only, stops before its completion mark: until it is killed, or
    # until the test writes GO. Every call of a task's work is counted in CALLS. Everything it reads is inside the
    # class: a Slurm task unpickles it (dill, by value) without this script's globals.
    files = {{"mark": {mark!r}, "go": {go!r}, "calls": {calls!r}}}

    def work(self, out, rank, world_size):
        import json, os, time
        from pathlib import Path

        mark, go = Path(self.files["mark"]), Path(self.files["go"])
        with open(self.files["calls"], "a") as calls:
            calls.write(f"{{rank}}\\n")
        result = super().work(out, rank, world_size)
        if rank == 1 and not mark.exists():
            parent = os.getppid()
            mark.write_text(json.dumps({{"pid": os.getpid(), "parent": parent}}))
            while os.getppid() == parent and not go.exists():  # a killed parent (a Ray actor) ends this orphan
                time.sleep(0.1)
            if not go.exists():
                os._exit(1)
        return result


stages.Documents = Stopped
if __name__ == "__main__":
    run_pipeline(PipelineConfig.from_file({config!r}))
"""


def faulty_launch(tmp_path: Path, path: Path, env: dict | None, name: str = "launch") -> subprocess.Popen:
    """A launch of `path` whose documents task 1 stops once (see FAULTY_LAUNCH), in its own process group; its
    output goes to `tmp_path/NAME.log` (a pipe nobody reads while it runs could fill and stop it)."""
    script = tmp_path / "faulty.py"
    marks = {key: str(tmp_path / f"{key}.txt") for key in ("mark", "go", "calls")}
    script.write_text(textwrap.dedent(FAULTY_LAUNCH.format(config=str(path), **marks)))
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, str(script)], cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=log
        )


def launch_output(tmp_path: Path, name: str = "launch") -> str:
    return (tmp_path / f"{name}.log").read_text()


def killed_task_then_relaunch(corpus: Path, tmp_path: Path, env: dict | None = None, **executor) -> str:
    """Launch with task 1 of the documents stage stopped, kill it (-9), relaunch; returns the relaunch's output."""
    out = tmp_path / executor["kind"]
    path = config_file(corpus, out, **executor)
    mark = tmp_path / "mark.txt"
    launch = faulty_launch(tmp_path, path, env)
    try:
        wait_until(lambda: mark.exists() or launch.poll() is not None, 300, "the stopped task")
        assert mark.exists(), launch_output(tmp_path)[-3000:]
        task = json.loads(mark.read_text())
        documents = out / "01-documents"
        assert (documents / "data" / "00001").exists() and not (documents / "tasks" / "00001.json").exists()
        wait_until(lambda: (documents / "tasks" / "00000.json").exists(), 300, "task 0 of the documents stage")
        if executor["kind"] == "ray":  # the actor that runs the task: Ray's retry runs it again in this launch
            os.kill(task["parent"], signal.SIGKILL)
        os.kill(task["pid"], signal.SIGKILL)
        if executor["kind"] == "local":  # the pool waits forever for a lost task: the launch dies with it
            stop_group(launch.pid, grace=0)
        launch.wait(timeout=600)
        output = launch_output(tmp_path)
    finally:
        stop_group(launch.pid, grace=0)
    if executor["kind"] == "ray":
        assert launch.returncode == 0, output[-3000:]
        return output
    if executor["kind"] == "slurm":
        assert launch.returncode != 0 and "01-documents: 1 of 2 task(s) did not complete ([1])" in output, output
    assert (documents / "tasks" / "00000.json").exists() and not (documents / "tasks" / "00001.json").exists()
    if executor["kind"] == "local":  # in this process: no second interpreter start
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["data", "prepare", str(path)]) == 0
        return printed.getvalue()
    relaunch = cli(str(path), env=env)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    return relaunch.stdout


def test_a_killed_local_task_is_rerun_by_a_relaunch(corpus, tmp_path):
    printed = killed_task_then_relaunch(corpus, tmp_path, kind="local", tasks=2, workers=2)
    assert "01-documents        2     1       1" in printed  # only the killed task ran again
    assert_one_machine_result(corpus, tmp_path / "local")


@pytest.mark.exhaustive
def test_a_killed_ray_task_is_rerun_by_ray(corpus, tmp_path, ray_address):
    killed_task_then_relaunch(corpus, tmp_path, kind="ray", tasks=2, address=ray_address, mem_per_cpu_gb=1)
    assert_one_machine_result(corpus, tmp_path / "ray")


@pytest.mark.exhaustive
def test_a_killed_slurm_task_is_rerun_by_a_relaunch(corpus, tmp_path, slurm_env):
    printed = killed_task_then_relaunch(corpus, tmp_path, env=slurm_env, kind="slurm", tasks=2, mem_per_cpu_gb=1)
    assert "01-documents        2     1       1" in printed
    assert_one_machine_result(corpus, tmp_path / "slurm")


def corrupt_corpus(folder: Path) -> None:
    import gzip

    folder.mkdir()
    docs = [json.dumps({"text": d}) + "\n" for d in embedded_documents()[:60]]
    (folder / "part-0.jsonl").write_text("".join(docs[:20]))
    whole = gzip.compress("".join(docs[20:40]).encode())
    (folder / "part-1.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # a download cut short
    (folder / "part-2.jsonl").write_text("".join(docs[40:]))


def check_corrupt_named(out: Path, printed: str) -> None:
    read = json.loads((out / "stats.json").read_text())[0]
    assert read["block"] == "read" and read["dropped"].get("corrupt_compression") == 1
    assert len(read["extra"]["corrupt_files"]) == 1 and read["extra"]["corrupt_files"][0].startswith("part-1.jsonl.gz")
    assert "corrupt input, read up to the break" in printed and "part-1.jsonl.gz:after" in printed


def test_a_corrupt_input_file_is_counted_and_named(tmp_path, capsys):
    corrupt_corpus(tmp_path / "raw")
    config = {"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "out"), "tokenizer": None, "clean": None}
    (tmp_path / "c.json").write_text(json.dumps({**config, "executor": {"kind": "local", "tasks": 3}}))
    assert main(["data", "prepare", str(tmp_path / "c.json")]) == 0
    check_corrupt_named(tmp_path / "out", capsys.readouterr().out)


def test_a_corrupt_parquet_file_is_left_out_counted_once_and_named(tmp_path, capsys):
    import pyarrow.parquet as pq

    (tmp_path / "raw").mkdir()
    docs = embedded_documents()[:60]
    for part in range(3):
        pq.write_table(pa.table({"text": docs[20 * part : 20 * (part + 1)]}), tmp_path / "raw" / f"part-{part}.parquet")
    whole = (tmp_path / "raw" / "part-1.parquet").read_bytes()
    (tmp_path / "raw" / "part-1.parquet").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    config = {"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "out"), "tokenizer": None, "clean": None}
    (tmp_path / "c.json").write_text(json.dumps({**config, "executor": {"kind": "local", "tasks": 2}}))
    assert main(["data", "prepare", str(tmp_path / "c.json")]) == 0
    read = json.loads((tmp_path / "out" / "stats.json").read_text())[0]
    assert read["dropped"] == {"corrupt_file": 1} and read["extra"]["corrupt_files"] == ["part-1.parquet"]  # once
    assert read["documents_in"] == 41  # the two whole files' rows, and one for the file left out
    assert "corrupt input, left out and counted as corrupt_file: part-1.parquet" in capsys.readouterr().out


def bad_files(folder: Path, good: bool = True) -> None:
    """Two good JSON Lines files (unless not `good`), then an empty one, one of 10 lines of bytes that are not UTF-8
    and one with a record that is not UTF-8: files sorted so that the second of 2 shards reads only the bad two."""
    folder.mkdir()
    docs = [json.dumps({"text": d}) + "\n" for d in embedded_documents()[:60]]
    if good:
        (folder / "a.jsonl").write_text("".join(docs[:30]))
        (folder / "b.jsonl").write_text("".join(docs[30:]))
    (folder / "x-empty.jsonl").write_bytes(b"")
    (folder / "y-garbage.jsonl").write_bytes(b"\n".join(bytes([0x80 + i]) * 40 for i in range(10)) + b"\n")
    (folder / "z-utf8.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n')


def stats_without_times(out: Path) -> list[dict]:
    stats = json.loads((out / "stats.json").read_text())
    for s in stats:
        s.pop("seconds")
        s["extra"].pop("peak_rss_bytes", None)
    return stats


def test_a_shard_of_bad_files_keeps_nothing_and_the_counts_do_not_depend_on_the_tasks(tmp_path, capsys):
    """With 2 tasks the second shard reads only files without a document: it keeps none, counted; the run gives the
    counts of 1 task. Only an input that yields nothing at all is the one-machine read's error, for any tasks."""
    bad_files(tmp_path / "raw")
    config = {"input": str(tmp_path / "raw"), "tokenizer": None, "clean": None, "dedup": None}
    for tasks in (1, 2):
        path = tmp_path / f"{tasks}.json"
        path.write_text(json.dumps({**config, "output_dir": str(tmp_path / f"out{tasks}")}))
        assert main(["data", "prepare", str(path), "--executor", "local", "--tasks", str(tasks)]) == 0, tasks
    read = stats_without_times(tmp_path / "out1")[0]
    assert (read["documents_in"], read["documents_out"], read["dropped"]) == (71, 60, {"invalid_utf8": 11})
    assert stats_without_times(tmp_path / "out2") == stats_without_times(tmp_path / "out1")
    assert (
        len(documents(tmp_path / "out2" / "05-pack" / "documents", "train"))
        + len(documents(tmp_path / "out2" / "05-pack" / "documents", "heldout"))
        == 60
    )
    bad_files(tmp_path / "nothing", good=False)
    capsys.readouterr()
    for tasks in (1, 2):
        path = tmp_path / f"nothing{tasks}.json"
        path.write_text(
            json.dumps({**config, "input": str(tmp_path / "nothing"), "output_dir": str(tmp_path / path.stem)})
        )
        assert main(["data", "prepare", str(path), "--executor", "local", "--tasks", str(tasks)]) == 2, tasks
        error = capsys.readouterr().err.splitlines()[-1]
        assert error.startswith("error: No document could be read from ") and all(
            name in error for name in ("x-empty.jsonl", "y-garbage.jsonl", "z-utf8.jsonl")
        ), error
        assert error.endswith(
            "11 line(s), dropped: 11 invalid_utf8. Fix those lines (each reason is explained in "
            "docs/data.md) or pass other files."
        ), error


def test_an_input_without_a_document_on_slurm_is_one_line_and_its_jobs_are_cancelled(tmp_path, slurm_env):
    """The stages are submitted at once: once the documents stage is complete and no shard kept a document, the run
    ends with the read's one line and cancels the later stages' jobs (and datatrove's stats jobs after them)."""
    bad_files(tmp_path / "nothing", good=False)
    config = {"input": str(tmp_path / "nothing"), "output_dir": str(tmp_path / "out"), "tokenizer": {"vocab_size": 512}}
    (tmp_path / "c.json").write_text(
        json.dumps({**config, "executor": {"kind": "slurm", "tasks": 2, "mem_per_cpu_gb": 1}})
    )
    run = cli(str(tmp_path / "c.json"), env=slurm_env)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1].startswith("error: No document could be read from "), run.stderr[-3000:]
    jobs = run.stdout.split("submitted job(s) ")[1].split(":")[0].split(", ")
    assert len(jobs) == 5  # documents, buckets, clusters, tokenizer, pack
    # nothing of this run left waiting (the documents job itself may still be completing, after its last write)
    squeue = ["squeue", "-h", "-t", "PENDING", "-o", "%F %E"]
    listed = subprocess.run(squeue, capture_output=True, text=True, env=slurm_env).stdout
    assert not set(jobs) & set(re.findall(r"\d+", listed)), listed


@pytest.mark.exhaustive
@pytest.mark.parametrize("kind", ["ray", "slurm"])
def test_a_corrupt_input_file_is_counted_and_named_on(kind, tmp_path, request):
    env, executor = None, {"kind": kind, "tasks": 3, "mem_per_cpu_gb": 1}
    if kind == "ray":
        executor["address"] = request.getfixturevalue("ray_address")
    else:
        env = request.getfixturevalue("slurm_env")
    corrupt_corpus(tmp_path / "raw")
    config = {"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "out"), "tokenizer": None, "clean": None}
    (tmp_path / "c.json").write_text(json.dumps({**config, "executor": executor}))
    run = cli(str(tmp_path / "c.json"), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    check_corrupt_named(tmp_path / "out", run.stdout)


def lock_waited_for(lock: Path) -> bool:
    """Whether a process waits for the flock on `lock` (a `->` line of /proc/locks names the waiters)."""
    inode = f":{lock.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("local"),
        pytest.param("ray", marks=pytest.mark.exhaustive),
        pytest.param("slurm", marks=pytest.mark.exhaustive),
    ],
)
def test_two_launches_at_once_run_a_task_once_and_give_the_one_machine_result(kind, corpus, tmp_path, request):
    """The first launch's task 1 stops holding its lock; a second launch waits for that lock, then finds the task
    done: it runs once, and both launches end with the one-machine result."""
    env, executor = None, {"kind": kind, "tasks": 2, "mem_per_cpu_gb": 1}
    if kind == "ray":
        executor["address"] = request.getfixturevalue("ray_address")
    if kind == "slurm":
        env = request.getfixturevalue("slurm_env")
    path = config_file(corpus, tmp_path / kind, **executor)
    first = faulty_launch(tmp_path, path, env)
    second = None
    try:
        wait_until(lambda: (tmp_path / "mark.txt").exists() or first.poll() is not None, 300, "the stopped task")
        second = faulty_launch(tmp_path, path, env, "second")
        lock = tmp_path / kind / "locks" / "01-documents-00001.lock"
        wait_until(lambda: lock_waited_for(lock) or second.poll() is not None, 300, "the second launch at the lock")
        (tmp_path / "go.txt").write_text("")
        for launch, name in ((first, "launch"), (second, "second")):
            assert launch.wait(timeout=600) == 0, launch_output(tmp_path, name)[-3000:]
    finally:
        for launch in (first, second):
            if launch is not None:
                stop_group(launch.pid, grace=0)
    assert (tmp_path / "calls.txt").read_text().split().count("1") == 1  # task 1's work ran once
    assert_one_machine_result(corpus, tmp_path / kind)
