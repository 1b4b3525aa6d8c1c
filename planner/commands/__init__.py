"""Sub-commands of the `meshplan` CLI that belong to the planner (each module has `register(subparsers)`)."""
