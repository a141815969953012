"""`b70ctl tune`: the best settings of a recipe's tune space for one host, found by measurement.

Each candidate (a set of overrides of the recipe's knobs) is served, must pass greedy correctness against the
target-only baseline, and is measured with verify's throughput workloads on the engine's clock. Scores are robust
lower bounds of the per-request decode rate (score.py); the search is successive halving under a request budget
(search.py); every measurement is appended to a state file, so an interrupted tune resumes (state.py). Who starts
and stops the servers is behind one small interface (serving.py).
"""
