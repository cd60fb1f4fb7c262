"""The chain's input and output in object storage: a real S3-compatible server (moto's server mode) on the loopback,
read and written with s3fs as a user's run uses S3, gives the counts and tokens of the same files read and written
locally, and training reads the published shards; a wrong bucket, a missing prefix and refused or missing
credentials are one line before any work."""

import json
import shutil
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hf_pretrain.cli import main
from hf_pretrain.data import embedded_documents
from hf_pretrain.data.prepared import files_signature, load_packed, tokenizer_path
from hf_pretrain.data.read import ReadFiles
from tests.data.test_pipeline import STAGES, dirty_corpus, error_line

BUCKET, OUT = "corpus", "prepared"
READ_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def typed_corpus(folder):
    """Parquet files of the embedded corpus with rows that are no document, and one file cut short."""
    folder.mkdir()
    texts = embedded_documents()[:60] + ["", None, "   "]
    pq.write_table(pa.table({"text": texts[::2]}), folder / "part-0.parquet")
    pq.write_table(pa.table({"text": texts[1::2]}), folder / "part-1.parquet")
    whole = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts}), whole)
    (folder / "part-2.parquet").write_bytes(whole.getvalue().to_pybytes()[:-100])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 on a free loopback port: an IAM user's keys, the bucket holding the dirty corpus (`raw/`) and the
    typed one (`typed/`); then every request must be signed with those keys (moto's `reset-auth`)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    setup = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    iam = boto3.client("iam", **setup)
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps(READ_ALL))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    s3 = boto3.client("s3", **setup)
    s3.create_bucket(Bucket=BUCKET)
    s3.create_bucket(Bucket=OUT)
    local = tmp_path_factory.mktemp("corpus")
    dirty_corpus(local / "raw")
    typed_corpus(local / "typed")
    for path in sorted(local.rglob("*.*")):
        s3.put_object(Bucket=BUCKET, Key=path.relative_to(local).as_posix(), Body=path.read_bytes())
    auth = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(auth).read()  # from here on, requests without the user's keys are refused
    yield {"endpoint": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"], "local": local}
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path):
    """The environment a user's run reads S3 with: keys, endpoint, region; no ~/.aws, no instance metadata."""
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "no-aws-config"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("HF_PRETRAIN_CACHE", str(tmp_path / "cache"))  # work folders and downloads: this test's
    s3fs.S3FileSystem.clear_instance_cache()  # a client made with other keys is not reused
    yield s3_server
    s3fs.S3FileSystem.clear_instance_cache()


def prepare(tmp_path, name: str, source: str, output: str | None = None) -> str:
    config = {
        "input": source,
        "output_dir": output or str(tmp_path / name),
        "heldout_fraction": 0.05,
        "tokenizer": {"vocab_size": 512},
        "pack": {"seq_len": 128, "mode": "best_fit"},
    }
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    return str(tmp_path / f"{name}.json")


def counters(output_dir) -> list[dict]:
    """Every block's counters, drop reasons and notes, without its seconds (a local folder or a URL)."""
    import fsspec

    with fsspec.open(f"{output_dir}/stats.json", "rt") as file:
        stats = json.load(file)
    return [{k: v for k, v in s.items() if k != "seconds"} for s in stats]


