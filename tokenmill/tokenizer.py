"""Loading a model's tokenizer (from its local directory only), for the front end and for workers that need one
(structured outputs' grammars). Free of engine imports: workers import it too."""
from __future__ import annotations


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """A ValueError naming the directory where there is none, or its files do not load."""
    import os

    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory not found: {path!r} (tokenizers load from local directories only)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers' own kinds: a missing backend, a corrupt tokenizer.json, ...
        raise ValueError(f"cannot load the tokenizer in {path!r}: {type(e).__name__}: {e}") from e
