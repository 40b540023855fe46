"""The store's key scheme: where every document of the loop lives (one place, not f-strings).

    deploy/live.json                 the live deployment          deploy/history.json   deployed versions
    deploy/events.json               every deploy and rollback    rounds/<round>/reevaluations/<at>.json
    rounds/<round>/dataset.parquet   the round's selected calls   rounds/<round>/batch.json  minibatches
    rounds/<round>/train_steps.json  per-step metrics             rounds/<round>/heldout.json  evaluation
    rounds/<round>/decision.json     the gate decision            rounds/<round>/summary.json  summary
    rounds/<round>/train_workers/rank<r>.json   where each training rank ran (pid, node)
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


def canary_scoring(rkey: str) -> str:
    return round_doc(rkey, "canary_scoring.json")


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


def train_worker(rkey: str, rank: int) -> str:
    """Where a training rank records its process (rank, pid, node) when it starts."""
    return round_doc(rkey, f"train_workers/rank{rank}.json")


def train_failure(rkey: str) -> str:
    """Why the round's last training job failed, in a sentence naming the worker (Ray)."""
    return round_doc(rkey, "train_workers/failure.json")


def train_result(rkey: str) -> str:
    """Rank 0's figures of the round's last training job on Ray (read back by the job's driver)."""
    return round_doc(rkey, "train_workers/result.json")
