from dagster import DynamicPartitionsDefinition

# One partition per prod-RL round: round-000001, round-000002, ... (round-000000 is the base policy).
rounds_partitions = DynamicPartitionsDefinition(name="rounds")
ROUND_TAG = "prodrl/round"  # tag concurrency limit: one round at a time
