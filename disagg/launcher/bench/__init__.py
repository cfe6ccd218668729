"""`disagg bench`: load generators against a running deployment (closed-loop, HTTP, trace replay) and the stage
handoff per transfer engine."""