def test_prepare_from_s3_gives_the_local_runs_counts_and_tokens(s3_env, tmp_path, capsys, monkeypatch):
    from hf_pretrain.data import storage

    listed, list_objects = [], storage._list_objects
    monkeypatch.setattr(storage, "_list_objects", lambda url, field: listed.append(url) or list_objects(url, field))
    assert main(["data", "prepare", prepare(tmp_path, "local", str(s3_env["local"] / "raw"))]) == 0
    assert main(["data", "prepare", prepare(tmp_path, "s3", f"s3://{BUCKET}/raw")]) == 0
    # the input listed once a launch: its shards, its stage key and (tasks in this process) the reading (were 6)
    assert listed == [f"s3://{BUCKET}/raw"]
    assert counters(tmp_path / "s3") == counters(tmp_path / "local")
    read = counters(tmp_path / "s3")[0]
    assert read["dropped"] == {"malformed_json": 1, "missing_text": 1, "invalid_utf8": 1}
    s3, local = load_packed(tmp_path / "s3"), load_packed(tmp_path / "local")
    for split in ("train", "heldout"):
        assert s3[split]["input_ids"] == local[split]["input_ids"] and len(s3[split]) > 0
    capsys.readouterr()
    assert main(["data", "prepare", str(tmp_path / "s3.json")]) == 0  # the objects' signature is stable
    assert f"reused: {', '.join(STAGES)})" in capsys.readouterr().out


def test_a_changed_object_changes_the_documents_stage_key(s3_env):
    import s3fs

    before = files_signature(f"s3://{BUCKET}/raw")
    assert [name for name, *_ in before] == [f"s3://{BUCKET}/raw/part-0.jsonl", f"s3://{BUCKET}/raw/part-1.jsonl"]
    fs, key = s3fs.S3FileSystem(), f"{BUCKET}/raw/part-1.jsonl"
    original = fs.cat(key)
    try:
        fs.pipe(key, original.replace(b"the", b"THE", 1))  # the same size, other bytes: only the ETag tells
        fs.invalidate_cache()
        after = files_signature(f"s3://{BUCKET}/raw")
    finally:
        fs.pipe(key, original)
    assert after[0] == before[0] and after[1][1] == before[1][1] and after[1][2] != before[1][2]


def test_typed_objects_and_file_urls_read_as_the_local_files(s3_env):
    """Parquet objects (one cut short: left out and counted) and a `file://` URL give the local read's rows."""
    local = ReadFiles()
    expected = local.run(str(s3_env["local"] / "typed"))
    for url in (f"s3://{BUCKET}/typed", (s3_env["local"] / "typed").as_uri()):
        reader = ReadFiles()
        data = reader.run(url)
        assert reader.stats.dropped == local.stats.dropped == {"corrupt_file": 1, "empty": 2, "not_text": 1}
        assert reader.stats.extra["corrupt_files"] == ["part-2.parquet"]
        assert data["text"] == expected["text"] and data["doc_id"] == expected["doc_id"]


@pytest.mark.parametrize(
    "url, env, expected",
    [
        ("s3://nope/raw", {}, "error: input='s3://nope/raw': no such bucket (FileNotFoundError: The specified bucket"),
        (f"s3://{BUCKET}/missing", {}, f"error: input='s3://{BUCKET}/missing': nothing is stored under this URL"),
        (f"s3://{BUCKET}/raw", {"AWS_SECRET_ACCESS_KEY": "wrong"}, f"error: input='s3://{BUCKET}/raw': access refused"),
        (f"s3://{BUCKET}/raw", dict.fromkeys(KEYS), f"error: input='s3://{BUCKET}/raw': access refused"),
    ],
    ids=["no-bucket", "no-prefix", "wrong-secret", "no-credentials"],
)
def test_a_bad_url_or_credentials_are_one_line_before_any_work(
    s3_env, monkeypatch, tmp_path, capsys, url, env, expected
):
    for name, value in env.items():  # None: unset
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name)
    assert main(["data", "prepare", prepare(tmp_path, "out", url)]) == 2
    line = error_line(capsys)
    assert line.startswith(expected), line
    assert not (tmp_path / "out").exists()  # refused before the chain made its folder
    if "refused" in expected:
        assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line and "AWS_ENDPOINT_URL" in line
    assert main(["data", "clean", "--input", url, "--output", str(tmp_path / "clean")]) == 2  # the step commands
    assert error_line(capsys) == line


