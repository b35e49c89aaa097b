"""Models named by their Hugging Face hub id ("HuggingFaceTB/SmolLM2-135M-Instruct").

`LLM("org/name")` goes through huggingface_hub's cache and download, as transformers does:
the snapshot is fetched once into the hub cache ($HF_HOME, ~/.cache/huggingface), then read
from there like any model directory; HF_HUB_OFFLINE=1 uses the cache alone. With no network
(or offline) and nothing cached, the error is one line saying what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxcb.models.weights import ModelLoadError

#: What a Hugging Face model directory needs: config, safetensors weights, tokenizer and chat
#: template files. PyTorch .bin weights, other frameworks' files and GGUF files (a GGUF repo
#: holds one file per quantization: download the one you want and pass its path) are not
#: downloaded.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(model: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def download(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id`, downloaded (or found in the cache)."""
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        path = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS
        )
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{repo_id} is not in the Hugging Face cache and the hub cannot be reached (no "
            "network, or HF_HUB_OFFLINE=1): download it where the hub is reachable (`hf "
            f"download {repo_id}`, then copy the cache, $HF_HOME), or pass a local model "
            "directory or .gguf file"
        ) from None
    except GatedRepoError:
        raise ModelLoadError(
            f"{repo_id} is gated on the Hugging Face hub: accept its terms on the model page "
            "and log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"{repo_id} is not a model on the Hugging Face hub (or it is private: log in "
            "with `hf auth login` or HF_TOKEN)"
        ) from None
    return Path(path)
