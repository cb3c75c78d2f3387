"""Tuning: a GEMM schedule template with its search space (space), a genetic search over it that
builds here and measures on the GPU (genetic), MetaSchedule's evolutionary search with tvmseq's
builder settings, databases and progress (metaschedule)."""
