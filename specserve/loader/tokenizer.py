"""Transformers tokenizers (with chat template) from a model folder or a GGUF file, never from the network."""
import os

# Must be set before transformers (and huggingface_hub) read them at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

from transformers import AutoTokenizer, PreTrainedTokenizerBase  # noqa: E402

from specserve.loader.checkpoint import ModelLoadError  # noqa: E402


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    path = Path(path)
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path} ({type(e).__name__}: {e}); the folder "
                             "needs tokenizer.json/tokenizer_config.json, a GGUF file tokenizer.ggml.* metadata") from e


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                   tools: list[dict] | None = None) -> list[int]:
    """A chat's prompt: the model's chat template over `messages` (and `tools`, for a template that takes them),
    ending in the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
