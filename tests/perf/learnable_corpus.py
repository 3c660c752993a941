"""A corpus a model can learn, and its tokenizer, made from this repository's own text with no network: every
.py, .md and .sh file, in a fixed order, the last 5% of lines held out for validation, and a byte-level BPE
tokenizer trained on the training part. For loss checks on a machine that reaches no hub (tests/perf/on_gpu.sh
compares bf16 with float8 on it).

    python tests/perf/learnable_corpus.py OUTDIR    # OUTDIR/corpus/{train,validation}.txt, OUTDIR/tokenizer
"""

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB = 4096
HELD_OUT = 0.05


def repository_lines():
    paths = sorted(
        p for suffix in ("py", "md", "sh") for p in REPO.rglob(f"*.{suffix}") if ".venv" not in p.parts
    )
    return [line for path in paths for line in path.read_text(errors="replace").splitlines() if line.strip()]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("outdir", type=Path)
    out = parser.parse_args().outdir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = repository_lines()
    split = int(len(lines) * (1 - HELD_OUT))
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "train.txt").write_text("\n".join(lines[:split]) + "\n")
    (corpus / "validation.txt").write_text("\n".join(lines[split:]) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus / "train.txt")], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(out / "tokenizer")
    size = (corpus / "train.txt").stat().st_size
    print(f"corpus: {len(lines):,} lines ({size / 1e6:.2f} MB to train on), tokenizer of {VOCAB} tokens")


if __name__ == "__main__":
    main()
