"""Graders for the canary tests (importable as ``canary_graders:NAME``, also from the Dagster daemon
with ``tests`` on PYTHONPATH): rules over what the store recorded, deterministic."""

WORSE = "round-000001"  # the candidate these graders find worse


def worse_candidate(trajectory):
    """0.0 for every trajectory ``WORSE`` served, 1.0 for any other (constant, so a verdict never
    depends on which trajectories a sensor tick happened to see)."""
    return 0.0 if trajectory.metadata.get("policy_version") == WORSE else 1.0
