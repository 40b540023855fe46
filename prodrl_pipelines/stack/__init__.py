"""The production-shaped stack on one machine (``prodrl up``): S3, MLflow, Dagster, the deployment."""

from prodrl_pipelines.stack.stack import Stack, up

__all__ = ["Stack", "up"]
