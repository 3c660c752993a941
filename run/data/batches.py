"""The training's batches: the global batch of step k is a function of k alone, so it is the same for any
world size, and a position kept after each optimizer step resumes it exactly. Dummy data is generated; a
corpus is read as windows of its token files (prepare.py); a hub dataset may be streamed, packed as read."""

import functools
import json
import math
import queue
import sys
import threading

import numpy as np
import torch

from common.errors import ConfigError
from run.data import prepare
from run.data.source import parse_source

DUMMY_EPOCH_SAMPLES = 2**20  # what one epoch of dummy data means for num_epochs
DUMMY_PERIOD = 8  # each dummy sequence repeats a random block of this many tokens


def dummy_window(seq_length, vocab_size, seed, index):
    """Window index of dummy data, seq_length + 1 tokens: a random block repeated, so a model can learn to
    copy and the loss falls."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    block = torch.randint(0, vocab_size, (DUMMY_PERIOD,), generator=generator)
    return block.repeat(seq_length // DUMMY_PERIOD + 1)[: seq_length + 1].numpy()


def prefetched(items, depth):
    """items produced up to depth ahead by a daemon thread, so reading and tokenising overlap the
    training step; an error in the thread is raised here, and a finite items ends here where it ends
    (the training's sources never do: they start another epoch)."""
    ahead, end = queue.Queue(depth), object()

    def produce():
        try:
            for item in items:
                ahead.put(item)
            ahead.put(end)
        except Exception as error:
            ahead.put(error)

    threading.Thread(target=produce, daemon=True).start()
    while (item := ahead.get()) is not end:
        if isinstance(item, Exception):
            raise item
        yield item


class Batches:
    """This rank's micro-batches (inputs, targets). state_dict() is the json-able position after the
    last completed optimizer step (every accumulation-th micro-batch), whatever was read ahead;
    load_state_dict() restores it before the first batch is taken."""

    position_per_rank = False  # whether each rank has its own position (a stream's) or all share one
    corpus = None  # the token file a position counts windows of (prepare.token_file_identity), if any

    def __init__(self, accumulation, device, prefetch):
        self.accumulation, self.device, self.prefetch = accumulation, device, prefetch
        self.items, self.taken, self.position = None, 0, None

    def state_dict(self):
        return json.loads(json.dumps(self.position))

    def load_state_dict(self, state):
        if self.items is not None:
            raise RuntimeError("load_state_dict must come before the first batch")
        self.position = json.loads(json.dumps(state))

    def __next__(self):
        if self.items is None:
            self.items = self.produce()
            if self.prefetch:
                self.items = prefetched(self.items, 4 * self.accumulation)
        windows, position = next(self.items)
        self.taken += 1
        if self.taken % self.accumulation == 0:
            self.position = position
        windows = torch.from_numpy(windows)
        if self.device.type == "cuda":
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]


def token_window(tokens, seq_length, index):
    """Window index of a token file: seq_length + 1 tokens, the first shared with the previous window."""
    return tokens[index * seq_length : (index + 1) * seq_length + 1]


@functools.lru_cache(maxsize=2)
def epoch_order(n_windows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_windows)


class WindowBatches(Batches):
    """window(i) is window i of n_windows. Sample g of the run is window g mod n of epoch g // n, in
    a seeded order per epoch when shuffled; rank r of micro-step m of step k reads samples
    k·G + (m·W + r)·B ..., so the global batch of a step is the same for every world size. The
    position {epoch, offset} is the first sample of the next step."""

    def __init__(self, window, n_windows, args, world_size, rank, accumulation, device, prefetch, shuffle):
        super().__init__(accumulation, device, prefetch)
        self.window, self.n_windows, self.world_size, self.rank = window, n_windows, world_size, rank
        self.batch_size, self.seed, self.shuffle = args.batch_size, args.seed, shuffle
        self.step_samples = accumulation * world_size * args.batch_size
        self.position = {"epoch": 0, "offset": 0}

    def produce(self):
        step = (self.position["epoch"] * self.n_windows + self.position["offset"]) // self.step_samples
        while True:
            epoch, offset = divmod((step + 1) * self.step_samples, self.n_windows)
            for micro in range(self.accumulation):
                first = step * self.step_samples + (micro * self.world_size + self.rank) * self.batch_size
                rows = []
                for sample in range(first, first + self.batch_size):
                    sample_epoch, index = divmod(sample, self.n_windows)
                    if self.shuffle:
                        index = epoch_order(self.n_windows, self.seed, sample_epoch)[index]
                    rows.append(self.window(index))
                yield np.stack(rows).astype(np.int64), {"epoch": epoch, "offset": offset}
            step += 1


