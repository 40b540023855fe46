"""The production-shaped stack on one machine (``prodrl up``): S3, MLflow, Dagster, the deployment."""
