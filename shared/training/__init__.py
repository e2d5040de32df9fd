"""Training: the one local-training loop (``loop``) used by centralized runs and by sites, the four phases
of its step (``local_step``), what a step reads (``batches``), the optimizer and its schedule
(``schedule``), its helpers (``weight_average``, ``allocator``), public pretraining, the centralized
runs and their provenance.
"""
