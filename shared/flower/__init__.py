"""The Flower boundary: what server and sites say to each other (``messages``), Flower's run config
(``run_config``), the waits of Flower processes (``waits``) and the logging of its app processes.
"""
