"""The ``prodrl`` command line: thin verbs over ``loop``, ``trajectories`` and ``stack``."""