def objects(url: str) -> dict[str, tuple]:
    """Each object under `url` (its path below it) with its ETag and modification time."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return {p[len(root) + 1 :]: (i["ETag"], i["LastModified"]) for p, i in fs.find(root, detail=True).items()}


@pytest.fixture
def uploads(monkeypatch) -> list[str]:
    """The keys s3fs uploads from here on (its put and pipe, which still run)."""
    import s3fs

    made = []
    for name in ("_put_file", "_pipe_file"):
        original = getattr(s3fs.S3FileSystem, name)

        async def spy(self, *args, _original=original, _name=name, **kwargs):
            made.append(args[1] if _name == "_put_file" else args[0])
            return await _original(self, *args, **kwargs)

        monkeypatch.setattr(s3fs.S3FileSystem, name, spy)
    return made


def test_prepare_into_s3_gives_the_local_runs_counts_and_a_relaunch_publishes_nothing_new(
    s3_env, tmp_path, capsys, uploads
):
    """s3:// input and output: the local run's counters and packed tokens read back from the URL; the bucket holds
    what a reader needs at the local layout, none of the chain's coordination; a relaunch reuses every stage and
    uploads only tasks.json (its ran/reused columns)."""
    from transformers import AutoTokenizer

    url = f"s3://{OUT}/{tmp_path.name}"
    assert main(["data", "prepare", prepare(tmp_path, "local", str(s3_env["local"] / "raw"))]) == 0
    capsys.readouterr()
    assert main(["data", "prepare", prepare(tmp_path, "s3", f"s3://{BUCKET}/raw", url)]) == 0
    printed = capsys.readouterr().out
    work = tmp_path / "cache" / "chain"
    assert f"working in {work}/" in printed and f"publishing to {url} as each task ends" in printed
    assert counters(url) == counters(tmp_path / "local")
    s3, local = load_packed(url), load_packed(tmp_path / "local")
    for split in ("train", "heldout"):
        assert s3[split]["input_ids"] == local[split]["input_ids"] and len(s3[split]) > 0
    text = embedded_documents()[0]
    assert AutoTokenizer.from_pretrained(str(tokenizer_path(url)))(text) == AutoTokenizer.from_pretrained(
        str(tokenizer_path(tmp_path / "local"))
    )(text)
    published = objects(url)
    tops = {name.split("/")[0] for name in published}
    assert tops == {"04-tokenizer", "05-pack", "stats.json", "tasks.json"}  # no documents, buckets, clusters, locks
    assert {name.rsplit("/", 2)[0] for name in published if name.startswith("05-pack/")} >= {
        "05-pack/train",
        "05-pack/heldout",
        "05-pack/documents/train",
    }
    assert not [name for name in published if name.endswith(("stage.json", ".tmp")) or "/tasks/" in name]
    assert "04-tokenizer/stats.json" in published and "05-pack/stats.json" in published
    uploads.clear()
    assert main(["data", "prepare", str(tmp_path / "s3.json")]) == 0
    assert f"reused: {', '.join(STAGES)})" in capsys.readouterr().out
    assert [key.rsplit("/", 1)[-1] for key in uploads] == ["tasks.json"]
    after = objects(url)
    assert {k: v for k, v in after.items() if k != "tasks.json"} == {
        k: v for k, v in published.items() if k != "tasks.json"
    }


def test_training_reads_the_packed_shards_from_s3(s3_env, tmp_path):
    """A short PretrainTrainer run on `load_packed(url)["train"]` gives the losses of the same run on the local
    output; a mixture source at the URL reads the same rows."""
    from hf_pretrain.data.mixture import load_source
    from tests.data.test_chain import special_tokens, train_six_steps

    url = f"s3://{OUT}/{tmp_path.name}"
    assert main(["data", "prepare", prepare(tmp_path, "local", str(s3_env["local"] / "raw"))]) == 0
    assert main(["data", "prepare", prepare(tmp_path, "s3", str(s3_env["local"] / "raw"), url)]) == 0
    assert "05-pack/stats.json" in objects(url)
    shutil.rmtree(tmp_path / "cache")  # the work folder: what follows reads the bucket
    tokens = special_tokens(tmp_path / "local")
    assert special_tokens(url) == tokens
    from_url = train_six_steps(lambda: load_packed(url)["train"], tokens, tmp_path / "url")
    assert len(from_url) == 6
    assert from_url == train_six_steps(lambda: load_packed(tmp_path / "local")["train"], tokens, tmp_path / "here")
    assert load_source(url, "train")["input_ids"] == load_packed(tmp_path / "local")["train"]["input_ids"]
    from hf_pretrain.data.mixture import MixtureConfig
    from hf_pretrain.training.arguments import mixture_tokenizer

    mixture = MixtureConfig(sources={"web": {"path": url, "weight": 1.0}})  # --mixture finds the URL's tokenizer
    found = Path(mixture_tokenizer(mixture)) / "tokenizer.json"
    assert found.read_bytes() == (tokenizer_path(tmp_path / "local") / "tokenizer.json").read_bytes()


def test_a_stage_the_url_lost_or_a_changed_one_is_published_again(s3_env, tmp_path, capsys):
    """The URL's 05-pack/stats.json deleted: a relaunch redoes the pack stage and publishes it; a new pack section
    replaces the published shards (the stage's old objects removed first)."""
    import s3fs

    url = f"s3://{OUT}/{tmp_path.name}"
    config = prepare(tmp_path, "s3", str(s3_env["local"] / "raw"), url)
    assert main(["data", "prepare", config]) == 0
    before = load_packed(url)["train"]["input_ids"]
    s3fs.S3FileSystem().rm(f"{OUT}/{tmp_path.name}/05-pack/stats.json")
    capsys.readouterr()
    assert main(["data", "prepare", config]) == 0
    assert "reused: 01-documents, 02-buckets, 03-clusters, 04-tokenizer)" in capsys.readouterr().out
    assert load_packed(url)["train"]["input_ids"] == before
    values = json.loads((tmp_path / "s3.json").read_text())
    (tmp_path / "s3.json").write_text(json.dumps({**values, "pack": {"seq_len": 64, "mode": "best_fit"}}))
    assert main(["data", "prepare", config]) == 0
    assert max(len(row) for row in load_packed(url)["train"]["input_ids"]) == 64


@pytest.mark.parametrize(
    "url, env, expected",
    [
        ("s3://nope/out", {}, "error: output_dir='s3://nope/out': no such bucket (FileNotFoundError: The specified"),
        (f"s3://{OUT}/out", {"AWS_SECRET_ACCESS_KEY": "wrong"}, f"error: output_dir='s3://{OUT}/out': access refused"),
    ],
    ids=["no-bucket", "wrong-secret"],
)
def test_a_bad_output_url_or_credentials_are_one_line_before_any_work(
    s3_env, monkeypatch, tmp_path, capsys, url, env, expected
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["data", "prepare", prepare(tmp_path, "out", str(s3_env["local"] / "raw"), url)]) == 2
    line = error_line(capsys)
    assert line.startswith(expected), line
    assert not (tmp_path / "cache").exists()  # no work folder made
    if "refused" in expected:
        assert "keys that may write it" in line


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"output_dir": "s3://b/out", "executor": {"kind": "ray"}}, "work_dir: executor 'ray' with output_dir="),
        ({"output_dir": "out", "work_dir": "work"}, "work_dir='work' is for an output_dir URL"),
        ({"output_dir": "s3://b/out", "work_dir": "s3://b/work"}, "work_dir='s3://b/work' is a URL"),
    ],
    ids=["shared-work-dir-needed", "local-output", "url-work-dir"],
)
def test_work_dir_is_checked_with_the_config(fields, expected):
    from hf_pretrain.data.pipeline_config import PipelineConfig

    with pytest.raises(ValueError, match="^" + expected.replace("(", r"\(")):
        PipelineConfig(input="raw", **fields)
