"""Top-k along the last axis and the fused beam-search step (`topk`); the user-facing API is `tvmseq.beam`."""
