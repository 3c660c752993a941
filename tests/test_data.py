"""Real data end to end: a generated corpus, a BPE tokenizer trained on it, real torchrun processes."""

import functools
import json
import math
import os
import random
import re
import signal
from types import SimpleNamespace

import pytest
from conftest import SIMULATES, TINY, assert_ran, launch, read_metrics, run_until, together

# The tiny preset on short sequences, so that a corpus of a few thousand lines makes many batches.
DATA = [*TINY, "--seq_length=32", "--eval_batches=2"]
NOUNS = ["cat", "dog", "bird", "child", "farmer", "river", "king", "robot"]
VERBS = ["sees", "likes", "follows", "feeds", "paints", "hears"]
ADJECTIVES = ["small", "old", "red", "quiet", "happy", "tall"]


def sentence(rng):
    """A simple grammar: article, adjective, noun, verb, article, noun, and sometimes a clause."""
    words = ["the", rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(VERBS), "a", rng.choice(NOUNS)]
    if rng.random() < 0.5:
        words += ["and", "then", rng.choice(VERBS), "the", rng.choice(NOUNS)]
    return " ".join(words) + " ."


def write_lines(path, n_lines, seed):
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(sentence(rng) + "\n" for _ in range(n_lines)))
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A word-level BPE tokenizer trained on the grammar, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = write_lines(tmp_path_factory.mktemp("tokenizer_corpus") / "corpus.txt", 500, seed=0)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(corpus)], trainers.BpeTrainer(vocab_size=120, special_tokens=["<eos>", "<unk>"]))
    folder = tmp_path_factory.mktemp("tokenizer")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
    wrapped.save_pretrained(folder)
    return folder


