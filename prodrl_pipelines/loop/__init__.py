"""The round, free of Dagster: each asset calls exactly one step here, then its lineage hook.

data (select -> batch) -> train -> export -> evaluate -> gate, then promotion (deploy: ``auto``, or a
reviewer's approval or rollback from the registry). Every step reads its inputs from the stores by
round key (``storage.keys``) and writes its outputs back, so any step can be re-run alone and a
crashed round resumed from the last finished step. Round 0 is ``bootstrap``; what the steps work
with is ``services``; what a round's decision means is ``round_state``; the ledger of rounds is
``ledger``; when the next round starts is ``schedule``.
"""