class StreamingBatches(Batches):
    """Packs a tokenised stream on the fly: documents joined by EOS and cut into batch_size windows
    of seq_length + 1; after the stream's end it starts again. The position is the stream's own
    state plus the tokens it read but has not used."""

    position_per_rank = True

    def __init__(self, documents, args, accumulation, device, prefetch):
        super().__init__(accumulation, device, prefetch)
        self.documents, self.batch_size = documents, args.batch_size
        self.batch_tokens = args.batch_size * (args.seq_length + 1)
        self.start = documents.state_dict()
        self.position = {"stream": self.start, "buffer": []}

    def produce(self):
        stream, buffer = self.position["stream"], list(self.position["buffer"])
        while True:
            self.documents.load_state_dict(stream)
            tokens_read = 0
            for document in self.documents:
                buffer += document["input_ids"]
                tokens_read += len(document["input_ids"])
                while len(buffer) >= self.batch_tokens:
                    windows = np.array(buffer[: self.batch_tokens], dtype=np.int64)
                    del buffer[: self.batch_tokens]
                    position = {"stream": self.documents.state_dict(), "buffer": list(buffer)}
                    yield windows.reshape(self.batch_size, -1), position
            if not tokens_read:
                raise ValueError("this rank's share of the stream holds no text")
            stream = self.start


def stream_splits(args, name, config, tokenizer, world_size, rank):
    """This rank's share of the tokenised train and validation (None if absent) streams of a hub dataset."""
    from datasets.distributed import split_dataset_by_node

    fix = "; streaming needs it during training: use a local copy as --data=PATH instead"
    splits = prepare.load_hub_dataset(args, name, config, fix, streaming=True)
    tokenize = prepare.tokenize_documents(tokenizer, args.text_column)

    def share(split):
        shard = split_dataset_by_node(splits[split], rank=rank, world_size=world_size)
        return shard.map(tokenize, batched=True)

    return [share(split) if split in splits else None for split in ("train", "validation")]


def open_batches(args, shape, tokenizer, world_size, rank, accumulation, device):
    """(training batches, a function returning fresh validation batches or None, steps per epoch or None)."""
    kind, name, config = parse_source(args)
    if kind == "stream":
        train, validation = stream_splits(args, name, config, tokenizer, world_size, rank)
        evaluation = functools.partial(StreamingBatches, validation, args, 1, device, prefetch=False)
        train = StreamingBatches(train, args, accumulation, device, prefetch=True)
        return train, evaluation if validation is not None else None, None
    batches = functools.partial(WindowBatches, args=args, world_size=world_size, rank=rank, device=device)
    if kind == "dummy":
        window = functools.partial(dummy_window, args.seq_length, shape.vocab_size, args.seed)
        train = batches(window, DUMMY_EPOCH_SAMPLES, accumulation=accumulation, prefetch=True, shuffle=False)
        return train, None, DUMMY_EPOCH_SAMPLES // args.global_batch_size
    paths = prepare.shared_token_files(args, kind, name, config, tokenizer, rank)
    dtype = prepare.token_dtype(tokenizer)
    tokens = {split: np.memmap(path, dtype=dtype, mode="r") for split, path in paths.items()}
    windows = {split: (len(split_tokens) - 1) // args.seq_length for split, split_tokens in tokens.items()}
    if windows["train"] < args.global_batch_size:
        raise ConfigError(
            f"--data={args.data} has {len(tokens['train']):,} training tokens, fewer than one global batch "
            f"({args.global_batch_size} x {args.seq_length + 1}); lower --global_batch_size or --seq_length"
        )
    if windows["validation"] < 1:
        raise ConfigError(
            f"the validation split of --data={args.data} is shorter than one sequence; raise --val_fraction"
        )
    train_window, validation_window = (
        functools.partial(token_window, tokens[split], args.seq_length) for split in ("train", "validation")
    )
    train = batches(train_window, windows["train"], accumulation=accumulation, prefetch=True, shuffle=True)
    train.corpus = prepare.token_file_identity(paths["train"])
    evaluation = functools.partial(
        batches, validation_window, windows["validation"], accumulation=1, prefetch=False, shuffle=False
    )
    return train, evaluation, windows["train"] // args.global_batch_size


def describe_epochs(args, total_steps, batches, epoch_steps):
    """One line at the start of a run on a corpus: how many passes over its training windows the run's steps
    make, and the option that set them; a warning when --max_steps makes more than --num_epochs asks for (a
    small corpus was repeated a thousand times without a word)."""
    if args.data == "dummy" or epoch_steps is None:  # generated data, or a stream of unknown length
        return
    epochs = total_steps * args.global_batch_size / batches.n_windows
    corpus = f"--data={args.data} ({batches.n_windows:,} windows of {args.seq_length} tokens)"
    if total_steps > args.num_epochs * epoch_steps:
        needed = math.ceil(total_steps / epoch_steps)
        print(f"warning: --max_steps={args.max_steps} makes {epochs:,.2f} epochs of {corpus}, more than "
              f"--num_epochs={args.num_epochs} asks for: the corpus repeats; lower --max_steps, give more "
              f"data, or set --num_epochs={needed} to mean it", file=sys.stderr, flush=True)  # fmt: skip
        return
    setting = f"--max_steps={args.max_steps}" if args.max_steps > 0 else f"--num_epochs={args.num_epochs}"
    print(f"data: {total_steps:,} steps of {args.global_batch_size} sequences make {epochs:,.2f} epochs of "
          f"{corpus}, as {setting} sets", flush=True)  # fmt: skip
