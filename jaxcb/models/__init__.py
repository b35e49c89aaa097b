"""Model families, their contracts and registry, and the loaders of checkpoints and tokenizers.

Importing this package hides one line transformers logs when it is imported without PyTorch
("PyTorch was not found. Models won't be available ..."): jaxcb uses transformers for its
tokenizers and configs only, and runs the models itself, so without torch nothing is missing.
"""

import logging


class _NoTorchNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


if not any(isinstance(f, _NoTorchNotice) for f in logging.getLogger("transformers").filters):
    logging.getLogger("transformers").addFilter(_NoTorchNotice())
