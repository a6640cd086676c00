"""Loading a model's tokenizer (from its local directory only), for the front end and for workers that need one
(structured outputs' grammars). Free of engine imports: workers import it too."""
from __future__ import annotations


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
