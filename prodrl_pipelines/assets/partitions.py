"""The rounds partitions, the run tags of rounds and registry decisions, and the round-step decorator."""

import functools
import inspect
import warnings

from dagster import Backoff, DynamicPartitionsDefinition, Failure, RetryPolicy, asset

from prodrl_pipelines.loop.services import RoundError

# The round's checks (the gate, the behaviour monitors) are partitioned like the round: a preview
# feature of Dagster that says so on every import.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec is currently in preview")

# One partition per prod-RL round: round-000001, round-000002, ... (round-000000 is the base policy).
rounds_partitions = DynamicPartitionsDefinition(name="rounds")
ROUND_TAG = "prodrl/round"  # tag concurrency limit: one round at a time (review runs queue behind it)
# a registry decision's run (the registry sensor's): what the reviewer asked for, who, when, which version
ACTION_TAG, BY_TAG, AT_TAG, MODEL_VERSION_TAG = "prodrl/review-action", "prodrl/review-by", "prodrl/review-at", "prodrl/model-version"

# Transient store/service errors are retried; a RoundError (bad data or settings) is not.
ROUND_RETRY = RetryPolicy(max_retries=2, delay=2, backoff=Backoff.EXPONENTIAL)


def round_asset(**kwargs):
    """@asset for one step of a round: partitioned by round, retried on transient errors only."""

    def decorate(fn):
        if inspect.isgeneratorfunction(fn):  # an asset that may not materialise (output_required=False)
            @functools.wraps(fn)
            def step(*args, **kw):
                try:
                    yield from fn(*args, **kw)
                except RoundError as e:
                    raise Failure(description=str(e), allow_retries=False) from e
        else:
            @functools.wraps(fn)
            def step(*args, **kw):
                try:
                    return fn(*args, **kw)
                except RoundError as e:
                    raise Failure(description=str(e), allow_retries=False) from e

        return asset(partitions_def=rounds_partitions, group_name="prod_rl_round", retry_policy=ROUND_RETRY,
                     **kwargs)(step)

    return decorate
