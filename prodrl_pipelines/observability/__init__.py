"""What the services and the trainer tell a platform team: JSON log lines and Prometheus metrics."""
