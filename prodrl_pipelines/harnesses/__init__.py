"""The evaluation harnesses this project ships, one module each, above ``evaluation`` and ``rewards``.

A harness is another project's way of running tasks and scoring answers. Each module here gives it
both roles: a held-out suite played against the served policy (``eval_suite: "NAME:ARG"``) and a
reward source scoring recorded traffic (``rewards_sources: [NAME]``). pyproject.toml registers both
as entry points (``prodrl_pipelines.eval_suites``, ``prodrl_pipelines.reward_sources``), as a
plug-in registers its own; ``evaluation`` and ``rewards`` find them there and never import this
package. Adding a harness is one module and its two entry-point lines.

- ``command``: any program (``command:<command line>``, ``rewards_command``);
- ``inspect_ai_tasks``: an inspect-ai task (``inspect:package.module:task``, ``rewards_inspect_task``);
- ``verifiers_tasksets``: a verifiers taskset in its own environment (``verifiers:<taskset>``,
  ``rewards_verifiers_taskset``), through ``command`` with ``verifiers_bridge`` as the program.
"""
