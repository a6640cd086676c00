tokenmill serve --model /work/main/tokenmill/assets/models/tiny-shakespeare --max-num-seqs 16 --no-enable-chunked-prefill --no-enable-prefix-caching --block-size 16 --kv-host-cache-gb 0.0
