from dagster import DynamicPartitionsDefinition

# One partition per prod-RL round: round-000001, round-000002, ... (round-000000 is the base policy).
rounds_partitions = DynamicPartitionsDefinition(name="rounds")
ROUND_TAG = "prodrl/round"  # tag concurrency limit: one round at a time

import functools

from dagster import Backoff, Failure, RetryPolicy, asset

from prodrl_pipelines.rounds import RoundError

# Transient store/service errors are retried; a RoundError (bad data or settings) is not.
ROUND_RETRY = RetryPolicy(max_retries=2, delay=2, backoff=Backoff.EXPONENTIAL)


def round_asset(**kwargs):
    """@asset for one step of a round: partitioned by round, retried on transient errors only."""

    def decorate(fn):
        @functools.wraps(fn)
        def step(*args, **kw):
            try:
                return fn(*args, **kw)
            except RoundError as e:
                raise Failure(description=str(e), allow_retries=False) from e

        return asset(partitions_def=rounds_partitions, group_name="prod_rl_round", retry_policy=ROUND_RETRY,
                     **kwargs)(step)

    return decorate
