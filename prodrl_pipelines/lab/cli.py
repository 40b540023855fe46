"""The lab's commands (entry point group ``prodrl_pipelines.cli``): ``prodrl demo``, ``prodrl lab ablate``
and ``prodrl lab reward-hacking``."""

from __future__ import annotations

from prodrl_pipelines.lab.demo import cmd_demo


def add_lab_commands(sub) -> None:
    """``prodrl demo``, ``prodrl lab ablate`` and ``prodrl lab reward-hacking``."""
    d = sub.add_parser("demo", help="lab: run the prod-RL loop end to end through Dagster")
    d.add_argument("--name", default="demo")
    d.add_argument("--rounds", type=int, default=8)
    d.add_argument("--runs-dir", default="runs")
    d.add_argument("--settings", help="JSON file of ProdRLSettings overrides")
    d.add_argument("--engine", choices=["local", "vllm"], default="local",
                   help="who serves the deployment: prodrl serve on the local engine, or a real vLLM "
                        "redeployed each round by the vllm-restart deploy target")
    d.set_defaults(fn=cmd_demo)
    lab = sub.add_parser("lab", help="laboratory commands (ablate: recipes x seeds -> report; reward-hacking: the walkthrough)")
    lab_sub = lab.add_subparsers(dest="lab_cmd", required=True)
    from prodrl_pipelines.lab.ablation_cli import add_ablate_parser

    add_ablate_parser(lab_sub)  # prodrl lab ablate --config ablations/default.yaml [--quick] [--workers 2]
    from prodrl_pipelines.lab.reward_hacking import add_reward_hacking_parser

    add_reward_hacking_parser(lab_sub)  # prodrl lab reward-hacking [--hack-rounds 4] [--fixed-rounds 3]
