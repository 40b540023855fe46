"""The store's key scheme: where every document of the loop lives (one place, not f-strings).

    deploy/live.json                 the live deployment          deploy/history.json   deployed versions
    deploy/events.json               every deploy and rollback    rounds/<round>/reevaluations/<at>.json
    rounds/<round>/dataset.parquet   the round's selected calls   rounds/<round>/batch.json  minibatches
    rounds/<round>/train_steps.json  per-step metrics             rounds/<round>/heldout.json  evaluation
    rounds/<round>/decision.json     the gate decision            rounds/<round>/summary.json  summary
    evals/<policy_version>.json      held-out rewards per task of a policy
    traffic/batches.json             the lab's traffic batches
"""

LIVE = "deploy/live.json"
HISTORY = "deploy/history.json"
EVENTS = "deploy/events.json"
ROUNDS = "rounds/"
TRAFFIC_BATCHES = "traffic/batches.json"


def round_doc(rkey: str, name: str) -> str:
    return f"{ROUNDS}{rkey}/{name}"


def scoring(rkey: str) -> str:
    return round_doc(rkey, "scoring.json")


def dataset(rkey: str) -> str:
    return round_doc(rkey, "dataset.parquet")


def batch(rkey: str) -> str:
    return round_doc(rkey, "batch.json")


def train_steps(rkey: str) -> str:
    return round_doc(rkey, "train_steps.json")


def heldout(rkey: str) -> str:
    return round_doc(rkey, "heldout.json")


def decision(rkey: str) -> str:
    return round_doc(rkey, "decision.json")


def summary(rkey: str) -> str:
    return round_doc(rkey, "summary.json")


def policy_eval(policy_version: str) -> str:
    return f"evals/{policy_version}.json"


def reevaluation(rkey: str, stamp: str) -> str:
    """An explicit re-evaluation of a round's export, stored beside (never over) its heldout.json."""
    return round_doc(rkey, f"reevaluations/{stamp}.json")
