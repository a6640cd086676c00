tokenmill serve --model /tmp/tokenmill-bench/qwen2.5-0.5b-layers-vocab4096 --dtype bfloat16 --load-format dummy --max-num-seqs 32 --no-enable-chunked-prefill --quantization w8a8
