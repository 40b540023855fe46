"""Graders for tests/test_rewards.py (importable as ``reward_graders:NAME``): deterministic rules on
the recorded outputs, one that raises on some trajectories, one that cannot tell on others."""


def length_grader(trajectory):
    """1.0 when every output is at most 3 characters, else 0.0."""
    return float(all(len(o) <= 3 for o in trajectory.outputs))


def strict_grader(trajectory):
    """The fixed version: only outputs that are digits count."""
    return float(all(o.strip().isdigit() for o in trajectory.outputs))


def flaky_grader(trajectory):
    if "boom" in trajectory.outputs[-1]:
        raise RuntimeError(f"cannot grade {trajectory.trajectory_id}")
    if "?" in trajectory.outputs[-1]:
        return None  # cannot tell: stays pending
    return 0.5


def bad_type_grader(trajectory):
    return "high"
