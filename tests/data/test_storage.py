"""The chain's input in object storage: a real S3-compatible server (moto's server mode) on the loopback, read with
s3fs as a user's run reads S3, gives the counts and tokens of the same files read locally; a wrong bucket, a missing
prefix and refused or missing credentials are one line before any work."""

import json
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hf_pretrain.cli import main
from hf_pretrain.data import embedded_documents
from hf_pretrain.data.prepared import files_signature, load_packed
from hf_pretrain.data.read import ReadFiles
from tests.data.test_pipeline import STAGES, dirty_corpus, error_line

BUCKET = "corpus"
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
    s3fs.S3FileSystem.clear_instance_cache()  # a client made with other keys is not reused
    yield s3_server
    s3fs.S3FileSystem.clear_instance_cache()


def prepare(tmp_path, name: str, source: str) -> str:
    config = {
        "input": source,
        "output_dir": str(tmp_path / name),
        "heldout_fraction": 0.05,
        "tokenizer": {"vocab_size": 512},
        "pack": {"seq_len": 128, "mode": "best_fit"},
    }
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    return str(tmp_path / f"{name}.json")


def counters(output_dir) -> list[dict]:
    """Every block's counters, drop reasons and notes, without its seconds."""
    stats = json.loads((output_dir / "stats.json").read_text())
    return [{k: v for k, v in s.items() if k != "seconds"} for s in stats]


def test_prepare_from_s3_gives_the_local_runs_counts_and_tokens(s3_env, tmp_path, capsys):
    assert main(["data", "prepare", prepare(tmp_path, "local", str(s3_env["local"] / "raw"))]) == 0
    assert main(["data", "prepare", prepare(tmp_path, "s3", f"s3://{BUCKET}/raw")]) == 0
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
