"""torchao is installed for --float8, which imports it itself (run/model/float8.py). transformers would import
it too, in every process, as soon as a model class is imported: only to load checkpoints quantised by
torchao, which no run here starts from. That costs each process about 1.4 s of CPU at start (measured on the
2-core machine: 6.9 s against 5.5 s to import GPT2LMHeadModel) and prints notices a user can do nothing
about. torchao_for_float8_only() tells transformers that torchao is absent, and keeps torchao's own notices
(extensions built for another torch not loaded, which float8 training does not use; torch's deprecation of
how torchao registers its enums) out of a float8 run's output. Call it before any model class is imported."""

import logging
import os

NOTICES = {
    "torchao": "Skipping import of cpp extensions",
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
}


class DropNotice(logging.Filter):
    def __init__(self, text):
        super().__init__()
        self.text = text

    def filter(self, record):
        return self.text not in record.getMessage()


def torchao_for_float8_only():
    import transformers.utils
    import transformers.utils.import_utils

    absent = lambda *args, **kwargs: False  # noqa: E731
    transformers.utils.is_torchao_available = transformers.utils.import_utils.is_torchao_available = absent
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    for name, text in NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropNotice) and f.text == text for f in logger.filters):
            logger.addFilter(DropNotice(text))
