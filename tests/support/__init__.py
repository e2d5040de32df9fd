"""The tests' shared harnesses (not test modules): ``federation`` (a tiny world, Flower's environment, process
helpers, the in-process grid and the pilot), ``site`` (a site policy, train requests and ledger rows for
in-process rounds of the site's handler), ``models`` (the pose model and batches for the per-sample gradient
tests, a recorded local-training run), ``toy`` (a toy pose model) and ``hostile_server`` (a ServerApp that
attacks a real site, run as a script by tests/test_hostile_server.py).

Tests import them as ``from support.federation import ...``: pytest puts tests/ on ``sys.path`` (the rootdir
of tests/conftest.py, in its default prepend import mode).
"""
