"""specserve's engine: lossless speculative decoding at batch size 1."""