def write_corpus(folder):
    """A folder with a train and a validation file, as a user would lay it out."""
    write_lines(folder / "train.txt", 3000, seed=1)
    write_lines(folder / "validation.txt", 200, seed=2)
    return folder


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def run(tmp_path, tokenizer_dir, *args, nproc=2, expect_ok=True, env=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = [
        f"--log_dir={tmp_path / 'logs'}",
        f"--data_cache={tmp_path / 'cache'}",
        f"--tokenizer={tokenizer_dir}",
        *args,
    ]
    result = launch("train.py", args, nproc=nproc, env=env, cwd=tmp_path)
    if expect_ok:
        assert_ran(result)
    return result


# The 14-step run's first 5 steps are the 5-step 2-process run the one-process run is compared with: warm-up
# lasts 10 steps, and a step's learning rate before then does not depend on max_steps.
TEXT = [*DATA, "--eval_every=0", "--run_name=text"]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The runs' HOME: a run writes under the folders it was given alone, so nothing lands here (datasets
    would put its lock files in ~/.cache/huggingface)."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory, tokenizer_dir, home):
    """The training runs on text that the tests below read, launched two at a time, each with its own data
    cache: name -> (its folder, result)."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    stream = write_parquet_stream(tmp_path_factory.mktemp("parquet") / "stream", column="body")
    runs = {
        "validated": [*DATA, f"--data={corpus}", "--max_steps=40", "--eval_every=10"],
        "stream": [*DATA, f"--data=hf:{stream}", "--text_column=body", "--max_steps=20", "--eval_every=10"],
        "whole": [*TEXT, f"--data={corpus}", "--max_steps=14"],
        "one process": [*TEXT, f"--data={corpus}", "--max_steps=5"],
    }
    folders = {name: tmp_path_factory.mktemp("text") for name in runs}
    results = together(
        *[
            functools.partial(
                run,
                folders[name],
                tokenizer_dir,
                *args,
                f"--checkpoint_dir={folders[name]}",
                nproc=0 if name == "one process" else 2,
                expect_ok=False,
                env={"HOME": str(home)},
            )
            for name, args in runs.items()
        ]
    )
    return {name: (folders[name], result) for name, result in zip(runs, results)}


def test_two_processes_train_on_a_local_folder_and_validation_loss_falls(text_runs):
    folder, result = text_runs["validated"]
    assert_ran(result)
    records = read_metrics(folder / "logs")
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [10, 20, 30, 40]
    assert "val loss" in result.stdout
    passes = (
        r"^data: 40 steps of 16 sequences make 0\.\d\d epochs of --data=\S+ \([\d,]+ windows of 32 tokens\), "
    )
    assert re.search(passes + r"as --max_steps=40 sets$", result.stdout, re.M), result.stdout[:3000]
    assert "warning:" not in result.stderr
    val_losses = [r["val_loss"] for r in evaluated]
    assert val_losses[-1] < val_losses[0] - 0.2, val_losses
    assert val_losses[-1] < 0.5 * records[0]["loss"], (records[0]["loss"], val_losses)
    assert evaluated[-1]["val_ppl"] == pytest.approx(math.exp(val_losses[-1]), rel=1e-6)


def test_stopped_run_on_text_resumes_exactly(tmp_path, tokenizer_dir, text_runs):
    """The data side of an exact resume: the loader continues on the very next batch of the epoch."""
    folder, result = text_runs["whole"]
    assert_ran(result)
    whole = {r["step"]: r["loss"] for r in read_metrics(folder / "logs")}
    corpus = write_corpus(tmp_path / "corpus")  # the same text, in a folder of its own
    args = [*TEXT, f"--data={corpus}", "--max_steps=14", f"--data_cache={tmp_path / 'cache'}"]
    args += [f"--tokenizer={tokenizer_dir}", f"--checkpoint_dir={tmp_path}"]
    code, output = run_until([f"--log_dir={tmp_path / 'logs'}", *args], tmp_path, 3, signal.SIGTERM)
    stopped = int(output.split("stopped by signal after step ")[1].split(";")[0])
    result = run(tmp_path, tokenizer_dir, *args)
    assert f"at step {stopped}" in result.stdout
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "logs")}
    assert [resumed[s] for s in range(stopped + 1, 15)] == [whole[s] for s in range(stopped + 1, 15)]


def prepare(tmp_path, tokenizer_dir, *args, capsys):
    """train.py --prepare_only in this process (it needs no process group): exit status, stdout, stderr."""
    import train as train_script

    try:
        status = train_script.main(
            ["--prepare_only", f"--data_cache={tmp_path / 'cache'}", f"--tokenizer={tokenizer_dir}", *args]
        )
    except SystemExit as exit_info:
        status = exit_info.code
    output = capsys.readouterr()
    return status, output.out, output.err


def test_token_file_is_prepared_once_and_rebuilt_when_incomplete(tmp_path, tokenizer_dir, corpus, capsys):
    def prepared():
        status, out, err = prepare(tmp_path, tokenizer_dir, f"--data={corpus}", capsys=capsys)
        assert status == 0, err
        return out

    assert "data: tokenizing" in prepared()
    (tokens,) = (tmp_path / "cache").glob("corpus-*/train.bin")
    sidecar = tokens.with_name("train.bin.json")
    size, mtime = tokens.stat().st_size, tokens.stat().st_mtime_ns
    assert json.loads(sidecar.read_text())["tokens"] * 2 == size  # uint16: the vocabulary is small

    output = prepared()
    assert "reusing prepared tokens" in output and "tokenizing" not in output
    assert tokens.stat().st_mtime_ns == mtime

    with open(tokens, "r+b") as file:  # a copy that stopped early
        file.truncate(size - 2)
    assert "data: tokenizing" in prepared()
    assert tokens.stat().st_size == size

    sidecar.write_text(sidecar.read_text()[:40])  # a sidecar cut short
    assert "data: tokenizing" in prepared()
    assert json.loads(sidecar.read_text())["tokens"] * 2 == size

    with open(tokens, "r+b") as file:  # the right size, but not the right tokens
        file.seek(size // 2)
        file.write(b"\xff\xff")
    assert "data: tokenizing" in prepared()
    assert b"\xff\xff" not in tokens.read_bytes()

    with open(corpus / "train.txt", "a") as file:  # an edited corpus is prepared anew, beside the old copy
        file.write("the old king hears a dog .\n")
    assert "data: tokenizing" in prepared()
    assert len(list((tmp_path / "cache").glob("corpus-*/train.bin"))) == 2


def test_resuming_text_with_another_seq_length_is_refused(tmp_path, tokenizer_dir, corpus):
    args = [*DATA, f"--data={corpus}", "--eval_every=0", "--run_name=windows", f"--checkpoint_dir={tmp_path}"]
    run(tmp_path, tokenizer_dir, *args, "--max_steps=2", nproc=0)
    result = run(tmp_path, tokenizer_dir, *args, "--max_steps=4", "--seq_length=16", nproc=0, expect_ok=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {tmp_path}/windows/step_2 read --data={corpus} in windows of --seq_length=32, "
        "and its data position counts those windows; resume with --seq_length=32, or start another --run_name"
    )


@pytest.fixture(scope="module")
def small_corpus_run(tmp_path_factory, tokenizer_dir):
    """A corpus of a few global batches, and a 3-step one-process run on it that saves a checkpoint at its
    end: (folder, corpus, the run's arguments without --max_steps, result)."""
    folder = tmp_path_factory.mktemp("small")
    corpus = folder / "corpus"
    write_lines(corpus / "train.txt", 70, seed=1)
    write_lines(corpus / "validation.txt", 20, seed=2)
    args = [*DATA, f"--data={corpus}", "--eval_every=0", "--run_name=small", f"--checkpoint_dir={folder}"]
    return folder, corpus, args, run(folder, tokenizer_dir, *args, "--max_steps=3", nproc=0, expect_ok=False)


def test_max_steps_that_repeat_the_corpus_beyond_num_epochs_warn_in_one_line(small_corpus_run):
    folder, corpus, _, result = small_corpus_run
    assert_ran(result)
    [sidecar] = (folder / "cache").glob("corpus-*/train.bin.json")
    windows = (json.loads(sidecar.read_text())["tokens"] - 1) // 32
    assert 16 <= windows < 32  # 3 steps of 16 sequences read more than one pass: num_epochs=1 asks for one
    assert result.stderr.count("warning:") == 1, result.stderr
    assert (
        f"warning: --max_steps=3 makes {3 * 16 / windows:,.2f} epochs of --data={corpus} ({windows} windows "
        f"of 32 tokens), more than --num_epochs=1 asks for: the corpus repeats; lower --max_steps, give more "
        f"data, or set --num_epochs={math.ceil(3 / (windows // 16))} to mean it"
    ) in result.stderr.splitlines()
    assert not re.search(r"^data: .* epochs of", result.stdout, re.M)  # the warning says it instead


def test_resuming_after_the_corpus_changed_is_refused_and_after_a_touch_is_not(
    small_corpus_run, tokenizer_dir
):
    """The token files were prepared anew (the corpus's size or time changed) and the run resumed silently,
    its data position counting windows of the old ones."""
    folder, corpus, args, _ = small_corpus_run
    os.utime(corpus / "train.txt")  # a new time, the same text: prepared anew into the same tokens
    touched = run(folder, tokenizer_dir, *args, "--max_steps=4", nproc=0)
    assert "data: tokenizing" in touched.stdout
    assert f"resumed from {folder}/small/step_3 at step 3" in touched.stdout
    saved = json.loads((folder / "small" / "step_4" / "trainer_state.json").read_text())["corpus"]
    with open(corpus / "train.txt", "a") as file:  # it grew
        file.write("the old king hears a dog .\n" * 20)
    grown = run(folder, tokenizer_dir, *args, "--max_steps=5", nproc=0, expect_ok=False)
    assert grown.returncode == 2
    [sidecar] = [path for path in (folder / "cache").glob("corpus-*/train.bin.json")
                 if json.loads(path.read_text())["tokens"] != saved["tokens"]]  # fmt: skip
    now = json.loads(sidecar.read_text())["tokens"]
    assert grown.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {folder}/small/step_4 read --data={corpus} as {saved['tokens']:,} training "
        f"tokens ({saved['prepared']}), and it now holds {now:,} ({sidecar.parent.name}): the corpus "
        "changed, and the checkpoint's data position counts windows of the old tokens; resume with the "
        "corpus as it was, or start another --run_name"
    )
    assert "Traceback" not in grown.stderr
    assert not (folder / "small" / "step_5").exists()


