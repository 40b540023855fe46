"""Rewards for recorded traffic: the sources that produce them (a client's feedback, a programmatic
grader, an LLM judge), the rule that combines them, scoring what lacks one, and re-scoring stored
trajectories when a source changes (every row keeps its source and version)."""
