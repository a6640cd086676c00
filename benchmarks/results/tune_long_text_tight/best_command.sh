# no trial met every SLO; the closest:
tokenmill serve --model /tmp/tokenmill-bench/tiny-shakespeare-pos8k --max-model-len 8704 --max-num-seqs 4 --max-num-batched-tokens 2048 --long-prefill-token-threshold 512 --enable-prefix-caching --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