def test_one_process_with_accumulation_matches_two_processes_on_text(text_runs):
    (two, two_result), (one, one_result) = text_runs["whole"], text_runs["one process"]
    assert_ran(two_result)
    assert_ran(one_result)
    two_records, one_records = read_metrics(two / "logs")[:5], read_metrics(one / "logs")
    assert [r["lr"] for r in one_records] == [r["lr"] for r in two_records]  # the same 5 steps
    one_losses = [r["loss"] for r in one_records]
    assert one_losses == pytest.approx([r["loss"] for r in two_records], rel=1e-5, abs=1e-5)
    assert len(set(one_losses)) == 5


def write_parquet_stream(folder, column):
    """Two training shards (one per rank) and a validation file, named the way datasets splits them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    for name, n_rows, seed in [
        ("train-00000-of-00002", 600, 3),
        ("train-00001-of-00002", 600, 4),
        ("validation", 100, 5),
    ]:
        rng = random.Random(seed)
        # Several sentences per row: documents longer than a line, as in real corpora.
        rows = [" ".join(sentence(rng) for _ in range(3)) for _ in range(n_rows)]
        pq.write_table(pa.table({"id": list(range(n_rows)), column: rows}), folder / f"{name}.parquet")
    return folder


def test_streaming_parquet_folder_trains_on_two_processes(text_runs):
    folder, result = text_runs["stream"]
    assert_ran(result)
    assert "world_size=2" in result.stdout
    records = read_metrics(folder / "logs")
    assert len(records) == 20
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20]


def test_text_runs_write_nothing_outside_their_folders(text_runs, home):
    """A stream through datasets, a folder prepared and cached, a resumed run: their caches and lock files
    live under --data_cache, never in the home folder."""
    assert all(result.returncode == 0 for _, result in text_runs.values())
    assert list(home.rglob("*")) == []


def test_hub_source_without_network_or_prepared_tokens_names_the_prepare_command(tmp_path, tokenizer_dir):
    result = run(
        tmp_path,
        tokenizer_dir,
        *DATA,
        "--data=wikitext",
        "--max_steps=1",
        nproc=0,
        expect_ok=False,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "cannot load Salesforce/wikitext from the Hugging Face hub (Couldn't reach" in lines[0]
    assert "python train.py --prepare_only --data=wikitext" in lines[0]


def write_files(root, layout):
    for name, text in layout.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text) if isinstance(text, bytes) else (root / name).write_text(text)


@pytest.mark.parametrize(
    "layout, args, message",
    [
        ({}, ["--data=missing"], "--data=missing: no such file or folder"),
        ({"empty/train.txt": ""}, ["--data=empty"], "--data=empty holds no text"),
        ({"blank/train.txt": "\n  \n\n"}, ["--data=blank"], "--data=blank holds no text"),
        (
            {"docs/a.jsonl": '{"body": "the cat sees a dog ."}\n' * 50},
            ["--data=docs", "--text_column=content"],
            "--text_column=content is not a column of --data=docs; columns: body",
        ),
        ({"mixed/a.txt": "x\n", "mixed/b.jsonl": '{"text": "y"}\n'}, ["--data=mixed"], "mixes .jsonl, .txt"),
        (
            {"ok.txt": "the cat sees a dog .\n"},
            ["--data=ok.txt", "--vocab_size=50"],
            "tokens, more than --vocab_size=50",
        ),
        # 21 bytes of the first line and "caf", then é in Latin-1
        (
            {"latin.txt": "the cat sees a dog .\ncafé\n".encode("latin-1")},
            ["--data=latin.txt"],
            "latin.txt is not UTF-8 text (invalid byte at offset 24)",
        ),
        (
            {"bin/train.txt": bytes(range(256)) * 4},
            ["--data=bin"],
            "train.txt is not UTF-8 text (invalid byte at offset 128)",
        ),
        (
            {"nul.txt": b"the cat sees a dog .\n" * 3 + b"a \0 cat\n"},
            ["--data=nul.txt"],
            "nul.txt line 4 holds a NUL byte (offset 65): not text",
        ),
        (
            {"docs/a.jsonl": '{"text": "the cat sees a dog ."}\n' * 5 + '{"text": "cut sho\n'},
            ["--data=docs"],
            "a.jsonl line 6 is not a JSON record",
        ),
        (
            {"docs/a.jsonl": '{"text": "the cat sees a dog ."}\n' * 5 + '{"text": null}\n'},
            ["--data=docs"],
            "a.jsonl line 6 has no text in its 'text' field (null); fix or remove the line",
        ),
        (
            {"docs/a.jsonl": '{"text": "the cat sees a dog ."}\n' * 5 + '{"text": 5}\n'},
            ["--data=docs"],
            "a.jsonl line 6 has no text in its 'text' field (a number)",
        ),
        (
            {"docs/a.jsonl": '{"text": "the cat sees a dog ."}\n' * 5 + '{"body": "a dog"}\n'},
            ["--data=docs"],
            "a.jsonl line 6 has no text in its 'text' field (missing); fix or remove the line",
        ),
        (
            {"docs/a.jsonl": '{"text": "the cat sees a dog ."}\n' * 5 + "[1, 2]\n"},
            ["--data=docs"],
            "a.jsonl line 6 is not a JSON record (a list)",
        ),
        (
            {"cut/a.parquet": b"PAR1" + bytes(100)},
            ["--data=cut"],
            "a.parquet is not a readable parquet file",
        ),
        (
            {"ok.txt": "the cat sees a dog .\n", "tok/tokenizer.json": "{"},
            ["--data=ok.txt", "--tokenizer=tok"],
            "--tokenizer=tok: cannot load the tokenizer in this folder (",
        ),
        (
            {"ok.txt": "the cat sees a dog .\n"},
            ["--data=ok.txt", "--tokenizer=./no_tokenizer"],
            "--tokenizer=./no_tokenizer: no such folder",
        ),
        (
            {"ok.txt": "the cat sees a dog .\n"},
            ["--data=ok.txt", "--data_cache=ok.txt/cache"],
            "--data_cache=ok.txt/cache is not writable",
        ),
    ],
)
def test_bad_corpus_is_one_clear_line(tmp_path, tokenizer_dir, layout, args, message, capsys, monkeypatch):
    write_files(tmp_path, layout)
    monkeypatch.chdir(tmp_path)
    status, _, err = prepare(tmp_path, tokenizer_dir, *args, capsys=capsys)
    assert status == 2
    # Only datasets' progress bars may come before the error line.
    assert message in err.strip().splitlines()[-1], err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert not list(tmp_path.rglob("*.tmp")), "a refused corpus leaves no temporary file"


@pytest.mark.parametrize("kind", ["named pipe", "broken symbolic link"])
def test_a_data_file_that_is_not_a_regular_file_is_refused_unopened(tmp_path, tokenizer_dir, kind, capsys):
    """A named pipe's open waits forever for a writer: it is named before anything opens it."""
    write_files(tmp_path, {"docs/a.txt": "the cat sees a dog .\n" * 20})
    odd = tmp_path / "docs" / "b.txt"
    os.mkfifo(odd) if kind == "named pipe" else odd.symlink_to(tmp_path / "gone.txt")
    signal.alarm(60)  # a hang fails the test rather than the suite
    try:
        status, _, err = prepare(tmp_path, tokenizer_dir, f"--data={tmp_path / 'docs'}", capsys=capsys)
    finally:
        signal.alarm(0)
    assert status == 2
    assert err.strip() == f"error: --data: {odd} is a {kind}, not a regular file; remove it from the corpus"


