"""Real data end to end: a generated corpus, a BPE tokenizer trained on it, real torchrun processes."""
import json
import random

import pytest

from conftest import TINY, launch, read_metrics

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
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture
def corpus(tmp_path):
    """A folder with a train and a validation file, as a user would lay it out."""
    folder = tmp_path / "corpus"
    write_lines(folder / "train.txt", 3000, seed=1)
    write_lines(folder / "validation.txt", 200, seed=2)
    return folder


def run(tmp_path, tokenizer_dir, *args, nproc=2, expect_ok=True, env=None):
    args = [f"--log_dir={tmp_path / 'logs'}", f"--data_cache={tmp_path / 'cache'}", f"--tokenizer={tokenizer_dir}", *args]
    result = launch("train.py", args, nproc=nproc, env=env, cwd=tmp_path)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_two_processes_train_on_a_local_folder_and_validation_loss_falls(tmp_path, tokenizer_dir, corpus):
    result = run(tmp_path, tokenizer_dir, *DATA, f"--data={corpus}", "--max_steps=40", "--eval_every=20")
    records = read_metrics(tmp_path / "logs")
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [20, 40]
    assert "val loss" in result.stdout
    first_loss = records[0]["loss"]
    assert evaluated[-1]["val_loss"] < 0.5 * first_loss, (first_loss, evaluated)
    assert evaluated[-1]["val_ppl"] == pytest.approx(2.718281828 ** evaluated[-1]["val_loss"], rel=1e-6)
