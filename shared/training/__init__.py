"""Training: the one local-training loop (``loop``, with the four phases of its step) used by centralized runs
and by sites, what a step reads (``batches``), the optimizer and its schedule (``schedule``), its helpers
(``weight_average``, ``allocator``), the centralized runs (``runs``, public pretraining among them) and their
provenance.
"""
