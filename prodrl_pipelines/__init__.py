"""prodrl_pipelines: production RL as partitioned Dagster assets (see DESIGN.md)."""
