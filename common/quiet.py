"""torchao (--float8) is imported by transformers whenever a model class is, in every run. Its import says
three things a user can do nothing about: compiled extensions built for another torch failed to load (float8
training needs none of them), that their loading was skipped, and torch's notice that torchao registers its
enums in a way torch will drop. quiet_torchao() keeps those out of a run's output and nothing else: call it
before a model class is imported."""

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


def quiet_torchao():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    for name, text in NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropNotice) and f.text == text for f in logger.filters):
            logger.addFilter(DropNotice(text))
