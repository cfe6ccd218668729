"""The orchestrator's scheduling: the request queue the `schedule` setting chooses, admission beside it, the placement
chain ending in the dispatch policy, deadlines (predictions, slack, urgency) and the LoRA affinity rules."""
