"""`b70ctl verify` and `b70ctl demo`: the replication check against one endpoint, and the embedded default end to end.

- pipeline: the checks in order (smoke, greedy correctness with the gate against silent garbage, throughput),
  judged against the recipe's claims, with the roofline;
- run_dir: the --out directory a run owns, and the report rewritten after every check (partial until the last);
- embedded: the embedded default's tiny models and local vLLM servers (demo, the tune without --host, the tests);
- demo: the embedded default served and verified, leaving nothing running;
- cli: the two commands, and the endpoint and API key arguments they parse.

Nothing is imported here, so that `b70ctl.verify.embedded` loads without the checks' HTTP client.
"""
