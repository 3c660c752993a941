"""Data pipeline speed: preparation (tokens/s on this machine's cores) and loader throughput (tokens/s per
rank handed to the training loop), against what a 4B model consumes on one H200 (~20k tokens/s at 50% MFU).

    python tests/perf/bench_data.py [--mb=40] [--seq_length=2048] [--batch_size=8]

It writes its own corpus (Zipf-distributed made-up words, one document per line) and trains a byte-level
BPE tokenizer on it, so it needs no network; the figures go to docs/PERFORMANCE.md by hand.
"""

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402
from run.data import batches  # noqa: E402
from run.data import prepare as token_files  # noqa: E402

H200_4B_TOKENS_PER_S = 20_000  # a 4B model at 50% MFU on one H200
GOAL = 50  # the loader must deliver at least this multiple of it


def write_corpus(folder, megabytes, seed=0):
    """Documents of 50-500 words drawn from a Zipf law over 30k made-up words: a realistic token mix."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(30_000)]
    corpus = folder / "corpus"
    corpus.mkdir()
    with open(corpus / "train.txt", "w") as file:
        while file.tell() < megabytes * 2**20:
            ranks = np.minimum(rng.zipf(1.2, size=rng.integers(50, 500)), len(words)) - 1
            file.write(" ".join(words[r] for r in ranks) + " .\n")
    (corpus / "validation.txt").write_text(" ".join(words[:2000]) + "\n")
    return corpus


def train_tokenizer(corpus, folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    sample = (corpus / "train.txt").read_text()[: 5 * 2**20].splitlines()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=16_384, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tokenizer.train_from_iterator(sample, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    wrapped.save_pretrained(folder / "tokenizer")
    return folder / "tokenizer"


def loader_rate(batches, tokens_per_batch, seconds=5.0):
    """Tokens/s that next(batches) hands over, after a warm-up that fills the prefetch queue."""
    for _ in range(20):
        next(batches)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    return count * tokens_per_batch / (time.perf_counter() - start)


def preparation(corpus, tokenizer_dir, cache):
    """train.py --prepare_only on the corpus, then again (it finds its token file and reuses it): (the token
    file, its tokens, seconds to prepare, seconds to find it prepared)."""
    prepare = ["--prepare_only", f"--data={corpus}", f"--tokenizer={tokenizer_dir}", f"--data_cache={cache}"]
    start = time.perf_counter()
    train.main(prepare)
    prepare_s = time.perf_counter() - start
    (token_file,) = cache.glob("corpus-*/train.bin")
    n_tokens = json.loads(Path(f"{token_file}.json").read_text())["tokens"]
    start = time.perf_counter()
    train.main(prepare)
    return token_file, n_tokens, prepare_s, time.perf_counter() - start


def window_loader_rate(token_file, cfg):
    """Tokens/s of one rank of 8 on a node, as in a 4B run: batch_size windows of seq_length + 1 per
    micro-step, shuffled, from the prepared token file."""
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
    window = functools.partial(batches.token_window, tokens, cfg.seq_length)
    n_windows = (len(tokens) - 1) // cfg.seq_length
    windows = batches.WindowBatches(
        window,
        n_windows,
        cfg,
        world_size=8,
        rank=3,
        accumulation=4,
        device=torch.device("cpu"),
        prefetch=True,
        shuffle=True,
    )
    return loader_rate(windows, cfg.batch_size * cfg.seq_length)


def streaming_rate(corpus, tmp, tokenizer_dir, cfg):
    """Tokens/s of one rank streaming the corpus as parquet and tokenising it on the fly."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import load_dataset
    from transformers import AutoTokenizer

    parquet = tmp / "parquet"
    parquet.mkdir()
    lines = (corpus / "train.txt").read_text().splitlines()
    pq.write_table(pa.table({"text": lines}), parquet / "train.parquet")
    tokenize = token_files.tokenize_documents(AutoTokenizer.from_pretrained(tokenizer_dir), "text")
    documents = load_dataset(str(parquet), split="train", streaming=True).map(tokenize, batched=True)
    stream = batches.StreamingBatches(
        documents, cfg, accumulation=4, device=torch.device("cpu"), prefetch=True
    )
    return loader_rate(stream, cfg.batch_size * cfg.seq_length)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=40, help="corpus size in MiB")
    parser.add_argument("--seq_length", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    cfg = SimpleNamespace(batch_size=args.batch_size, seq_length=args.seq_length, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = write_corpus(tmp, args.mb)
        tokenizer_dir = train_tokenizer(corpus, tmp)
        token_file, n_tokens, prepare_s, reuse_s = preparation(corpus, tokenizer_dir, tmp / "cache")
        window_rate = window_loader_rate(token_file, cfg)
        stream_rate = streaming_rate(corpus, tmp, tokenizer_dir, cfg)

    need = H200_4B_TOKENS_PER_S
    print(f"machine: {cores} cores available, torch {torch.__version__}")
    print(f"corpus: {args.mb} MiB of text, {n_tokens:,} tokens (byte-level BPE, 16k vocabulary)")
    print(
        f"preparation: {n_tokens / prepare_s:,.0f} tokens/s "
        f"({prepare_s:.1f} s, load + tokenise on {cores} cores + write); "
        f"reuse check (size + checksum): {reuse_s:.2f} s"
    )
    print(
        f"loader, prepared token file: {window_rate:,.0f} tokens/s per rank "
        f"= {window_rate / need:,.0f}x a 4B model on one H200 "
        f"(goal {GOAL}x: {'met' if window_rate >= GOAL * need else 'NOT met'})"
    )
    print(
        f"loader, streaming parquet (tokenising on the fly): {stream_rate:,.0f} tokens/s per rank "
        f"= {stream_rate / need:,.1f}x "
        f"(goal {GOAL}x: {'met' if stream_rate >= GOAL * need else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
