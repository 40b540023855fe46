"""Configuration: the typed settings, the one reader of ``PRODRL_*`` variables, checks before work."""