@SIMULATES
def test_model_vocabulary_follows_the_tokenizer(tokenizer_dir, corpus, capsys):
    from transformers import AutoTokenizer

    import train as train_script

    size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    small = ["--n_layer=1", "--seq_length=64", "--batch_size=1", "--world_size=1", "--global_batch_size=1"]
    data = [f"--data={corpus}", f"--tokenizer={tokenizer_dir}"]
    train_script.main(["--dry_run", "--model=gpt2", *small, *data])
    assert f"vocab={(size + 63) // 64 * 64}\n" in capsys.readouterr().out  # gpt2's preset has 50257


def test_corpus_shorter_than_one_batch_is_one_clear_line(tmp_path, tokenizer_dir):
    write_files(tmp_path, {"short/train.txt": "the cat sees a dog .\n" * 20})
    result = run(tmp_path, tokenizer_dir, *DATA, "--data=short", "--max_steps=1", nproc=0, expect_ok=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "--data=short has" in last and "fewer than one global batch (16 x 33)" in last, result.stderr
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr, result.stderr


def test_streaming_loader_resumes_on_exactly_the_next_batch(tmp_path, tokenizer_dir):
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from run.data import batches, prepare

    stream = write_parquet_stream(tmp_path / "stream", column="text")
    tokenize = prepare.tokenize_documents(AutoTokenizer.from_pretrained(tokenizer_dir), "text")
    cfg = SimpleNamespace(batch_size=2, seq_length=16)

    def loader():
        documents = load_dataset(str(stream), split="train", streaming=True).map(tokenize, batched=True)
        return batches.StreamingBatches(
            documents, cfg, accumulation=1, device=torch.device("cpu"), prefetch=True
        )

    first = loader()
    taken = [next(first) for _ in range(7)]
    state = json.loads(json.dumps(first.state_dict()))
    following = [next(first) for _ in range(3)]
    assert state["buffer"], "a window boundary inside a document leaves tokens in the buffer"
    resumed = loader()
    resumed.load_state_dict(state)
    for expected in following:
        inputs, targets = next(resumed)
        assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])
    assert not torch.equal(taken[-1][0], following[0][0])
