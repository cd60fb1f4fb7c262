"""--mixture's flag checks (`training/arguments.py`): refused before any data work, one tokenizer for its sources."""

import json
from pathlib import Path

import pytest

from hf_pretrain.data import embedded_documents
from hf_pretrain.data.chain import run_pipeline
from hf_pretrain.data.mixture import MixtureConfig
from hf_pretrain.data.pipeline_config import PipelineConfig
from hf_pretrain.data.prepared import tokenizer_path
from hf_pretrain.training.arguments import check_mixture_flags, mixture_tokenizer


def prepared(tmp_path: Path, name: str, documents: list[str], tokenizer: dict) -> Path:
    """A source as `hf-pretrain data prepare` writes it, up to its tokenizer (trained here, or the one given)."""
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in documents) + "\n")
    config = PipelineConfig(
        input=str(corpus), output_dir=str(tmp_path / name), clean=None, dedup=None, tokenizer=tokenizer, pack=None
    )
    run_pipeline(config, verbose=False)
    return tmp_path / name


def mixture(tmp_path: Path, **paths: Path) -> Path:
    path = tmp_path / "mixture.json"
    path.write_text(json.dumps({"sources": {n: {"path": str(p), "weight": 1.0} for n, p in paths.items()}}))
    return path


def test_mixture_flags_are_one_error_line_each(tmp_path):
    with pytest.raises(FileNotFoundError, match="--mixture 'no/such.json' is not a file"):
        check_mixture_flags("no/such.json")
    good = mixture(tmp_path, web=tmp_path)
    with pytest.raises(ValueError, match="--mixture and --dataset_path exclude each other"):
        check_mixture_flags(str(good), dataset_path="corpus.jsonl")
    check_mixture_flags(str(good))  # a valid config, no --dataset_path: accepted
    (tmp_path / "bad.json").write_text('{"sources": {"web": {"path": "x"}}}')
    with pytest.raises(ValueError, match="mixture source 'web': give exactly one of weight"):
        check_mixture_flags(str(tmp_path / "bad.json"))


def test_the_sources_tokenizer_is_the_mixtures_and_two_tokenizers_are_refused(tmp_path):
    docs = embedded_documents()
    web = prepared(tmp_path, "web", docs[:40], {"vocab_size": 300})
    code = prepared(tmp_path, "code", docs[40:80], {"path": str(tokenizer_path(web))})
    config = MixtureConfig.from_file(mixture(tmp_path, web=web, code=code))
    assert mixture_tokenizer(config) == str(tokenizer_path(web))
    assert mixture_tokenizer(config, "my/tokenizer") == "my/tokenizer"  # the flag wins when the sources agree
    other = prepared(tmp_path, "other", docs[80:120], {"vocab_size": 300})  # its own tokenizer
    config = MixtureConfig.from_file(mixture(tmp_path, web=web, other=other))
    with pytest.raises(ValueError, match=r"the sources \['other', 'web'\] were tokenized by different tokenizers"):
        mixture_tokenizer(config, "my/tokenizer")
    unprepared = MixtureConfig.from_file(mixture(tmp_path, raw=tmp_path / "raw"))
    with pytest.raises(ValueError, match="no source is a prepare output folder .* give --tokenizer_name_or_path"):
        mixture_tokenizer(unprepared)
    assert mixture_tokenizer(unprepared, "my/tokenizer") == "my/tokenizer"
