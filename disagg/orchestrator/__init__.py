"""The central router: instance registry, request state machine, dispatch, stats."""
