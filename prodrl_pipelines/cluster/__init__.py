"""Where the heavy steps of a round run: this process (``cluster: local``) or a Ray cluster
(``cluster: ray``), reached through Ray's job submission API (dagster-ray's Pipes client)."""
